"""FlexRLHF's placements and the co-located heuristic.

A placement says where each model runs: a ratio of the training device group per model
(FlexRLHF's ``[actor, critic, ref, reward]``, e.g. ``[1, 1, 0.5, 0.5]``) or explicit rank sets
per model or per call. Ratios of 1 take the whole group; smaller ones are packed left to right
in model order, wrapping to the start when the group is full, so ``[1, 1, 0.5, 0.5]`` puts the
Ref on the first half and the Reward on the second. Every rank set must be a legal mesh:
whole nodes, or a slice of one node whose size divides it.

Without a Critic (GRPO, RLOO, REINFORCE++) or a reward model (a rule or function reward) the
absent model's ratio is skipped and its calls are left out; the others keep their meshes, so
``interleaved2`` still puts the Actor with the Ref on one half and the reward model on the
other.

Presets:

* ``colocated``: every model on every GPU (DeepSpeed-Chat, FlexRLHF's "flattening");
* ``interleaved``: Actor and Critic everywhere, Ref and Reward on disjoint halves, so the two
  frozen models score at the same time and each GPU stores one of them;
* ``interleaved2``: Actor with Ref on one half, Critic with Reward on the other;
* ``disaggregated``: training ranks run the two training calls; the inference ranks (the
  inference-only group when the cluster has one, else the last ``inference_fraction`` of the
  nodes) run generation and the three inference calls, with shadow Actor and Critic synced from
  the training layout after every PPO round (reallocation nodes in the estimate).

Parallel strategies follow the problem's ``parallelism``. ``megatron``: the Megatron-LM recipe
per model, the smallest model-parallel degree (tensor parallelism inside a node first, then
pipeline stages) at which the plan fits, data parallelism for the rest, one strategy for all of
a model's calls on the same mesh. ``zero3``: DeepSpeed-Chat's (FlexRLHF's baseline system):
every call ZeRO-3 data parallel over its whole mesh, and generation through the hybrid engine,
tensor parallel at the smallest degree that fits (its gather from the ZeRO-3 shards is the
reallocation node before generation). ``deepspeed-chat``: DeepSpeed-Chat as FlexRLHF measures it
(``DS_CHAT_CONFIGS``, ``_ds_chat_ladder``): ZeRO-2 with replicated Ref and Reward where that
fits, else ZeRO-3, and the hybrid engine gathering the Actor once or on every decode step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import PlacementError
from .estimate import Estimator
from .graph import CALL_MODEL, CALLS, MODELS, calls_of
from .hardware import Cluster
from .layout import Layout
from .mesh import DeviceMesh, make_mesh, mesh_from_ranks
from .plan import CallPlacement, ExecutionPlan
from .problem import PlacementProblem
from .strategy import strategies_for

PRESETS: dict[str, tuple[float, float, float, float]] = {
    "colocated": (1, 1, 1, 1),
    "interleaved": (1, 1, 0.5, 0.5),
    "interleaved2": (0.5, 0.5, 0.5, 0.5),
}
PRESET_NAMES = ("colocated", "interleaved", "interleaved2", "disaggregated")


@dataclass(frozen=True)
class Placement:
    """Ratios per model, or explicit ranks per model or call, or the disaggregated split."""

    ratios: tuple[float, float, float, float] | None = None
    ranks: Mapping[str, Sequence[int]] = field(default_factory=dict)
    disaggregated: bool = False
    inference_fraction: float = 0.5
    name: str = ""


def _ratio_mesh(cluster: Cluster, ratio: float, start_frac: float, who: str) -> DeviceMesh:
    g = cluster.train_group
    n = ratio * g.size
    if n != int(n) or n < 1:
        raise PlacementError(f"{who}: ratio {ratio} of {g.size} GPUs is not a whole number of "
                             f"GPUs; use a ratio that is a multiple of 1/{g.size}")
    n = int(n)
    start = int(round(start_frac * g.size))
    if n >= g.gpus_per_node:
        if n % g.gpus_per_node or start % g.gpus_per_node:
            raise PlacementError(f"{who}: ratio {ratio} gives {n} GPUs from GPU {start}, not whole "
                                 f"nodes of {g.gpus_per_node}; use a ratio that is a multiple of "
                                 f"{g.gpus_per_node}/{g.size} (node topology)")
        return make_mesh(cluster, g.name, start // g.gpus_per_node, n // g.gpus_per_node)
    return make_mesh(cluster, g.name, start // g.gpus_per_node, 1, start % g.gpus_per_node, n)


def ratio_meshes(cluster: Cluster, ratios: Sequence[float]) -> dict[str, DeviceMesh]:
    """Model -> mesh for FlexRLHF ratios ``[actor, critic, ref, reward]``."""
    if len(ratios) != 4:
        raise PlacementError(f"placement ratios: give 4 numbers [actor, critic, ref, reward], "
                             f"got {list(ratios)}")
    out = {}
    cursor = 0.0
    for model, r in zip(MODELS, ratios):
        if not 0 < r <= 1:
            raise PlacementError(f"placement ratio of {model} is {r}; use 0 < ratio <= 1")
        if r == 1:
            out[model] = _ratio_mesh(cluster, 1.0, 0.0, model)
            continue
        if cursor + r > 1 + 1e-12:
            cursor = 0.0
        out[model] = _ratio_mesh(cluster, r, cursor, model)
        cursor += r
        if cursor >= 1 - 1e-12:
            cursor = 0.0
    return out


def _disaggregated_meshes(cluster: Cluster, fraction: float) -> tuple[DeviceMesh, DeviceMesh]:
    inf_groups = [g for g in cluster.groups if g.inference_only]
    g = cluster.train_group
    if inf_groups:
        ig = inf_groups[0]
        return make_mesh(cluster, g.name, 0, g.nodes), make_mesh(cluster, ig.name, 0, ig.nodes)
    if g.nodes >= 2:
        k = int(round(fraction * g.nodes))
        if not 0 < k < g.nodes:
            raise PlacementError(f"inference_fraction {fraction} of {g.nodes} nodes leaves no "
                                 "training or no inference node; use a fraction between "
                                 f"{1 / g.nodes} and {1 - 1 / g.nodes}")
        return (make_mesh(cluster, g.name, 0, g.nodes - k),
                make_mesh(cluster, g.name, g.nodes - k, k))
    half = g.gpus_per_node // 2
    if half < 1:
        raise PlacementError("disaggregated needs at least 2 GPUs")
    k = max(1, int(round(fraction * g.gpus_per_node)))
    if k != half:
        raise PlacementError(f"on one node, disaggregated splits the node in halves; use "
                             f"inference_fraction 0.5 (got {fraction}) or add nodes")
    return make_mesh(cluster, g.name, 0, 1, 0, half), make_mesh(cluster, g.name, 0, 1, half, half)


def placement_meshes(problem: PlacementProblem, placement: Placement) -> dict[str, DeviceMesh]:
    """Call -> mesh, for the problem's calls."""
    return cluster_meshes(problem.cluster, placement, problem.roles)


