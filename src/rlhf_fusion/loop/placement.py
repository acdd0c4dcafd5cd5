"""Where the loop runs each model function call: a placement preset or a plan file, resolved
to rank sets and (dp, pp) for the local processes before any of them starts.

The planning side (:mod:`rlhf_fusion.placement`) describes placements on device meshes; the
loop's processes form one node of ``world_size`` devices. What the loop executes:

* ``actor_gen``: every rank of its mesh is a generation instance (inter-stage fusion runs
  among them);
* ``ref_inf``, ``reward_inf``, ``critic_inf``: whole copies on every rank of the call's mesh,
  samples shared round-robin (data parallel). When all three share the generation mesh they
  score finished samples while the tail decodes; otherwise the generated samples are
  gathered, each mesh scores its share, and the scores are gathered back;
* ``actor_train``, ``critic_train``: data parallel on the call's mesh (``pp = 1``: whole
  copies, gradients all-reduced over the mesh), or the fused Actor/Critic pipeline when both
  calls share every rank with the same ``pp > 1`` (intra-stage fusion);
* after each PPO round the trained parameters reach the generation and Critic-inference copies
  from their owners (ReaLHF's parameter reallocation; shadow models under ``disaggregated``);
* a plan's ``offload`` (frozen Ref/Reward in host memory between calls) is honoured unless the
  config's ``placement.offload`` says otherwise (:meth:`RLHFConfig.offloaded`).

Tensor parallelism is not executed (``tp`` must be 1), nor pipelines for inference calls or
for one model alone; such plans are rejected with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..placement.graph import CALL_KIND, CALLS, TRAIN_CALL

INFERENCE_CALLS = tuple(c for c in CALLS if CALL_KIND[c] == "inference")


class PlacementConfigError(ValueError):
    """A placement the loop cannot run; the message names the reason and the fix."""


@dataclass(frozen=True)
class CallLayout:
    ranks: tuple[int, ...]
    dp: int
    pp: int = 1

    def index(self, rank: int) -> int:
        """This rank's data-parallel index in the call (ranks in order)."""
        return self.ranks.index(rank)


@dataclass(frozen=True)
class LoopPlacement:
    name: str
    calls: Mapping[str, CallLayout]
    offload: tuple[str, ...] = ()   # the plan's frozen models in host memory between calls

    def holds(self, call: str, rank: int) -> bool:
        return rank in self.calls[call].ranks

    @property
    def streamed_inference(self) -> bool:
        """The three inference calls on the generation ranks: scoring overlaps the tail."""
        gen = set(self.calls["actor_gen"].ranks)
        return all(set(self.calls[c].ranks) == gen for c in INFERENCE_CALLS)

    @property
    def fused_training(self) -> bool:
        return self.calls["actor_train"].pp > 1

    def groups(self) -> list[tuple[int, ...]]:
        """Every distinct rank set, in one order all ranks agree on (for ``new_group``)."""
        return sorted({lay.ranks for lay in self.calls.values()})

    def describe(self) -> str:
        rows = [f"{c:<12} ranks {list(lay.ranks)} dp={lay.dp} pp={lay.pp}"
                for c, lay in self.calls.items()]
        if self.offload:
            rows.append(f"offload      {', '.join(self.offload)} (host memory between calls)")
        return f"placement {self.name}:\n  " + "\n  ".join(rows)


