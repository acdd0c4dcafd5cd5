"""Baseline schedules: 1F1B per model, serial 1F1B and concatenated 1F1B."""

from __future__ import annotations

from .evaluate import CompiledProblem
from .problem import Problem, Task


def one_f_one_b(problem: Problem, model: int, copy: int, stage: int) -> list[Task]:
    """The 1F1B (PipeDream-flush) order of one stage: S-s-1 warm-up forwards, then F/B pairs."""
    m = problem.models[model]
    mbs = m.micro_batches
    warmup = min(m.pipeline_stages - stage - 1, mbs)
    out = [Task(model, copy, "F", stage, i) for i in range(warmup)]
    for i in range(mbs - warmup):
        out.append(Task(model, copy, "F", stage, warmup + i))
        out.append(Task(model, copy, "B", stage, i))
    out.extend(Task(model, copy, "B", stage, i) for i in range(mbs - warmup, mbs))
    return out


def concatenated_1f1b(problem: Problem) -> list[list[Task]]:
    """On every group, each model's 1F1B order in model order (the Actor's, then the Critic's)."""
    order: list[list[Task]] = []
    for g in range(problem.stage_groups):
        tasks: list[Task] = []
        for mi, c, s in problem.residents(g):
            tasks.extend(one_f_one_b(problem, mi, c, s))
        order.append(tasks)
    return order


def single_model_problem(problem: Problem, model: int) -> Problem:
    m = problem.models[model]
    return Problem(problem.stage_groups, (m,), problem.memory_capacity, problem.name)


def model_1f1b(problem: Problem, model: int) -> tuple[float, float]:
    """Makespan and peak activation of one model alone under 1F1B (all its copies in parallel)."""
    sub = single_model_problem(problem, model)
    cp = CompiledProblem(sub)
    ids = cp.ids(concatenated_1f1b(sub))
    makespan = cp.makespan(ids)
    assert makespan is not None
    return makespan, cp.peak(ids)


def serial_1f1b(problem: Problem) -> tuple[float, float]:
    """Serial 1F1B: each model's 1F1B runs to completion before the next starts.

    Returns (makespan, peak activation); the peak is the largest of the models' own peaks,
    because one model's activations are freed before the next model starts.
    """
    total = peak = 0.0
    for mi in range(len(problem.models)):
        ms, pk = model_1f1b(problem, mi)
        total += ms
        peak = max(peak, pk)
    return total, peak