def preset_placement(name: str, inference_fraction: float = 0.5) -> Placement:
    """The :class:`Placement` of a preset name."""
    if name == "disaggregated":
        return Placement(disaggregated=True, inference_fraction=inference_fraction, name=name)
    if name in PRESETS:
        return Placement(ratios=PRESETS[name], name=name)
    raise PlacementError(f"unknown placement preset {name!r}; use one of {list(PRESET_NAMES)}")


def cluster_meshes(cl: Cluster, placement: Placement, models: Sequence[str] = MODELS
                   ) -> dict[str, DeviceMesh]:
    """Call -> mesh on a cluster (no model sizes needed), for the calls of ``models``."""
    calls = calls_of(models)
    if placement.disaggregated:
        train, infer = _disaggregated_meshes(cl, placement.inference_fraction)
        return {c: (train if c.endswith("_train") else infer) for c in calls}
    by_model: dict[str, DeviceMesh] = {}
    if placement.ratios is not None:
        by_model = ratio_meshes(cl, placement.ratios)
    out = {c: by_model.get(CALL_MODEL[c]) for c in calls}
    for key, ranks in placement.ranks.items():
        mesh = mesh_from_ranks(cl, ranks)
        if key in calls:
            out[key] = mesh
        elif key in MODELS and key in models:
            for c in calls:
                if CALL_MODEL[c] == key:
                    out[c] = mesh
        elif key in MODELS or key in CALLS:
            raise PlacementError(f"placement ranks: {key!r} is not part of this run (its models "
                                 f"are {list(models)}); drop it or add the model")
        else:
            raise PlacementError(f"placement ranks: {key!r} is neither a model {list(MODELS)} "
                                 f"nor a call {list(CALLS)}")
    missing = [c for c, m in out.items() if m is None]
    if missing:
        raise PlacementError(f"placement leaves {missing} without ranks; give ratios or ranks "
                             "for every model")
    return out  # type: ignore[return-value]


