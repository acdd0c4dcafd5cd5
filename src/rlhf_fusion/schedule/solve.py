"""One entry point for every solver: ``solve(problem, solver=...) -> Schedule``."""

from __future__ import annotations

import time
from collections.abc import Callable

from .baselines import concatenated_1f1b, serial_1f1b
from .bounds import lower_bound
from .evaluate import CompiledProblem, validate
from .greedy import greedy
from .problem import Problem, ProblemError, Task
from .result import Schedule

SOLVERS = ("auto", "cpsat", "anneal", "greedy", "concatenated_1f1b")

Progress = Callable[[str, float, float], None]  # (phase, fraction done, best makespan so far)


def baselines(problem: Problem) -> dict[str, dict[str, float]]:
    """Reference points, measured without any memory capacity (the greedy ignores it)."""
    problem = problem.with_capacity(None)
    ser_ms, ser_pk = serial_1f1b(problem)
    conc = validate(problem, concatenated_1f1b(problem))
    gr = validate(problem, greedy(problem))
    return {
        "serial_1f1b": {"makespan": ser_ms, "peak_activation": round(ser_pk, 6)},
        "concatenated_1f1b": {"makespan": conc.makespan, "peak_activation": round(conc.peak_activation, 6)},
        "greedy": {"makespan": gr.makespan, "peak_activation": round(gr.peak_activation, 6)},
    }


def solve(
    problem: Problem,
    solver: str = "auto",
    *,
    time_limit: float = 60.0,
    seed: int = 0,
    workers: int | None = None,
    memory_pass: bool = True,
    progress: Progress | None = None,
) -> Schedule:
    """Find a fused schedule for ``problem``.

    ``auto`` runs greedy, then simulated annealing from it, then the CP-SAT solver seeded with
    the best order so far, all within ``time_limit`` seconds, and returns the best valid
    schedule with ``optimal`` set when the makespan is proven minimal. With a
    ``memory_capacity`` the result respects it or :class:`InfeasibleError` is raised.
    """
    if solver not in SOLVERS:
        raise ProblemError(f"solver: unknown {solver!r}; choose one of {', '.join(SOLVERS)}")
    if time_limit <= 0:
        raise ProblemError(f"time_limit: must be > 0 seconds, got {time_limit}")
    t0 = time.perf_counter()
    lb = lower_bound(problem)
    base = baselines(problem)
    cp = CompiledProblem(problem)
    stats: dict = {}
    order: list[list[Task]]
    optimal = False

    if solver == "concatenated_1f1b":
        order = concatenated_1f1b(problem)
    elif solver == "greedy":
        order = greedy(problem)
    else:
        from .search import search  # the heavier solvers, imported on demand

        order, optimal, stats = search(
            problem,
            cp,
            solver=solver,
            time_limit=time_limit,
            seed=seed,
            workers=workers,
            memory_pass=memory_pass,
            lower_bound=lb,
            progress=progress,
        )
    ev = validate(problem, order, cp)
    if ev.makespan <= lb + 1e-9:
        optimal = True
    return Schedule(
        problem=problem,
        order=[list(g) for g in order],
        solver=solver,
        seconds=time.perf_counter() - t0,
        makespan=ev.makespan,
        peak_activation=ev.peak_activation,
        lower_bound=lb,
        baselines=base,
        optimal=optimal,
        stats=stats,
    )
