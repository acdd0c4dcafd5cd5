"""Training engines: one class per training layout kind (:data:`ENGINES`), one interface.

A trainer (the loop's :class:`~rlhf_fusion.loop.iteration.PPOWorker`) builds the engine its
training layout's kind names (:func:`engine_for`) and from then on asks it, never the layout:
``setup(models)`` cuts or shards the whole models and makes the optimizers; ``step(micro_
batches)`` is one mini-batch (forward, backward, one clipped optimizer step) and returns its
statistics as ``{"role/stat": value}``; ``whole_weights(role)`` and ``sync_weights()`` bring
the trained weights to the generation and inference copies; ``modules()`` and
``state_dict()``/``load_state_dict()`` are what a checkpoint holds.

* :class:`FusedPipelineEngine` (``fused_pipeline``): the fused Actor/Critic pipeline
  (:mod:`.fused`), planned once from profiled stage times (or the serial 1F1B order) and
  reused; every rank trains every role's stage.
* :class:`DataParallelEngine` (``data_parallel``): whole copies on each training call's ranks,
  the replica's micro-batches shared in order, gradients summed over the call, one clipped
  step (:mod:`.sharded_train`).
* :class:`ShardedEngine` (``tensor_parallel``, ``zero3``): the same step on DTensor shards
  (DTensor Megatron plans, FSDP2); the whole weights are gathered over the call's ranks.

A new kind is one new class and its entry in :data:`ENGINES`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..placement.layout import DATA_PARALLEL, FUSED_PIPELINE, TENSOR_PARALLEL, ZERO3, Layout
from .errors import EngineKindError
from .fused import default_loss_fns, partition_rank, pipelined_step
from .ppo import PPOConfig
from .sharded_state import full_state_dict
from .sharded_train import data_parallel_step, shard_for_training
from .weight_sync import (
    broadcast_parameters,
    minimum_bytes,
    ownership,
    shapes_of,
    stage_parameters,
    tied_aliases,
)

__all__ = ["ENGINES", "DataParallelEngine", "EngineSpec", "FusedPipelineEngine",
           "ShardedEngine", "TrainingEngine", "engine_for"]

Optimizers = dict[str, torch.optim.Optimizer]


@dataclass
class EngineSpec:
    """What an engine needs to know about the run, as plain data.

    ``layouts``: every trained role's training layout (ranks included), in training order;
    ``targets``: each trained role's generation/inference copy's layout (where
    ``sync_weights`` sends it); ``groups``: the process groups by rank set (the whole world is
    absent: the default group)."""

    layouts: Mapping[str, Layout]
    targets: Mapping[str, Layout]
    rank: int
    world: int
    ppo: PPOConfig
    make_optimizers: Callable[[dict[str, list[nn.Parameter]]], Optimizers]
    groups: Mapping[tuple[int, ...], Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    replicas: int = 1
    stage_groups: int = 1
    intra: bool = True            # a solved fused schedule; False: serial 1F1B
    solver: str = "auto"
    solver_time_limit: float = 5.0
    timeout_s: float = 120.0
    #: The losses (default: :func:`~rlhf_fusion.runtime.fused.default_loss_fns` of ``ppo``)
    #: and the micro-batches one replica runs per step (default: ``ppo.micro_batches``).
    loss_fns: Mapping[str, Callable] | None = None
    micro_batches: int | None = None
    trace: bool = True   # time every pipeline instruction (trace_events)
    #: The fused pipeline's own inputs, where its user has them: the problem (default: from
    #: the layouts), each model's layer split, the models' sizes for the planner's tie
    #: rule, the profiling repeats and a given schedule (no profiling).
    problem: Any = None
    layers: Mapping[str, Sequence[int] | None] | None = None
    sizes: Mapping[str, float] | None = None
    profile_repeats: int = 2
    schedule: Any = None

    def losses(self) -> Mapping[str, Callable]:
        return self.loss_fns if self.loss_fns is not None else default_loss_fns(self.ppo)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.layouts)

    def group(self, ranks: tuple[int, ...]) -> Any:
        return self.groups.get(ranks, dist.group.WORLD)


class TrainingEngine:
    """One rank's training of the trained roles under one layout kind (see the module)."""

    kind: ClassVar[str]
    #: The engine traces its forward/backward instructions (``trace_events``).
    traced: ClassVar[bool] = False

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.optimizers: Optimizers = {}
        self.roles: tuple[str, ...] = ()   # the roles this rank trains (after setup)
        #: The planned pipeline schedule (an engine that plans one), else ``None``.
        self.schedule: Any = None

    @staticmethod
    def groups(layout: Layout) -> list[tuple[int, ...]]:
        """Rank sets the engine communicates over beyond the placement's calls (every rank
        creates every group, in one order, before any engine is set up)."""
        return []

    # -- the interface -------------------------------------------------------------------------
    def setup(self, models: Mapping[str, nn.Module]) -> None:
        raise NotImplementedError

    def prepare(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> float:
        """One-time work before the first step (profiling, planning); collective. Returns its
        seconds."""
        return 0.0

    def step(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
        raise NotImplementedError

    def reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """The round's summed statistics, the same on every rank (collective)."""
        return sums

    def whole_weights(self, role: str) -> dict[str, Tensor]:
        raise NotImplementedError

    def sync_weights(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, float]]:
        """Each trained role's weights for this rank's generation/inference copy (roles this
        rank receives only), and ``realloc/bytes``, ``realloc/min_bytes``. Collective."""
        raise NotImplementedError

    def modules(self) -> dict[str, nn.Module]:
        """The modules whose parameters this rank trains."""
        raise NotImplementedError

    def canonical_state(self) -> dict[str, Tensor]:
        """This rank's share of ``{role.name: tensor}`` (every entry once over all ranks)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"modules": {r: m.state_dict() for r, m in self.modules().items()},
                "optimizers": {r: o.state_dict() for r, o in self.optimizers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for r, m in self.modules().items():
            m.load_state_dict(state["modules"][r])
        for r, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][r])

    def shard_keys(self) -> dict[str, tuple[Any, ...]]:
        """What piece of each role it trains this rank holds: ranks with equal keys hold
        equal weights and optimizer state (a checkpoint saves one copy of them)."""
        raise NotImplementedError

    def trace_events(self) -> list[tuple[str, float, float]]:
        """The last step's traced instructions ``(name, start, end)`` (perf_counter)."""
        return []

    def set_intra(self, intra: bool) -> None:
        """Switch intra-stage fusion between iterations."""
        self.spec.intra = intra

    def close(self) -> None:
        pass


class FusedPipelineEngine(TrainingEngine):
    """The fused Actor/Critic pipeline: each rank holds a stage of each trained role."""

    kind = FUSED_PIPELINE
    traced = True

    def setup(self, models: Mapping[str, nn.Module]) -> None:
        from ..schedule.problem import fused_problem

        s = self.spec
        self._shapes = {role: shapes_of(models[role]) for role in s.roles}
        self._tied = {role: tied_aliases(models[role]) for role in s.roles}
        problem = s.problem
        if problem is None:
            micro = s.micro_batches if s.micro_batches is not None else s.ppo.micro_batches
            problem = fused_problem(stage_groups=s.stage_groups, micro_batches=micro,
                                    **{f"{role}_stages": s.layouts[role].pp for role in s.roles})
        self.fused = partition_rank(problem, {role: models[role] for role in s.roles}, s.rank,
                                    loss_fns=dict(s.losses()), layers=s.layers,
                                    replicas=s.replicas, device=s.device)
        self.roles = tuple(self.fused.stages)
        self.optimizers = s.make_optimizers(
            {role: list(st.parameters()) for role, st in self.fused.stages.items()})
        self._owners: dict[str, Any] | None = None
        self._events: list[tuple[str, float, float]] = []

    def _plan(self, mbs: Sequence[Mapping[str, Tensor]]) -> None:
        s = self.spec
        # The engine traces every instruction (a perf_counter pair each): the iteration's
        # timeline shows the fused Actor/Critic pipeline and time/train_compute counts it.
        if s.intra:
            self.schedule = self.fused.plan(
                mbs, schedule=s.schedule, solver=s.solver, time_limit=s.solver_time_limit,
                profile_repeats=s.profile_repeats, timeout=s.timeout_s, device=s.device,
                sizes=s.sizes, trace=s.trace)
        else:
            self.schedule = self.fused.plan(mbs, schedule=self._serial(), timeout=s.timeout_s,
                                            device=s.device, serial=True, trace=s.trace)

    def _serial(self) -> Any:
        from ..schedule import solve

        # RLHFuse-Base: the Actor's 1F1B step, then the Critic's (a barrier between them).
        return solve(self.fused.problem, "concatenated_1f1b", time_limit=1.0)

    def prepare(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> float:
        if self.fused.engine is not None:
            return 0.0
        t = time.perf_counter()
        self._plan(micro_batches)
        return time.perf_counter() - t

    def step(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
        if self.fused.engine is None:
            self._plan(micro_batches)
        out = pipelined_step(self.fused, list(micro_batches), self.optimizers,
                             max_grad_norm=self.spec.ppo.max_grad_norm)
        tr = self.fused.engine.last_trace if self.fused.engine is not None else None
        if tr is not None:
            self._events.extend(tr.events)
        return flat_stats(out)

    def trace_events(self) -> list[tuple[str, float, float]]:
        out, self._events = self._events, []
        return out

    def _stage_params(self) -> dict[str, dict[str, Tensor]]:
        return {r: stage_parameters(st.module, self._tied[r])
                for r, st in self.fused.stages.items()}

    def whole_weights(self, role: str) -> dict[str, Tensor]:
        own = self._ownership()[role]
        params, _ = broadcast_parameters(own, self._stage_params().get(role, {}),
                                         self._shapes[role], self.spec.device)
        return params

    def _ownership(self) -> dict[str, Any]:
        if self._owners is None:
            stage_params = self._stage_params()
            self._owners = ownership(stage_params, {r: self.fused.is_canonical(r)
                                                    for r in stage_params})
        return self._owners

    def sync_weights(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, float]]:
        """Each stage broadcast from its owner (replica 0, copy 0) to every copy."""
        s = self.spec
        stage_params = self._stage_params()
        owners = self._ownership()
        out: dict[str, dict[str, Tensor]] = {}
        moved = minimum = 0
        for role in s.roles:
            params, got = broadcast_parameters(owners[role], stage_params.get(role, {}),
                                               self._shapes[role], s.device)
            moved += got
            minimum += minimum_bytes(owners[role], self._shapes[role], s.world)
            if s.rank in s.targets[role].ranks:
                out[role] = params
        totals = torch.tensor([float(moved)], dtype=torch.float64)
        dist.all_reduce(totals)
        return out, {"realloc/bytes": float(totals[0]), "realloc/min_bytes": float(minimum)}

    def modules(self) -> dict[str, nn.Module]:
        return {role: st.module for role, st in self.fused.stages.items()}

    def shard_keys(self) -> dict[str, tuple[Any, ...]]:
        """Each stage of the pipeline, the same in every replica and copy."""
        return {role: ("stage", st.stage, st.num_stages) for role, st in self.fused.stages.items()}

    def canonical_state(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for role, params in self._stage_params().items():
            if self.fused.is_canonical(role):
                for k, v in params.items():
                    out[f"{role}.{k}"] = v.detach().clone()
        return out

    def set_intra(self, intra: bool) -> None:
        rebuild = intra != self.spec.intra
        super().set_intra(intra)
        if rebuild:
            self.fused.close()
            if not intra:   # the serial order needs no profiling: build it now, off the clock
                s = self.spec
                self.fused.build(self._serial(), timeout=s.timeout_s, device=s.device,
                                 serial=True, trace=s.trace)

    def close(self) -> None:
        self.fused.close()


class DataParallelEngine(TrainingEngine):
    """Whole copies on each training call's ranks (each role its own call and layout)."""

    kind = DATA_PARALLEL

    def setup(self, models: Mapping[str, nn.Module]) -> None:
        s = self.spec
        if s.distributed:
            from .realloc_execute import param_table

            # What the weight sync moves, known on every rank (before unplaced models go).
            self._tables = {role: param_table(models[role], role) for role in s.roles}
        self.roles = tuple(r for r in s.roles if s.rank in s.layouts[r].ranks)
        self.models = {role: models[role] for role in self.roles}
        for role in self.roles:
            self._place(role)
        self.optimizers = s.make_optimizers(
            {role: list(m.parameters()) for role, m in self.models.items()})

    def _place(self, role: str) -> None:
        """Lay the whole model out on its call's ranks: a whole copy on this rank's device
        (left on the host, a GPU run generated on the GPU and trained on the CPU)."""
        self.models[role].to(self.spec.device)

    def _groups(self, role: str) -> dict[tuple[int, ...], Any]:
        """The process groups of ``role``'s training layout (the whole world's included)."""
        lay = self.spec.layouts[role]
        return {g: self.spec.group(g) for g in sorted({lay.ranks} | set(lay.groups()))}

    def step(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
        """Each training call this rank holds: its share of the micro-batches, gradients
        summed over the call's ranks, then one clipped optimizer step (the arithmetic of one
        device)."""
        s = self.spec
        loss_fns = s.losses()
        micro_batches = [{k: v.to(s.device) for k, v in mb.items()} for mb in micro_batches]
        out: dict[str, float] = {}
        for role in self.roles:
            out.update(data_parallel_step(self.models[role], role, s.layouts[role], s.rank,
                                          micro_batches, loss_fns, self.optimizers[role],
                                          self._groups(role), s.ppo.max_grad_norm))
        return out

    def reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        s = self.spec
        if not s.distributed:
            return sums
        # Each training call's first rank reports its model's statistics to everyone.
        lead = {role: s.layouts[role].ranks[0] == s.rank for role in s.roles}
        report = {k: v for k, v in sums.items() if lead.get(k.split("/")[0])}
        gathered: list[Any] = [None] * s.world
        dist.all_gather_object(gathered, report)
        return {k: v for rep in gathered for k, v in rep.items()}

    def whole_weights(self, role: str) -> dict[str, Tensor]:
        return dict(self.models[role].named_parameters())

    def sync_weights(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, float]]:
        """Whole copies on both sides: every piece comes from the least-loaded holder
        (:func:`rlhf_fusion.runtime.realloc_execute.execute`); one process holds them all."""
        s = self.spec
        if not s.distributed:   # every copy on this rank
            return ({role: dict(self.models[role].named_parameters()) for role in self.roles},
                    {"realloc/bytes": 0.0, "realloc/min_bytes": 0.0})
        from ..placement import Cluster, Layout, mesh_from_ranks
        from ..placement.realloc_plan import MeshLayout
        from .realloc_execute import execute

        cluster = Cluster.uniform(1, s.world)

        def whole(lay: Layout) -> MeshLayout:
            # A sharded layout's ranks each hold whole weights once gathered: whole copies.
            return MeshLayout(mesh_from_ranks(cluster, lay.ranks), Layout(len(lay.ranks)))

        out: dict[str, dict[str, Tensor]] = {}
        moved = minimum = 0
        for role in s.roles:
            local = self.whole_weights(role) if role in self.roles else None
            res = execute(self._tables[role], whole(s.layouts[role]), whole(s.targets[role]),
                          local, cluster, device=s.device, timeout=s.timeout_s)
            moved += res.bytes
            minimum += res.min_bytes
            if res.shard is not None:
                out[role] = res.shard
        return out, {"realloc/bytes": float(moved), "realloc/min_bytes": float(minimum)}

    def modules(self) -> dict[str, nn.Module]:
        return dict(self.models)

    def shard_keys(self) -> dict[str, tuple[Any, ...]]:
        """Whole copies are one piece; DTensor shards (tensor parallel, ZeRO-3) count as
        each rank's own (their device mesh is the rank's own)."""
        return {role: ("own", self.spec.rank) if self.spec.layouts[role].dtensor else ("whole",)
                for role in self.roles}

    def canonical_state(self) -> dict[str, Tensor]:
        """Whole copies: each training call's first rank saves its model."""
        out: dict[str, Tensor] = {}
        for role in self.roles:
            whole = self.whole_weights(role)   # every holder: a sharded one gathers
            if self.spec.layouts[role].ranks[0] == self.spec.rank:
                for k, v in whole.items():
                    out[f"{role}.{k}"] = v.detach().clone()
        return out


class ShardedEngine(DataParallelEngine):
    """Tensor parallel (DTensor Megatron plans) or ZeRO-3 (FSDP2) on each call's ranks."""

    kind = TENSOR_PARALLEL

    @staticmethod
    def groups(layout: Layout) -> list[tuple[int, ...]]:
        return layout.groups()

    def _place(self, role: str) -> None:
        # (tp checked against the model when the run was resolved)
        s = self.spec
        shard_for_training(self.models[role], role, s.layouts[role], s.rank, self._groups(role),
                           s.device)

    def whole_weights(self, role: str) -> dict[str, Tensor]:
        """Gathered over the call's ranks (a collective: every one of them asks, in the same
        order)."""
        if self.spec.layouts[role].dtensor:
            return full_state_dict(self.models[role])
        return super().whole_weights(role)


class _Zero3Engine(ShardedEngine):
    kind = ZERO3


#: The engine of each layout kind.
ENGINES: dict[str, type[TrainingEngine]] = {
    DATA_PARALLEL: DataParallelEngine,
    FUSED_PIPELINE: FusedPipelineEngine,
    TENSOR_PARALLEL: ShardedEngine,
    ZERO3: _Zero3Engine,
}


def engine_for(layouts: Mapping[str, Layout]) -> type[TrainingEngine]:
    """The engine class that trains ``layouts`` (each trained role's): the fused pipeline
    when they are fused (resolution never mixes it with another kind), else the sharded one
    when any role is sharded (it runs whole copies for the others), else data parallel."""
    kinds = {lay.kind for lay in layouts.values()}
    if FUSED_PIPELINE in kinds:
        if kinds != {FUSED_PIPELINE}:
            raise EngineKindError(f"training layouts {sorted(kinds)}: the fused pipeline "
                                     "trains every role or none")
        return ENGINES[FUSED_PIPELINE]
    for kind in (TENSOR_PARALLEL, ZERO3, DATA_PARALLEL):
        if kind in kinds:
            return ENGINES[kind]
    raise EngineKindError(f"training layouts {sorted(kinds)}: no engine runs them; the "
                             f"engines run {', '.join(ENGINES)}")


def flat_stats(out: dict[str, Any]) -> dict[str, float]:
    """A training step's ``{"stats": {role: {name: v}}, "grad_norm": {role: v}}`` as
    ``{"role/name": v}``."""
    flat = {f"{role}/{name}": float(v) for role, st in out["stats"].items()
            for name, v in st.items()}
    flat.update({f"{role}/grad_norm": float(v)
                 for role, v in (out.get("grad_norm") or {}).items()})
    return flat