# DeepSpeed-Chat's engine configurations, tried in this order until the plan fits: ZeRO-2
# (frozen models replicated), ZeRO-3 with the hybrid engine's gather-once generation
# (pin_parameters, the default), ZeRO-3 with per-layer gathers on every decode step
# (--unpin_actor_parameters). Stage and pinning are chosen at the batch the plan is fitted
# for; FlexRLHF picks the stage by model size and then raises the batch (``max_batch``).
DS_CHAT_CONFIGS = ((2, True), (3, True), (3, False))


def _ladder_key(problem: PlacementProblem, call: str, mesh: DeviceMesh) -> tuple:
    """Calls with one key share a strategy: a model's calls on one mesh (under ``zero3`` and
    ``deepspeed-chat`` the hybrid engine's generation has its own)."""
    return (CALL_MODEL[call], mesh.ranks,
            problem.parallelism != "megatron" and call == "actor_gen")


def _megatron_ladder(mesh: DeviceMesh, problem: PlacementProblem, model: str
                     ) -> list[Layout]:
    ss = strategies_for(mesh, problem.models[model], max_tp=problem.max_tp,
                        max_pp=problem.max_pp)
    return sorted(ss, key=lambda s: (s.tp * s.pp, s.pp, s.tp))


def _ds_chat_ladder(mesh: DeviceMesh, problem: PlacementProblem, key: tuple,
                    meshes: dict[str, DeviceMesh], config: tuple[int, bool]
                    ) -> list[Layout]:
    """DeepSpeed-Chat (as FlexRLHF runs it, section V-B): every model data parallel over its
    own mesh at one ZeRO stage; at stage 2 the frozen Ref and Reward are plain replicas
    (DeepSpeed-Chat's rlhf_engine: ``if zero_stage != 3: zero_stage = 0``), at stage 3 they are
    sharded too. The Actor generates through the hybrid engine in its training layout (stage
    2: the same replicas, LoRA fused in place), with the layers gathered once (pinned, a
    reallocation to the replicated layout) or on every decode step (unpinned, the ZeRO-3
    layout itself). Calls away from their model's training mesh (FlexRLHF's shadow models) and
    calls on inference-only groups use tensor/pipeline parallelism as Megatron does."""
    model, ranks, gen = key
    stage, pinned = config
    home = meshes.get(f"{model}_train")
    if problem.cluster.group(mesh.group).inference_only or (home is not None
                                                             and home.ranks != ranks):
        return _megatron_ladder(mesh, problem, model)
    n = mesh.size
    if gen and stage == 3:
        return [Layout(n, 1, 1, 0 if pinned else 3)]
    if model in ("ref", "reward"):
        return [Layout(n, 1, 1, 3 if stage == 3 else 0)]
    return [Layout(n, 1, 1, stage)]


def _ladder(mesh: DeviceMesh, problem: PlacementProblem, key: tuple) -> list[Layout]:
    """Strategies to try in order: by growing model-parallel degree, tensor parallelism first;
    under ``zero3`` pure ZeRO-3 data parallelism, or for the hybrid engine pure tp."""
    model, _, hybrid_engine = key
    ss = _megatron_ladder(mesh, problem, model)
    if problem.parallelism == "zero3":
        if hybrid_engine:
            return [s for s in ss if s.pp == 1]
        return [Layout(mesh.size, 1, 1, 3)]
    return ss


