"""Where the loop runs each model function call: the :class:`LoopPlacement` one
:class:`~rlhf_fusion.loop.iteration.PPOWorker` reads, resolved for the local processes before
any of them starts (:func:`placement_of`).

Every run has one. By default (no ``placement`` section) every call runs on every rank and the
Actor and Critic train on the fused pipeline of ``fusion.pipeline_stages`` stages (default:
every rank), ``world_size / pipeline_stages`` replicas of it; with one process every call is
on rank 0 and training is one data-parallel rank. A critic-free algorithm has no Critic calls
(``critic_inf``, ``critic_train``), and by default its Actor trains data parallel on every
rank. A ``placement`` section gives a FlexRLHF
preset or a plan file instead (:func:`resolve`); the planning side
(:mod:`rlhf_fusion.placement`) describes placements on device meshes, and the loop's processes
form one node of ``world_size`` devices. What the loop executes:

* ``actor_gen``: every rank of its mesh is a generation instance (inter-stage fusion runs
  among them);
* ``ref_inf``, ``reward_inf``, ``critic_inf``: whole copies on every rank of the call's mesh,
  samples shared round-robin (data parallel). When all three share the generation mesh they
  score finished samples while the tail decodes; otherwise each finished sample is queued to
  the call's ranks, which score it while generation goes on, and the scores are gathered back;
* ``actor_train``, ``critic_train``: a layout kind (:data:`TRAINING_KINDS`):
  ``data_parallel`` (whole copies, the replica's micro-batches shared in order, gradients
  all-reduced over the call's ranks) or ``fused_pipeline`` (the fused Actor/Critic pipeline,
  both calls on every rank; a plan gives it with the same ``pp > 1`` for both);
* after each PPO round the trained parameters reach the generation and Critic-inference copies
  from their owners (ReaLHF's parameter reallocation; shadow models under ``disaggregated``);
* the frozen models kept in host memory between calls: ``placement.offload``, else a plan's
  ``offload``.

``ppo.micro_batches`` has one meaning: the micro-batches one training *replica* runs per
mini-batch. A mini-batch is cut into ``replicas`` equal slices (the default's pipeline
replicas; a placement's training is one replica), each split into ``micro_batches``
micro-batches; what runs a model in parallel inside a replica (a Critic's copies in the
pipeline, the data-parallel ranks of a call) shares the replica's micro-batches, so
``micro_batches`` is a multiple of their count (:func:`check_micro_batches`, the one check).

A training call with ``tp > 1`` (``pp = 1``) is ``tensor_parallel``: ``dp`` groups of ``tp``
consecutive ranks, each group one model split by torch's DTensor Megatron plans
(:mod:`rlhf_fusion.runtime.tensor_parallel`), gradients all-reduced between the groups; one
with ``zero = 3`` (``tp = pp = 1``) is ``zero3``: FSDP2 ``fully_shard`` over the call's ranks
(:mod:`rlhf_fusion.runtime.fsdp`). Their weights reach the generation and Critic-inference
copies gathered whole on the training ranks first (:mod:`rlhf_fusion.runtime.sharded_state`),
then by the same reallocation.

Not executed, and rejected with the reason: generation and inference with ``tp > 1``,
``pp > 1`` or ZeRO-3 (they run whole copies); tensor parallelism inside the fused pipeline's
stages (``tp > 1`` with ``pp > 1``); ZeRO-3 with ``tp > 1`` or ``pp > 1``; pipelines for one
model alone.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RLHFFusionError
from ..placement.graph import CALL_KIND, CALL_MODEL, CALLS, MODELS, TRAIN_CALL, calls_of
from ..placement.layout import (  # noqa: F401  (the kinds, named here for the loop's readers)
    DATA_PARALLEL,
    FUSED_PIPELINE,
    KINDS,
    TENSOR_PARALLEL,
    ZERO3,
    Layout,
)
from .config import FROZEN_MODELS, PPOLoopConfig, RLHFConfig, offload_names  # noqa: F401
from .errors import LoopConfigError

INFERENCE_CALLS = tuple(c for c in CALLS if CALL_KIND[c] == "inference")

# How a call's model is laid out on its ranks: the planning layer's Layout and its kinds
# (a new kind is one training engine, rlhf_fusion.runtime.training_engine.ENGINES).
TRAINING_KINDS = KINDS

# Where each trained model's weights go after a round (the Critic-inference copy is the model
# ``critic_inf`` scores with; the Actor's generation copy lives in the backend).
SYNC_TARGET = {"actor": "actor_gen", "critic": "critic_inf"}


class PlacementConfigError(RLHFFusionError, ValueError):
    """A placement the loop cannot run; the message names the reason and the fix."""


@dataclass(frozen=True)
class LoopPlacement:
    """Which ranks hold each of the six calls and how (:class:`~rlhf_fusion.placement.layout.Layout`), how many
    training replicas split a mini-batch, and the frozen models offloaded between calls."""

    name: str
    calls: Mapping[str, Layout]
    world_size: int
    offload: tuple[str, ...] = ()   # frozen models in host memory between calls
    replicas: int = 1               # independent slices of a mini-batch (ppo.micro_batches each)

    @classmethod
    def default(cls, world_size: int, stages: int, critic_stages: int | None = None,
                offload: tuple[str, ...] = (), *, critic: bool = True) -> LoopPlacement:
        """Every call on every rank; with ``world_size > 1`` training on the fused pipeline
        of ``stages`` stages (the Critic's of ``critic_stages``), ``world_size / stages``
        replicas of it; with one rank, training on it alone. ``critic=False`` (a
        critic-free algorithm): no Critic calls, and the Actor trains data parallel on every
        rank (the fused pipeline is the Actor/Critic one)."""
        every = tuple(range(world_size))
        calls = {c: Layout(world_size, ranks=every) for c in CALLS
                 if critic or CALL_MODEL[c] != "critic"}
        replicas = 1
        if world_size > 1 and critic:
            cs = critic_stages or stages
            replicas = world_size // stages
            calls["actor_train"] = Layout(world_size // stages, pp=stages, ranks=every,
                                          kind=FUSED_PIPELINE)
            calls["critic_train"] = Layout(world_size // cs, pp=cs, ranks=every,
                                           kind=FUSED_PIPELINE)
        return cls("default", calls, world_size, offload, replicas)

    # -- queries the worker asks -----------------------------------------------------------------
    def layout(self, call: str) -> Layout:
        return self.calls[call]

    def holds(self, call: str, rank: int) -> bool:
        """Whether ``rank`` runs ``call`` (a call the run does not have: no rank)."""
        return call in self.calls and rank in self.calls[call].ranks

    @property
    def inference_calls(self) -> tuple[str, ...]:
        """The inference calls of this run (no ``critic_inf`` without a Critic)."""
        return tuple(c for c in INFERENCE_CALLS if c in self.calls)

    def generates(self, rank: int) -> bool:
        return self.holds("actor_gen", rank)

    def receives(self, role: str, rank: int) -> bool:
        """Whether ``rank`` holds the generation/inference copy ``role``'s weights go to."""
        return self.holds(SYNC_TARGET[role], rank)

    def trains(self, rank: int) -> tuple[str, ...]:
        """The roles ``rank`` trains."""
        return tuple(role for role, call in TRAIN_CALL.items() if self.holds(call, rank))

    def leads(self, role: str, rank: int) -> bool:
        """The first rank of ``role``'s training call: it reports and saves the model
        (data-parallel layouts; a pipeline's stages are saved by their canonical holders)."""
        return self.calls[TRAIN_CALL[role]].ranks[0] == rank

    @property
    def training_kind(self) -> str:
        """``fused_pipeline`` when both training calls run the fused pipeline (resolution
        never mixes it with another kind); otherwise the Actor's kind: each training call
        then runs its own kind of data-parallel step (:meth:`training_kinds`)."""
        return self.calls["actor_train"].kind

    def training_kinds(self) -> tuple[str, ...]:
        """The kinds of the training calls (Actor, then the Critic's if there is one)."""
        return tuple(self.calls[c].kind for c in TRAIN_CALL.values() if c in self.calls)

    @property
    def fused_training(self) -> bool:
        return self.training_kind == FUSED_PIPELINE

    @property
    def stage_groups(self) -> int:
        """Ranks per training replica: the fused pipeline's stage groups."""
        return len(self.calls["actor_train"].ranks) // self.replicas

    def replica(self, rank: int) -> int:
        """The training replica ``rank`` belongs to (which slice of each mini-batch it
        trains on)."""
        return rank // self.stage_groups if self.replicas > 1 else 0

    def copies(self, call: str) -> int:
        """How many copies of a training call's model run in parallel inside one replica,
        sharing its micro-batches (a Critic's pipeline copies, a call's data-parallel ranks)."""
        return self.calls[call].dp // self.replicas

    @property
    def streamed_inference(self) -> bool:
        """The three inference calls on the generation ranks: scoring overlaps the tail."""
        gen = set(self.calls["actor_gen"].ranks)
        return all(set(self.calls[c].ranks) == gen for c in self.inference_calls)

    @property
    def generators(self) -> tuple[int, ...]:
        """The generation ranks: R_t is planned for them, on the first."""
        return self.calls["actor_gen"].ranks

    def groups(self) -> list[tuple[int, ...]]:
        """Every distinct rank set short of the whole world, in one order all ranks agree on
        (for ``new_group``; the whole world is the default group)."""
        every = tuple(range(self.world_size))
        return sorted({lay.ranks for lay in self.calls.values()} - {every})

    def describe(self) -> str:
        rows = [f"{c:<12} ranks {list(lay.ranks)} dp={lay.dp} tp={lay.tp} pp={lay.pp}"
                + (f" {lay.kind}" if lay.kind != DATA_PARALLEL else "")
                for c, lay in self.calls.items()]
        if self.offload:
            rows.append(f"offload      {', '.join(self.offload)} (host memory between calls)")
        return f"placement {self.name}:\n  " + "\n  ".join(rows)


def placement_of(cfg: RLHFConfig) -> LoopPlacement | None:
    """The placement ``cfg`` runs, checked against the rest of the config: its preset or plan,
    else the default. ``None`` while ``placement.search`` is pending (searched once, before
    the processes start: :func:`search_plan`)."""
    pl, f = cfg.placement, cfg.fusion
    if pl.search is not None:
        if pl.preset is not None or pl.plan is not None:
            raise LoopConfigError("placement: give one of preset, plan or search")
        if not pl.search > 0:
            raise LoopConfigError(f"placement.search: {pl.search!r}; give the search "
                                  "time in seconds (> 0)")
        check_micro_batches(cfg.ppo, cfg.generation.prompts_per_iteration, None)
        return None
    own = offload_names(pl.offload)
    if pl.preset is None and pl.plan is None and cfg.algorithm.critic_free:
        if f.pipeline_stages not in (None, 1) and cfg.world_size > 1:
            raise LoopConfigError(
                f"fusion.pipeline_stages: {f.pipeline_stages}, but algorithm.name "
                f"{cfg.algorithm.name} trains the Actor alone and the fused pipeline is the "
                "Actor/Critic one (a pipeline for one model alone is not executed); remove "
                "fusion.pipeline_stages (the Actor then trains data parallel on every rank) "
                "or give a placement (preset, plan or search; tensor parallel and ZeRO-3 plans "
                "run)")
        lp = LoopPlacement.default(cfg.world_size, 1, None, own or (), critic=False)
    elif pl.preset is None and pl.plan is None:
        n, w = cfg.stages(), cfg.world_size
        if w > 1 and w % n:
            raise LoopConfigError(
                f"fusion.pipeline_stages: {n} does not divide world_size={w}; use a divisor "
                f"of {w}")
        cs = f.critic_stages or n
        if w > 1 and n % cs:
            raise LoopConfigError(
                f"fusion.critic_stages: {cs} does not divide pipeline_stages={n}; use a "
                f"divisor of {n}")
        lp = LoopPlacement.default(w, n, cs, own or ())
    else:
        if f.pipeline_stages is not None or f.critic_stages is not None:
            raise LoopConfigError(
                "fusion.pipeline_stages / critic_stages: under a placement the training "
                "layout comes from the placement (a plan's pp); remove them")
        if cfg.generation.backend != "reference":
            raise LoopConfigError("placement: runs with generation.backend: reference only")
        try:
            lp = resolve(pl.preset, pl.plan, cfg.world_size, pl.inference_fraction,
                         planned_models(cfg) if pl.plan is None else None)
        except PlacementConfigError as exc:
            raise LoopConfigError(str(exc)) from exc
        assert lp is not None
        want = calls_of(planned_models(cfg))
        if tuple(c for c in CALLS if c in lp.calls) != want:
            raise LoopConfigError(
                f"placement.plan {pl.plan}: the plan places {sorted(lp.calls)} but this run "
                f"has the calls {list(want)} (models {list(planned_models(cfg))}); search a "
                "plan for this config (`rlhf-fusion place CONFIG`) or use placement.search")
        if own is not None:
            lp = dataclasses.replace(lp, offload=own)
    check_micro_batches(cfg.ppo, cfg.generation.prompts_per_iteration, lp)
    return lp


def check_trainable(placement: LoopPlacement) -> None:
    """Every training call's layout kind has a training engine
    (:data:`rlhf_fusion.runtime.training_engine.ENGINES`), else the reason, by name."""
    from ..runtime.training_engine import ENGINES

    for kind in placement.training_kinds():
        if kind not in ENGINES:
            raise PlacementConfigError(f"placement {placement.name}: training layout {kind!r}; "
                                       f"the loop runs {', '.join(ENGINES)}")


def check_micro_batches(ppo: PPOLoopConfig, batch: int, placement: LoopPlacement | None
                        ) -> None:
    """``ppo.micro_batches`` (per replica, per mini-batch) against the placement: the
    replicas' slices of a mini-batch split into it, and each training call's copies inside a
    replica share it (``placement`` ``None``: a search pending, one replica)."""
    m = ppo.micro_batches
    mini = batch // ppo.num_mini_batches
    replicas = placement.replicas if placement is not None else 1
    if mini % (m * replicas):
        raise LoopConfigError(
            f"ppo.micro_batches: a mini-batch of {mini} samples cannot be split into "
            f"{m} micro-batches x {replicas} data-parallel replicas; pick "
            f"micro_batches dividing {mini // replicas}")
    if placement is None:
        return
    for call in TRAIN_CALL.values():
        if call not in placement.calls:
            continue   # no Critic (a critic-free algorithm)
        k = placement.copies(call)
        if m % k:
            where = (f"placement {placement.name}" if placement.name != "default" else
                     "each pipeline replica (fusion.critic_stages below pipeline_stages runs "
                     "copies)")
            raise LoopConfigError(
                f"ppo.micro_batches: {m} micro-batches per mini-batch and replica cannot be "
                f"shared by the {k} data-parallel ranks of {call} in {where}; use a "
                f"multiple of {k}")


def resolve(preset: str | None, plan: str | Path | None, world_size: int,
            inference_fraction: float = 0.5, models: Sequence[str] | None = None
            ) -> LoopPlacement | None:
    """The loop's placement from a preset name or a plan file (``rlhf-fusion place``'s
    ``plan.json``); ``None`` when neither is given (the default co-located loop). A preset
    places the calls of ``models`` (default: all four); a plan file, the calls it has."""
    if preset is None and plan is None:
        return None
    if preset is not None and plan is not None:
        raise PlacementConfigError("placement: give a preset or a plan file, not both")
    from ..placement import Cluster, PlacementError, mesh_from_ranks
    from ..placement.plan import ExecutionPlan
    from ..placement.presets import cluster_meshes, preset_placement

    if world_size < 2 or world_size & (world_size - 1):
        raise PlacementConfigError(
            f"placement: world_size {world_size} is not a power of two >= 2; the loop's "
            "processes form one node and meshes are power-of-two slices of it")
    cluster = Cluster.uniform(1, world_size)
    try:
        if plan is not None:
            try:
                raw = json.loads(Path(plan).read_text())
            except FileNotFoundError:
                raise PlacementConfigError(
                    f"placement.plan: no file {plan}; write one with `rlhf-fusion place "
                    "CONFIG --out DIR` (DIR/plan.json) or use placement.preset") from None
            except json.JSONDecodeError as exc:
                raise PlacementConfigError(
                    f"placement.plan: {plan} is not JSON ({exc}); pass the plan.json that "
                    "`rlhf-fusion place` wrote") from None
            if "cluster" in raw:
                cluster = Cluster.from_dict(raw["cluster"])
            if cluster.size != world_size:
                raise PlacementConfigError(
                    f"placement.plan {plan}: the plan is for {cluster.size} devices but "
                    f"world_size is {world_size}; plan for a cluster of {world_size} devices")
            ep = ExecutionPlan.from_dict(raw, cluster)
            calls = {c: (tuple(ep.calls[c].mesh.ranks), ep.calls[c].strategy.dp,
                         ep.calls[c].strategy.tp, ep.calls[c].strategy.pp,
                         ep.calls[c].strategy.zero) for c in ep.call_names}
            name = ep.name or Path(plan).stem
            offload = ep.offload
        else:
            meshes = cluster_meshes(cluster, preset_placement(preset, inference_fraction),
                                    MODELS if models is None else models)
            calls = {c: (tuple(meshes[c].ranks), meshes[c].size, 1, 1, 0) for c in meshes}
            name, offload = preset, ()
        for ranks, *_rest in calls.values():
            mesh_from_ranks(cluster, ranks)   # a legal mesh of the node
    except PlacementError as exc:
        raise PlacementConfigError(f"placement: {exc}") from exc
    out = {}
    for c, (ranks, dp, tp, pp, zero) in calls.items():
        out[c] = _call_layout(c, tuple(ranks), dp, tp, pp, zero)
    a, cr = out["actor_train"], out.get("critic_train")
    if cr is None and a.pp > 1:
        raise PlacementConfigError(
            f"placement: actor_train pp={a.pp} without a Critic: the loop's training pipeline "
            "is the fused Actor/Critic one, and a pipeline for one model alone is not "
            "executed; use pp=1 (data parallel, tensor parallel or ZeRO-3)")
    if cr is not None and (a.pp > 1 or cr.pp > 1) and (a.ranks != cr.ranks or a.pp != cr.pp
                                    or len(a.ranks) != world_size):
        raise PlacementConfigError(
            f"placement: actor_train {list(a.ranks)} pp={a.pp} and critic_train "
            f"{list(cr.ranks)} pp={cr.pp}: a training pipeline runs only as the fused "
            "Actor/Critic pipeline over every rank (both calls on all ranks, the same pp); "
            "use pp=1 (data parallel) otherwise")
    return LoopPlacement(name, out, world_size, tuple(offload))


def _call_layout(c: str, ranks: tuple[int, ...], dp: int, tp: int, pp: int, zero: int
                 ) -> Layout:
    """What runs call ``c`` with strategy ``(dp, tp, pp, zero)`` on ``ranks``, or the reason
    the loop does not run it."""
    if dp * tp * pp != len(ranks):
        raise PlacementConfigError(f"placement: {c} has dp*tp*pp={dp * tp * pp} on "
                                   f"{len(ranks)} ranks; dp*tp*pp must equal the mesh size")
    train = c in TRAIN_CALL.values()
    if not train and (tp > 1 or pp > 1 or zero):
        raise PlacementConfigError(
            f"placement: {c} has tp={tp} pp={pp} zero={zero}; the loop runs generation and "
            "inference on whole copies (tp=1, pp=1, no ZeRO): their weights are gathered from "
            "the training layout after each round. Plan them with tp=1, pp=1 and zero=0 "
            "(parallelism: megatron)")
    if tp > 1 and pp > 1:
        raise PlacementConfigError(
            f"placement: {c} has tp={tp} and pp={pp}; tensor parallelism inside the fused "
            "pipeline's stages is not executed (its engine runs one rank per stage: the "
            "point-to-point sends, gradient groups and tied-embedding sums pair stages rank "
            "by rank, not tp group by tp group). Plan tp > 1 with pp=1, or pp > 1 with tp=1")
    if zero == 3 and (tp > 1 or pp > 1):
        raise PlacementConfigError(
            f"placement: {c} has zero=3 with tp={tp} pp={pp}; the loop runs ZeRO-3 (FSDP2) "
            "over a call's whole mesh only. Plan zero=3 with tp=1 and pp=1")
    if zero not in (0, 3) and zero:
        raise PlacementConfigError(f"placement: {c} has zero={zero}; the loop runs zero=0 "
                                   "or zero=3")
    return Layout(dp, tp, pp, zero, ranks)




def planned_models(cfg: RLHFConfig) -> tuple[str, ...]:
    """The models a plan for ``cfg`` places: Actor, Ref and the reward call always (a rule
    reward runs on ``reward_inf``'s ranks too, planned as a negligible model), the Critic
    unless the algorithm (``cfg.algorithm``, an ``AlgorithmConfig``) is critic-free."""
    critic = () if cfg.algorithm.critic_free else ("critic",)
    return ("actor", *critic, "ref", "reward")


def placement_problem(cfg: RLHFConfig, prompt_len: float,
                      profiles: Mapping[str, Any] | None = None) -> Any:
    """The :class:`~rlhf_fusion.placement.PlacementProblem` of ``cfg`` as the loop executes
    it: its models' shapes (read from their configs, nothing loaded), a node of
    ``world_size`` ``placement.hardware`` devices, its batch and PPO shape, no tensor
    parallelism and no pipelines. ``prompt_len``: the mean prompt length in tokens.
    Raises :class:`PlacementError` for a shape the planner refuses."""
    from ..placement import Cluster, PlacementProblem, resolve_model
    from .models import model_configs, model_shapes

    pl, g, p = cfg.placement, cfg.generation, cfg.ppo
    keep = planned_models(cfg)
    shapes = {role: resolve_model(sh, f"models.{role}")
              for role, sh in model_shapes(model_configs(cfg.models)).items() if role in keep}
    return PlacementProblem(
        models=shapes, cluster=Cluster.uniform(1, cfg.world_size, pl.hardware),
        batch=g.prompts_per_iteration, prompt_len=max(1, round(prompt_len)),
        gen_len=g.max_new_tokens, ppo_minibatches=p.num_mini_batches,
        ppo_epochs=p.num_ppo_epochs, max_tp=1, max_pp=1, name="loop",
        gradient_checkpointing=False,   # the loop never recomputes activations
        # Planned with the frozen models in host memory when the run offloads them.
        offload_frozen=bool(offload_names(pl.offload)), profiles=dict(profiles or {}))


def search_plan(cfg: RLHFConfig, prompt_len: float, out: str | Path) -> str:
    """Search a plan for ``cfg`` (``placement.search`` seconds, ``placement.hardware``) among
    the plans the loop executes (tp = 1, no pipelines), write it to ``out`` and return the
    path. Run once, before the processes start: every rank must run the same plan."""
    from ..placement import PlacementError, search
    from .models import model_configs

    pl, g = cfg.placement, cfg.generation
    profiles = (profile_models(model_configs(cfg.models),
                               seq_len=max(1, round(prompt_len)) + g.max_new_tokens,
                               out=Path(out).parent / "profiles") if pl.profile else {})
    try:
        keep = planned_models(cfg)
        problem = placement_problem(cfg, prompt_len,
                                    {r: v for r, v in profiles.items() if r in keep})
        found = search(problem, time_limit=float(pl.search), seed=0)
    except PlacementError as exc:
        raise PlacementConfigError(f"placement.search: {exc}") from exc
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    found.plan.save(path, problem.cluster)
    return str(path)


def profile_models(configs: Mapping[str, Any], seq_len: int, out: Path,
                   layouts: Sequence[tuple[int, int, int]] = (), world: int = 1,
                   launches: int = 1) -> dict[str, Any]:
    """Per model role, its decoder layers' forward/backward times measured where the loop
    computes (:func:`rlhf_fusion.runtime.layer_profile.profile_layers`, random weights from
    the source's config; Actor and Ref with their vocabulary head, Critic and Reward as
    backbones), written to ``out/ROLE.json``; one measurement per distinct network and head
    (a role that shares its source's config shares the measurement).

    ``layouts`` (``(dp, tp, zero)``, on ``world`` local ranks): the Actor's and the Critic's
    training passes and steps measured in those layouts as the loop trains them
    (:func:`rlhf_fusion.runtime.layout_profile.profile_layouts`), in the profile's
    ``layouts`` section, each figure the median over ``launches`` starts of the processes."""
    from ..placement import Profile
    from ..runtime.layer_profile import profile_config
    from .models import build_causal_lm, build_value_model

    rows = min(seq_len, 512)
    tokens = [rows * k for k in (1, 2, 4, 8)]
    out.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[int, bool], Any] = {}
    profiles = {}
    for role, conf in configs.items():
        if conf is None:
            continue   # a rule reward: no layers
        lm = role in ("actor", "ref")   # a vocabulary head; a Critic's value head is a column
        key = (id(conf), lm)
        if key not in done:
            # The loop's processes compute on the CPU, in float32.
            done[key] = profile_config(conf, lm_head=lm, tokens=tokens, seq_len=rows,
                                       repeats=2, device="cpu")
        prof = dict(done[key])
        if layouts and role in ("actor", "critic"):
            from ..runtime.layout_profile import profile_layouts

            build = build_causal_lm if role == "actor" else build_value_model
            prof["layouts"] = profile_layouts(conf, role, build, layouts, world=world,
                                              tokens=tokens, seq_len=rows,
                                              launches=launches)["layouts"]
        (out / f"{role}.json").write_text(json.dumps(prof, indent=1) + "\n")
        profiles[role] = Profile.from_dict(prof, f"profile of {role}")
    return profiles
