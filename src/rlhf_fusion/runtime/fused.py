"""Putting the pieces together for PPO: the fused Actor/Critic problem, one rank's setup, one
pipelined optimizer step, and the single-process reference step it must reproduce."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..schedule import Problem, Schedule, solve
from .comm import PipelineComm
from .engine import PipelineEngine, TrainStageRunner, clip_grad_norm_, scale_loss
from .errors import PlanError
from .partition import PipelineStage, num_layers, partition_, split_layers
from .plan import PipelinePlan
from .ppo import PPOConfig, actor_ppo_loss, critic_ppo_loss

ROLES = ("actor", "critic")


def fused_problem(
    *,
    stage_groups: int,
    micro_batches: int,
    actor_stages: int | None = None,
    critic_stages: int | None = None,
    actor_times: tuple[Any, Any] = (1.0, 2.0),
    critic_times: tuple[Any, Any] = (1.0, 2.0),
    actor_activation: Any = 1.0,
    critic_activation: Any = 1.0,
    actor_size: float | None = None,
    critic_size: float | None = None,
) -> Problem:
    """The fused PPO training problem: Actor forward over groups 0..N-1, Critic reversed.

    ``micro_batches`` is per pipeline replica per step; each model's copies split it
    (``copies = N / stages``, ``micro_batches per copy = micro_batches / copies``). ``*_times``
    are (forward, backward) per stage: a number or a list of one number per stage.
    """
    n = stage_groups
    models = []
    for name, stages, times, act, size, direction in (
        ("actor", actor_stages or n, actor_times, actor_activation, actor_size, "forward"),
        ("critic", critic_stages or n, critic_times, critic_activation, critic_size, "reverse"),
    ):
        if n % stages:
            raise PlanError(
                f"{name}_stages: {stages} does not divide stage_groups={n}; choose a divisor of {n}"
            )
        copies = n // stages
        if micro_batches % copies:
            raise PlanError(
                f"micro_batches: {micro_batches} cannot be shared by the {copies} copies of the "
                f"{name}; use a multiple of {copies}"
            )
        spec: dict[str, Any] = {
            "name": name,
            "pipeline_stages": stages,
            "copies": copies,
            "micro_batches": micro_batches // copies,
            "forward": list(times[0]) if isinstance(times[0], Sequence) else times[0],
            "backward": list(times[1]) if isinstance(times[1], Sequence) else times[1],
            "activation": list(act) if isinstance(act, Sequence) else act,
            "direction": direction,
        }
        if size is not None:
            spec["size"] = size
        models.append(spec)
    return Problem.from_dict({"stage_groups": n, "models": models})


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


@dataclass
class FusedRank:
    """One rank's partitioned stages, communicator and engine."""

    plan: PipelinePlan
    stages: dict[str, PipelineStage]
    engine: PipelineEngine

    @property
    def comm(self) -> PipelineComm:
        return self.engine.comm

    def parameters(self, model: str) -> list[nn.Parameter]:
        return list(self.stages[model].parameters())

    def close(self) -> None:
        self.engine.close()


def default_loss_fns(cfg: PPOConfig) -> dict[str, Any]:
    return {
        "actor": functools.partial(_actor_loss, cfg=cfg),
        "critic": functools.partial(_critic_loss, cfg=cfg),
    }


def _actor_loss(out: Tensor, mb: Mapping[str, Tensor], cfg: PPOConfig):  # noqa: ANN202
    return actor_ppo_loss(out, dict(mb), cfg)


def _critic_loss(out: Tensor, mb: Mapping[str, Tensor], cfg: PPOConfig):  # noqa: ANN202
    return critic_ppo_loss(out, dict(mb), cfg)


def setup_rank(
    plan: PipelinePlan,
    models: Mapping[str, nn.Module],
    *,
    loss_fns: Mapping[str, Any],
    layers: Mapping[str, Sequence[int] | None] | None = None,
    timeout: float = 300.0,
    device: torch.device | str = "cpu",
    rank: int | None = None,
    trace: bool = False,
) -> FusedRank:
    """Partition ``models`` in place for this rank and build its communicator and engine.

    Collective: every rank of the plan must call it.
    """
    check_models_against_problem(plan.problem, models, layers)
    comm = PipelineComm(plan, rank, timeout=timeout, device=device)
    stages: dict[str, PipelineStage] = {}
    runners = {}
    for name, res in plan.residents(comm.rank).items():
        stage = partition_(models[name], name, res.stage, res.num_stages, (layers or {}).get(name))
        stage.module.to(device)
        stages[name] = stage
        runners[name] = TrainStageRunner(stage, loss_fns[name] if stage.is_last else None)
    engine = PipelineEngine(plan, comm, runners, trace=trace)
    return FusedRank(plan, stages, engine)


def pipelined_step(
    rank: FusedRank,
    micro_batches: Sequence[Mapping[str, Tensor]],
    optimizers: Mapping[str, torch.optim.Optimizer] | None,
    *,
    max_grad_norm: float | None = None,
    loss_denominator: float | None = None,
) -> dict[str, Any]:
    """Run one fused step: schedule, gradient sync, clipping, optimizer steps."""
    t0 = time.perf_counter()
    rank.engine.run(micro_batches, loss_denominator=loss_denominator)
    t1 = time.perf_counter()
    rank.engine.sync_gradients()
    norms = rank.engine.clip_gradients({n: max_grad_norm for n in rank.stages})
    if optimizers is not None:
        for name in rank.stages:
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
    stats = rank.engine.reduced_stats()
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
    optimizers: Mapping[str, torch.optim.Optimizer] | None,
    loss_fns: Mapping[str, Any],
    *,
    max_grad_norm: float | None = None,
) -> dict[str, Any]:
    """The same optimizer step on one process without pipelining (the exactness reference)."""
    denom = float(len(micro_batches))
    stats: dict[str, dict[str, float]] = {}
    for name in ROLES:
        model = models[name]
        acc: dict[str, Tensor] = {}
        for mb in micro_batches:
            out = model_outputs(name, model, mb)
            loss, st = loss_fns[name](out, mb)
            scale_loss(loss, denom).backward()
            with torch.no_grad():
                for k, v in {"loss": loss, **st}.items():
                    val = scale_loss(v.detach(), denom).double()
                    acc[k] = acc[k] + val if k in acc else val
        stats[name] = {k: float(v) for k, v in acc.items()}
    norms = {n: clip_grad_norm_(models[n].parameters(), max_grad_norm) for n in ROLES}
    if optimizers is not None:
        for name in ROLES:
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
    return {"stats": stats, "grad_norm": norms}


def canonical_state_dict(
    rank: FusedRank, prefix: dict[str, str] | None = None
) -> dict[str, Tensor]:
    """This rank's share of the full state dict: the stages it holds as replica 0 / copy 0."""
    out: dict[str, Tensor] = {}
    for name, stage in rank.stages.items():
        if not rank.plan.is_canonical(rank.comm.rank, name):
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