def fit_strategies(problem: PlacementProblem, meshes: dict[str, DeviceMesh], name: str,
                   estimator: Estimator | None = None, offload: tuple[str, ...] = ()
                   ) -> ExecutionPlan:
    """Strategies for fixed meshes (see the module docstring): raise the model-parallel degree
    of the models on the fullest GPU that can still grow one, until the plan fits (or nothing
    over capacity can grow: the estimate then carries the OOM penalty). Under
    ``deepspeed-chat`` the engine configurations of ``DS_CHAT_CONFIGS`` are tried in order and
    the first that fits is kept (the last when none does)."""
    est = estimator or Estimator(problem)
    if problem.parallelism != "deepspeed-chat":
        return _fit(problem, meshes, name, est, offload, None)
    plan = None
    for config in DS_CHAT_CONFIGS:
        plan = _fit(problem, meshes, name, est, offload, config)
        if not est.estimate(plan, keep_timeline=False).oom:
            break
    assert plan is not None
    return plan


def _fit(problem: PlacementProblem, meshes: dict[str, DeviceMesh], name: str, est: Estimator,
         offload: tuple[str, ...], config: tuple[int, bool] | None) -> ExecutionPlan:
    calls = problem.calls
    key_of = {c: _ladder_key(problem, c, meshes[c]) for c in calls}
    keys = sorted(set(key_of.values()))
    mesh_of = {k: next(meshes[c] for c in calls if key_of[c] == k) for k in keys}
    ladders = {k: (_ladder(mesh_of[k], problem, k) if config is None
                   else _ds_chat_ladder(mesh_of[k], problem, k, meshes, config)) for k in keys}
    for k, lad in ladders.items():
        if not lad:
            raise PlacementError(f"{name}: no parallel strategy of {k[0]} fits mesh {mesh_of[k]}")
    level = dict.fromkeys(keys, 0)

    def build() -> ExecutionPlan:
        return ExecutionPlan({c: CallPlacement(meshes[c], ladders[key_of[c]][level[key_of[c]]])
                              for c in calls}, name, offload)

    while True:
        plan = build()
        mem = est.memory(plan)
        over = {r: b / est.cost.capacity(problem.cluster.node_of(r)[0]) for r, b in mem.items()}
        for r in sorted((r for r in over if over[r] > 1.0), key=lambda r: -over[r]):
            grow = [k for k in keys
                    if r in mesh_of[k].rank_set and level[k] + 1 < len(ladders[k])]
            if grow:
                for k in grow:
                    level[k] += 1
                break
        else:
            return plan


def preset_plan(problem: PlacementProblem, name: str, *, estimator: Estimator | None = None,
                inference_fraction: float = 0.5) -> ExecutionPlan:
    """One of ``colocated``, ``interleaved``, ``interleaved2``, ``disaggregated``."""
    placement = preset_placement(name, inference_fraction)
    offload = frozen_offload(problem)
    return fit_strategies(problem, placement_meshes(problem, placement), name, estimator, offload)


def placement_plan(problem: PlacementProblem, placement: Placement, *,
                   estimator: Estimator | None = None) -> ExecutionPlan:
    offload = frozen_offload(problem)
    return fit_strategies(problem, placement_meshes(problem, placement),
                          placement.name or "custom", estimator, offload)


def frozen_offload(problem: PlacementProblem) -> tuple[str, ...]:
    """The frozen models (Ref, and the reward model when there is one) kept in host memory
    between calls: all of them with ``offload_frozen``, else none."""
    if not problem.offload_frozen:
        return ()
    return tuple(m for m in ("ref", "reward") if m in problem.models)


def colocated_heuristic(problem: PlacementProblem, *, estimator: Estimator | None = None
                        ) -> ExecutionPlan:
    """The baseline the search is compared with: every model on every GPU of the training
    group with the Megatron-style strategy (ReaLHF's heuristic plan)."""
    return preset_plan(problem, "colocated", estimator=estimator)
