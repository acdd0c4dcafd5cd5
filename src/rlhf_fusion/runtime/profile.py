"""A short profiling pass on the real stages, feeding measured times to the planner."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..schedule import Problem
from .engine import TrainStageRunner
from .fused import fused_problem


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_runner(
    runner: TrainStageRunner,
    micro_batches: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
    *,
    repeats: int = 1,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Forward and backward seconds per micro-batch on this stage, averaged over micro-batches.

    One untimed pass over ``micro_batches`` warms up (allocator, kernels for each sequence
    length), then ``repeats`` timed passes; each micro-batch keeps its fastest time (least
    disturbed by other processes) and the mean over micro-batches is returned, since their
    lengths differ and the planner takes one number per stage. Stages after the first get a
    random hidden state of the right shape (from a private generator, so the global RNG
    stream the training relies on is untouched). Gradients the pass leaves are cleared.
    """
    device = torch.device(device)
    mbs = [micro_batches] if isinstance(micro_batches, Mapping) else list(micro_batches)
    stage = runner.stage
    param = next(stage.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    hidden = int(stage.module.config.hidden_size)
    gen = torch.Generator().manual_seed(1234)
    best_f = [float("inf")] * len(mbs)
    best_b = [float("inf")] * len(mbs)
    key = 0
    for r in range(1 + max(1, repeats)):
        for j, mb in enumerate(mbs):
            key -= 1
            rows, seq = mb["input_ids"].shape
            runner.begin_step(1.0)
            inp = None
            if not stage.is_first:
                inp = torch.randn(rows, seq, hidden, generator=gen).to(device=device, dtype=dtype)
            _sync(device)
            t0 = time.perf_counter()
            out = runner.forward((0, key), inp, mb)
            _sync(device)
            t1 = time.perf_counter()
            grad = None
            if out is not None:
                grad = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
            runner.backward((0, key), grad)
            _sync(device)
            t2 = time.perf_counter()
            if r:  # pass 0 is the warm-up
                best_f[j] = min(best_f[j], t1 - t0)
                best_b[j] = min(best_b[j], t2 - t1)
    for p in stage.parameters():
        p.grad = None
    runner.begin_step(1.0)
    return statistics.fmean(best_f), statistics.fmean(best_b)


def problem_from_profiles(
    profiles: Sequence[Mapping[str, tuple[int, float, float]]],
    *,
    stage_groups: int,
    micro_batches: int,
    actor_stages: int,
    critic_stages: int,
    activation: Mapping[str, Sequence[float]] | None = None,
    sizes: Mapping[str, float] | None = None,
) -> Problem:
    """The fused problem with measured per-stage times in milliseconds.

    ``profiles`` holds, per rank, ``{model: (stage, forward_s, backward_s)}``; a stage held by
    several ranks (copies, replicas) takes the slowest measurement.
    """
    times: dict[str, dict[int, list[float]]] = {"actor": {}, "critic": {}}
    for prof in profiles:
        for model, (stage, f, b) in prof.items():
            cur = times[model].get(stage)
            times[model][stage] = [max(cur[0], f), max(cur[1], b)] if cur else [f, b]

    def per_stage(model: str, stages: int, k: int) -> list[float]:
        missing = [s for s in range(stages) if s not in times[model]]
        if missing:
            raise RuntimeError(f"profiling: no measurement for {model} stages {missing}")
        # Milliseconds, floored at 1 us so a trivially cheap stage still orders correctly.
        return [max(round(times[model][s][k] * 1e3, 3), 0.001) for s in range(stages)]

    act = activation or {}
    return fused_problem(
        stage_groups=stage_groups,
        micro_batches=micro_batches,
        actor_stages=actor_stages,
        critic_stages=critic_stages,
        actor_times=(per_stage("actor", actor_stages, 0), per_stage("actor", actor_stages, 1)),
        critic_times=(per_stage("critic", critic_stages, 0), per_stage("critic", critic_stages, 1)),
        actor_activation=list(act.get("actor", [1.0] * actor_stages)),
        critic_activation=list(act.get("critic", [1.0] * critic_stages)),
        actor_size=(sizes or {}).get("actor"),
        critic_size=(sizes or {}).get("critic"),
    )