def resolve(preset: str | None, plan: str | Path | None, world_size: int,
            inference_fraction: float = 0.5) -> LoopPlacement | None:
    """The loop's placement from a preset name or a plan file (``rlhf-fusion plan``'s
    ``plan.json``); ``None`` when neither is given (the default co-located loop)."""
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
                    f"placement.plan: no file {plan}; write one with `rlhf-fusion plan "
                    "CONFIG --out DIR` (DIR/plan.json) or use placement.preset") from None
            except json.JSONDecodeError as exc:
                raise PlacementConfigError(
                    f"placement.plan: {plan} is not JSON ({exc}); pass the plan.json that "
                    "`rlhf-fusion plan` wrote") from None
            if "cluster" in raw:
                cluster = Cluster.from_dict(raw["cluster"])
            if cluster.size != world_size:
                raise PlacementConfigError(
                    f"placement.plan {plan}: the plan is for {cluster.size} devices but "
                    f"world_size is {world_size}; plan for a cluster of {world_size} devices")
            ep = ExecutionPlan.from_dict(raw, cluster)
            zero = [c for c in CALLS if ep.calls[c].strategy.zero]
            if zero:
                raise PlacementConfigError(
                    f"placement.plan {plan}: {zero} use ZeRO-3 (zero=3), which the loop does "
                    "not execute; plan with parallelism: megatron (the default) to run it here")
            calls = {c: (tuple(ep.calls[c].mesh.ranks), ep.calls[c].strategy.dp,
                         ep.calls[c].strategy.tp, ep.calls[c].strategy.pp) for c in CALLS}
            name = ep.name or Path(plan).stem
            offload = ep.offload
        else:
            meshes = cluster_meshes(cluster, preset_placement(preset, inference_fraction))
            calls = {c: (tuple(meshes[c].ranks), meshes[c].size, 1, 1) for c in CALLS}
            name, offload = preset, ()
        for ranks, *_rest in calls.values():
            mesh_from_ranks(cluster, ranks)   # a legal mesh of the node
    except PlacementError as exc:
        raise PlacementConfigError(f"placement: {exc}") from exc
    out = {}
    for c, (ranks, dp, tp, pp) in calls.items():
        if tp != 1:
            raise PlacementConfigError(
                f"placement: {c} has tp={tp}; the loop does not execute tensor parallelism. "
                "Plan with tp=1 (data and pipeline parallelism)")
        if dp * pp != len(ranks):
            raise PlacementConfigError(f"placement: {c} has dp*pp={dp * pp} on {len(ranks)} "
                                       "ranks; dp*tp*pp must equal the mesh size")
        if pp > 1 and c not in TRAIN_CALL.values():
            raise PlacementConfigError(
                f"placement: {c} has pp={pp}; the loop runs generation and inference on whole "
                "copies (pp=1)")
        out[c] = CallLayout(tuple(ranks), dp, pp)
    a, cr = out["actor_train"], out["critic_train"]
    if (a.pp > 1 or cr.pp > 1) and (a.ranks != cr.ranks or a.pp != cr.pp
                                    or len(a.ranks) != world_size):
        raise PlacementConfigError(
            f"placement: actor_train {list(a.ranks)} pp={a.pp} and critic_train "
            f"{list(cr.ranks)} pp={cr.pp}: a training pipeline runs only as the fused "
            "Actor/Critic pipeline over every rank (both calls on all ranks, the same pp); "
            "use pp=1 (data parallel) otherwise")
    return LoopPlacement(name, out, tuple(offload))


def search_plan(cfg: Any, prompt_len: float, out: str | Path) -> str:
    """Search a plan for ``cfg`` (``placement.search`` seconds, ``placement.hardware``) among
    the plans the loop executes (tp = 1, no pipelines), write it to ``out`` and return the
    path. Run once, before the processes start: every rank must run the same plan."""
    from ..placement import Cluster, PlacementError, PlacementProblem, resolve_model, search
    from .config import offload_names
    from .models import model_configs, model_shapes

    pl, g, p = cfg.placement, cfg.generation, cfg.ppo
    configs = model_configs(cfg.models)
    profiles = (profile_models(configs, seq_len=max(1, round(prompt_len)) + g.max_new_tokens,
                               out=Path(out).parent / "profiles") if pl.profile else {})
    try:
        shapes = {role: resolve_model(sh, f"models.{role}")
                  for role, sh in model_shapes(configs).items()}
        problem = PlacementProblem(
            models=shapes, cluster=Cluster.uniform(1, cfg.world_size, pl.hardware),
            batch=g.prompts_per_iteration, prompt_len=max(1, round(prompt_len)),
            gen_len=g.max_new_tokens, ppo_minibatches=p.num_mini_batches,
            ppo_epochs=p.num_ppo_epochs, max_tp=1, max_pp=1, name="loop",
            # Planned with the frozen models in host memory when the run offloads them.
            offload_frozen=bool(offload_names(pl.offload)), profiles=profiles)
        found = search(problem, time_limit=float(pl.search), seed=0)
    except PlacementError as exc:
        raise PlacementConfigError(f"placement.search: {exc}") from exc
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    found.plan.save(path, problem.cluster)
    return str(path)


def profile_models(configs: Mapping[str, Any], seq_len: int, out: Path) -> dict[str, Any]:
    """Per model role, its decoder layers' forward/backward times measured where the loop
    computes (:func:`rlhf_fusion.runtime.layer_profile.profile_layers`, random weights from
    the source's config; Actor and Ref with their vocabulary head, Critic and Reward as
    backbones), written to ``out/ROLE.json``; one measurement per distinct network and head
    (a role that shares its source's config shares the measurement)."""
    from ..placement import Profile
    from ..runtime.layer_profile import profile_config

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
        prof = done[key]
        (out / f"{role}.json").write_text(json.dumps(prof, indent=1) + "\n")
        profiles[role] = Profile.from_dict(prof, f"profile of {role}")
    return profiles
