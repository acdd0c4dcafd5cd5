"""One way to assemble a fused PPO training step (used by the Lightning strategy, the tests,
the benchmarks and the RLHF loop).

Per rank, once::

    fr = partition_rank(problem, models, rank, loss_fns=...)   # local: prune models in place
    fr.plan(first_micro_batches)      # collective: profile -> solve on rank 0 -> broadcast
                                      # -> process groups + engine (or fr.build(schedule))

per step::

    forward_backward(fr, micro_batches)                        # the instruction stream
    norms = optimizer_step(fr, optimizers, max_grad_norm=1.0)  # sync, clip, step, zero
    # or both at once, plus reduced loss statistics: pipelined_step(fr, ...)

and ``fr.close()`` at the end. :func:`reference_step` is the same step on one process without
pipelining: the exactness reference and the single-device Lightning path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..schedule import Problem, Schedule, solve
from ..schedule.problem import fused_problem
from .comm import PipelineComm
from .engine import PipelineEngine, TrainStageRunner, clip_grad_norm_, scale_loss
from .errors import PlanError
from .partition import ROLES, PipelineStage, num_layers, partition_, split_layers
from .plan import PipelinePlan
from .ppo import PPOConfig, actor_ppo_loss, critic_ppo_loss
from .profile import MIB, profile_runner

log = logging.getLogger(__name__)

#: The two models of the fused PPO step, in the order their optimizers are listed.


def check_models_against_problem(
    problem: Problem,
    models: Mapping[str, nn.Module],
    layers: Mapping[str, Sequence[int] | None] | None = None,
) -> None:
    """Reject a problem/schedule that cannot run on these models, naming the mismatch.

    Runs in the launching process, before any worker starts: model names, the decoder
    architectures, and each model's layer count against its number of pipeline stages.
    """
    names = [m.name for m in problem.models]
    if sorted(names) != sorted(models):
        raise PlanError(
            f"schedule: models {names} do not match the module's models {sorted(models)}; "
            "re-plan with models named 'actor' and 'critic'"
        )
    for spec in problem.models:
        model = models[spec.name]
        total = num_layers(model, spec.name)
        try:
            split_layers(total, spec.pipeline_stages, (layers or {}).get(spec.name))
        except ValueError as exc:
            raise PlanError(f"schedule: {spec.name}: {exc}") from None
    if problem.models[names.index("actor")].direction != "forward":
        raise PlanError(
            "schedule: the actor must run in the 'forward' direction (stage s on group s)"
        )


#: ``{model: optimizer}``, a sequence in :data:`ROLES` order, or ``None`` (no step).
Optimizers = Mapping[str, torch.optim.Optimizer] | Sequence[torch.optim.Optimizer] | None


@dataclass(eq=False)
class FusedRank:
    """One rank of the fused pipeline: its partitioned stages, their runners and, once
    :meth:`plan` or :meth:`build` ran, the communicator and engine.

    Made by :func:`partition_rank` (no engine yet) or :func:`setup_rank` (partition + build).
    """

    problem: Problem
    rank: int
    stages: dict[str, PipelineStage]
    runners: dict[str, TrainStageRunner]
    replicas: int = 1
    #: The rank layout and instruction streams; ``None`` until :meth:`plan` / :meth:`build`.
    pipeline_plan: PipelinePlan | None = None
    engine: PipelineEngine | None = None

    # -- layout (known from the problem alone, before any schedule) ------------------------------
    @property
    def replica(self) -> int:
        return self.rank // self.problem.stage_groups

    @property
    def group(self) -> int:
        return self.rank % self.problem.stage_groups

    @property
    def micro_batches(self) -> int:
        """Micro-batches one pipeline replica processes per step."""
        m = self.problem.models[0]
        return m.copies * m.micro_batches

    def copy_of(self, model: str) -> int:
        for mi, copy, _stage in self.problem.residents(self.group):
            if self.problem.models[mi].name == model:
                return copy
        raise KeyError(f"rank {self.rank} holds no stage of {model!r}")

    def is_canonical(self, model: str) -> bool:
        """Whether this rank's copy of its ``model`` stage counts once (replica 0, copy 0) in
        norms and gathered checkpoints."""
        return self.replica == 0 and self.copy_of(model) == 0

    def parameters(self, model: str) -> list[nn.Parameter]:
        return list(self.stages[model].parameters())

    @property
    def schedule(self) -> Schedule | None:
        return self.pipeline_plan.schedule if self.pipeline_plan is not None else None

    @property
    def comm(self) -> PipelineComm:
        return self._engine().comm

    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            raise RuntimeError(
                f"rank {self.rank}: the pipeline is not built yet; call FusedRank.plan(...) "
                "or FusedRank.build(schedule) on every rank first"
            )
        return self.engine

    # -- schedule -> engine --------------------------------------------------------------------
    def plan(
        self,
        micro_batches: Sequence[Mapping[str, Tensor]],
        *,
        schedule: Schedule | None = None,
        solver: str = "auto",
        time_limit: float = 10.0,
        profile_repeats: int = 2,
        timeout: float = 300.0,
        device: torch.device | str = "cpu",
        sizes: Mapping[str, float] | None = None,
        trace: bool = False,
        serial: bool = False,
    ) -> Schedule:
        """Get a schedule and build the pipeline on it. Collective over all ranks.

        Without ``schedule``: every rank profiles its stages on ``micro_batches`` (forward and
        backward times and the activation memory a micro-batch holds, see
        :func:`~rlhf_fusion.runtime.profile.profile_runner`), the profiles are all-gathered,
        rank 0 builds the problem from them (``problem_from_profiles``; ``sizes`` are the
        models' parameter counts for the planner's tie rule) and solves it with ``solver``
        (greedy if that solver is not installed), and broadcasts the schedule. Then
        :meth:`build` (``serial`` as there). Returns the schedule.
        """
        if schedule is None:
            schedule = self._profile_and_solve(
                micro_batches,
                solver=solver,
                time_limit=time_limit,
                repeats=profile_repeats,
                device=device,
                sizes=sizes,
            )
        self.build(schedule, timeout=timeout, device=device, trace=trace, serial=serial)
        return schedule

    def _profile_and_solve(
        self,
        micro_batches: Sequence[Mapping[str, Tensor]],
        *,
        solver: str,
        time_limit: float,
        repeats: int,
        device: torch.device | str,
        sizes: Mapping[str, float] | None,
    ) -> Schedule:
        prof = {
            name: (
                self.stages[name].stage,
                *profile_runner(runner, micro_batches, repeats=repeats, device=device),
            )
            for name, runner in self.runners.items()
        }
        profiles: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(profiles, prof)
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            spec = {m.name: m for m in self.problem.models}
            problem = problem_from_profiles(
                profiles,
                stage_groups=self.problem.stage_groups,
                micro_batches=self.micro_batches,
                actor_stages=spec["actor"].pipeline_stages,
                critic_stages=spec["critic"].pipeline_stages,
                sizes=sizes,
            )
            box[0] = solve_or_greedy(problem, solver, time_limit).to_dict()
        dist.broadcast_object_list(box, src=0)
        return Schedule.from_dict(box[0])

    def build(
        self,
        schedule: Schedule,
        *,
        timeout: float = 300.0,
        device: torch.device | str = "cpu",
        trace: bool = False,
        serial: bool = False,
    ) -> None:
        """Create the communicator (collective: every rank calls it) and the engine that runs
        ``schedule``, which must plan the same stages, copies and micro-batches. ``serial``:
        every rank waits for the others between models (serial 1F1B: run with the
        ``concatenated_1f1b`` order, each model's step completes before the next starts)."""
        self._check_schedule(schedule)
        plan = PipelinePlan(schedule, self.replicas)
        self._attach(plan, timeout=timeout, device=device, trace=trace, serial=serial)

    def _check_schedule(self, schedule: Schedule) -> None:
        got, want = schedule.problem, self.problem
        if got.stage_groups != want.stage_groups:
            raise PlanError(
                f"schedule: plans {got.stage_groups} stage groups, the partition "
                f"{want.stage_groups}"
            )
        have = {m.name: (m.pipeline_stages, m.copies, m.micro_batches) for m in want.models}
        for m in got.models:
            if have.get(m.name) != (m.pipeline_stages, m.copies, m.micro_batches):
                raise PlanError(
                    f"schedule: {m.name} has {m.pipeline_stages} stages x {m.copies} copies x "
                    f"{m.micro_batches} micro-batches, the partition "
                    f"{have.get(m.name, 'no such model')} (stages, copies, micro-batches)"
                )

    def _attach(
        self, plan: PipelinePlan, *, timeout: float, device: torch.device | str, trace: bool,
        serial: bool = False,
    ) -> None:
        if self.engine is not None:
            raise RuntimeError(f"rank {self.rank}: the pipeline is already built; close() first")
        if plan.replicas != self.replicas:
            raise PlanError(
                f"plan: {plan.replicas} replicas, the partition was made for {self.replicas}"
            )
        comm = PipelineComm(plan, self.rank, timeout=timeout, device=device)
        self.pipeline_plan = plan
        self.engine = PipelineEngine(plan, comm, self.runners, trace=trace, model_barrier=serial)

    def close(self) -> None:
        """Stop the communicator's threads and destroy its process groups (if built); the
        stages stay partitioned."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self.pipeline_plan = None


def solve_or_greedy(problem: Problem, solver: str, time_limit: float) -> Schedule:
    """``solve`` with ``solver``, or with the greedy planner if that solver is not installed."""
    try:
        return solve(problem, solver, time_limit=time_limit)
    except ImportError:
        log.info("solver %r unavailable; using greedy", solver)
        return solve(problem, "greedy", time_limit=time_limit)


def problem_from_profiles(
    profiles: Sequence[Mapping[str, Sequence[float]]],
    *,
    stage_groups: int,
    micro_batches: int,
    actor_stages: int,
    critic_stages: int,
    activation: Mapping[str, Sequence[float]] | None = None,
    sizes: Mapping[str, float] | None = None,
) -> Problem:
    """The fused problem with measured per-stage times in milliseconds and activation memory
    in MiB.

    ``profiles`` holds, per rank, ``{model: (stage, forward_s, backward_s[, activation_bytes])}``
    (``(stage, *profile_runner(...))``); a stage held by several ranks (copies, replicas) takes
    the largest measurement. ``activation`` overrides the measured memory (any unit, the same
    for both models); without either, every stage gets 1.0 (the planner then counts
    micro-batches in flight).
    """
    times: dict[str, dict[int, list[float]]] = {"actor": {}, "critic": {}}
    measured = True
    for prof in profiles:
        for model, (stage, f, b, *rest) in prof.items():
            act = float(rest[0]) if rest else 0.0
            measured &= bool(rest)
            cur = times[model].get(stage)
            times[model][stage] = (
                [max(cur[0], f), max(cur[1], b), max(cur[2], act)] if cur else [f, b, act]
            )

    def per_stage(model: str, stages: int, k: int, scale: float) -> list[float]:
        missing = [s for s in range(stages) if s not in times[model]]
        if missing:
            raise RuntimeError(f"profiling: no measurement for {model} stages {missing}")
        # Three decimals (us, KiB), floored at 0.001 so a trivially cheap stage still counts.
        return [max(round(times[model][s][k] * scale, 3), 0.001) for s in range(stages)]

    stages = {"actor": actor_stages, "critic": critic_stages}
    if activation is not None:
        act = {m: list(activation[m]) for m in stages}
    elif measured:
        act = {m: per_stage(m, s, 2, 1.0 / MIB) for m, s in stages.items()}
    else:
        act = {m: [1.0] * s for m, s in stages.items()}
    return fused_problem(
        stage_groups=stage_groups,
        micro_batches=micro_batches,
        actor_stages=actor_stages,
        critic_stages=critic_stages,
        actor_times=(
            per_stage("actor", actor_stages, 0, 1e3),
            per_stage("actor", actor_stages, 1, 1e3),
        ),
        critic_times=(
            per_stage("critic", critic_stages, 0, 1e3),
            per_stage("critic", critic_stages, 1, 1e3),
        ),
        actor_activation=act["actor"],
        critic_activation=act["critic"],
        actor_size=(sizes or {}).get("actor"),
        critic_size=(sizes or {}).get("critic"),
    )


def default_loss_fns(cfg: PPOConfig) -> dict[str, Any]:
    return {
        "actor": functools.partial(_actor_loss, cfg=cfg),
        "critic": functools.partial(_critic_loss, cfg=cfg),
    }


def _actor_loss(out: Tensor, mb: Mapping[str, Tensor], cfg: PPOConfig):  # noqa: ANN202
    return actor_ppo_loss(out, dict(mb), cfg)


def _critic_loss(out: Tensor, mb: Mapping[str, Tensor], cfg: PPOConfig):  # noqa: ANN202
    return critic_ppo_loss(out, dict(mb), cfg)


def partition_rank(
    problem: Problem,
    models: Mapping[str, nn.Module],
    rank: int,
    *,
    loss_fns: Mapping[str, Callable],
    layers: Mapping[str, Sequence[int] | None] | None = None,
    replicas: int = 1,
    device: torch.device | str = "cpu",
) -> FusedRank:
    """Partition ``models`` in place for global ``rank`` (stage group ``rank % N``) and make a
    :class:`TrainStageRunner` per stage it holds (``loss_fns[model]`` at a last stage).

    Local: no communication. The returned rank has no engine; call :meth:`FusedRank.plan`
    (profile + solve + build) or :meth:`FusedRank.build` (a given schedule) next.
    """
    if replicas < 1:
        raise PlanError(f"replicas: must be >= 1, got {replicas}")
    world = replicas * problem.stage_groups
    if not 0 <= rank < world:
        raise PlanError(f"rank {rank} is outside the world of {world} ({replicas} replica(s))")
    check_models_against_problem(problem, models, layers)
    stages: dict[str, PipelineStage] = {}
    runners: dict[str, TrainStageRunner] = {}
    for mi, _copy, s in problem.residents(rank % problem.stage_groups):
        spec = problem.models[mi]
        name = spec.name
        stage = partition_(models[name], name, s, spec.pipeline_stages, (layers or {}).get(name))
        stage.module.to(device)
        stages[name] = stage
        runners[name] = TrainStageRunner(stage, loss_fns[name] if stage.is_last else None)
    return FusedRank(problem, rank, stages, runners, replicas)


def setup_rank(
    plan: PipelinePlan,
    models: Mapping[str, nn.Module],
    *,
    loss_fns: Mapping[str, Callable],
    layers: Mapping[str, Sequence[int] | None] | None = None,
    timeout: float = 300.0,
    device: torch.device | str = "cpu",
    rank: int | None = None,
    trace: bool = False,
) -> FusedRank:
    """:func:`partition_rank` then build the pipeline on ``plan``. Collective: every rank of
    the plan must call it."""
    rank = dist.get_rank() if rank is None else rank
    fr = partition_rank(
        plan.problem,
        models,
        rank,
        loss_fns=loss_fns,
        layers=layers,
        replicas=plan.replicas,
        device=device,
    )
    fr._attach(plan, timeout=timeout, device=device, trace=trace)
    return fr


def forward_backward(
    rank: FusedRank,
    micro_batches: Sequence[Mapping[str, Tensor]],
    *,
    loss_denominator: float | None = None,
) -> None:
    """Run this rank's instruction stream once: every forward and backward of the step.

    ``micro_batches`` are this replica's micro-batches. Gradients accumulate in ``.grad``
    (call it several times to accumulate batches). ``loss_denominator`` divides every
    micro-batch loss (default: micro-batches per replica x replicas).
    """
    rank._engine().run(micro_batches, loss_denominator=loss_denominator)


def _step_optimizers(optimizers: Optimizers, roles: Sequence[str]) -> None:
    if optimizers is None:
        return
    if isinstance(optimizers, Mapping):
        opts = [optimizers[r] for r in roles]
    else:
        opts = [o for r, o in zip(ROLES, optimizers) if r in roles]
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def optimizer_step(
    rank: FusedRank, optimizers: Optimizers, *, max_grad_norm: float | None
) -> dict[str, float]:
    """Finish a step: all-reduce gradients over each stage's holders (and tied embeddings),
    clip each model to ``max_grad_norm`` by its global norm, step and zero the optimizers.

    ``optimizers``: ``{model: optimizer}``, or a sequence in :data:`ROLES` order (the Actor's
    first), or ``None`` (no step). Returns each model's global gradient norm before clipping.
    """
    engine = rank._engine()
    engine.sync_gradients()
    norms = engine.clip_gradients({n: max_grad_norm for n in rank.stages})
    _step_optimizers(optimizers, list(rank.stages))
    return norms


def pipelined_step(
    rank: FusedRank,
    micro_batches: Sequence[Mapping[str, Tensor]],
    optimizers: Optimizers,
    *,
    max_grad_norm: float | None = None,
    loss_denominator: float | None = None,
) -> dict[str, Any]:
    """One fused optimizer step: :func:`forward_backward`, :func:`optimizer_step`, and the loss
    statistics reduced over all micro-batches and replicas.

    Returns ``{"stats": {model: {name: value}}, "grad_norm": {model: norm}, "schedule_s",
    "step_s"}``.
    """
    t0 = time.perf_counter()
    forward_backward(rank, micro_batches, loss_denominator=loss_denominator)
    t1 = time.perf_counter()
    norms = optimizer_step(rank, optimizers, max_grad_norm=max_grad_norm)
    stats = rank._engine().reduced_stats()
    return {
        "stats": stats,
        "grad_norm": norms,
        "schedule_s": t1 - t0,
        "step_s": time.perf_counter() - t0,
    }


def model_outputs(role: str, model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
    """The unpipelined forward: logits of a causal LM, or per-position critic values."""
    if role == "actor":
        return model(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            use_cache=False,
        ).logits
    return model(mb["input_ids"], mb["attention_mask"], mb["position_ids"])


def reference_step(
    models: Mapping[str, nn.Module],
    micro_batches: Sequence[Mapping[str, Tensor]],
    optimizers: Optimizers,
    loss_fns: Mapping[str, Callable],
    *,
    max_grad_norm: float | None = None,
    loss_denominator: float | None = None,
    backward: Callable[[Tensor], None] | None = None,
    step: bool = True,
    roles: Sequence[str] = ROLES,
) -> dict[str, Any]:
    """The same step on one process without pipelining (the exactness reference, and the
    Lightning module's single-device ``training_step``). ``roles``: the models to train
    (a placement may put the Actor and the Critic on different ranks).

    Every micro-batch loss is divided by ``loss_denominator`` (default: the number of
    micro-batches) and back-propagated with ``backward`` (default ``Tensor.backward``).
    With ``step=False`` gradients only accumulate (no clipping, no optimizer step) and
    ``grad_norm`` is ``None``. ``optimizers`` as in :func:`optimizer_step`.
    Returns ``{"stats": {model: {name: value}}, "grad_norm": {model: norm} | None}``.
    """
    denom = float(loss_denominator or len(micro_batches))
    run_backward = backward if backward is not None else Tensor.backward
    stats: dict[str, dict[str, float]] = {}
    for name in roles:
        model = models[name]
        acc: dict[str, Tensor] = {}
        for mb in micro_batches:
            out = model_outputs(name, model, mb)
            loss, st = loss_fns[name](out, mb)
            run_backward(scale_loss(loss, denom))
            with torch.no_grad():
                for k, v in {"loss": loss, **st}.items():
                    val = scale_loss(v.detach(), denom).double()
                    acc[k] = acc[k] + val if k in acc else val
        stats[name] = {k: float(v) for k, v in acc.items()}
    if not step:
        return {"stats": stats, "grad_norm": None}
    norms = {n: clip_grad_norm_(models[n].parameters(), max_grad_norm) for n in roles}
    _step_optimizers(optimizers, roles)
    return {"stats": stats, "grad_norm": norms}


def canonical_state_dict(
    rank: FusedRank, prefix: dict[str, str] | None = None
) -> dict[str, Tensor]:
    """This rank's share of the full state dict: the stages it holds as replica 0 / copy 0."""
    out: dict[str, Tensor] = {}
    for name, stage in rank.stages.items():
        if not rank.is_canonical(name):
            continue
        pre = (prefix or {}).get(name, "")
        for k, v in stage.module.state_dict().items():
            out[pre + k] = v.detach().cpu().clone()
    return out


def plan_from(
    problem_or_schedule: Problem | Schedule,
    *,
    replicas: int = 1,
    solver: str = "greedy",
    time_limit: float = 5.0,
) -> PipelinePlan:
    sched = (
        problem_or_schedule
        if isinstance(problem_or_schedule, Schedule)
        else solve(problem_or_schedule, solver, time_limit=time_limit)
    )
    return PipelinePlan(sched, replicas)
