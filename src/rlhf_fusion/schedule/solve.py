"""One entry point for every solver: ``solve(problem, solver=...) -> Schedule``."""

from __future__ import annotations

import time
from collections.abc import Callable

from .baselines import concatenated_1f1b, serial_1f1b
from .bounds import lower_bound
from .evaluate import CompiledProblem, validate
from .greedy import greedy
from .policy import DEFAULT_POLICY, SearchPolicy
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
    policy: SearchPolicy | None = None,
) -> Schedule:
    """Find a fused schedule for ``problem`` and return it validated.

    Solvers:

    - ``"concatenated_1f1b"``: on every group the Actor's 1F1B order, then the Critic's.
    - ``"greedy"``: the RLHFuse list scheduler (earliest start, backward before forward on
      ties, a smaller model's task dropped if it would delay the larger model's).
    - ``"anneal"``: the paper's simulated annealing from the greedy (or from concatenated
      1F1B when the greedy breaks ``memory_capacity``), one seed per worker, using the whole
      ``time_limit``; its second pass lowers peak memory with the makespan held.
    - ``"cpsat"``: OR-Tools CP-SAT. (1) Is the lower bound reachable? The makespan is capped
      at the bound, which CP-SAT usually decides in seconds; attempts restart with new seeds
      (the first under a release staircase of in-flight limits, later ones alternating
      unconstrained runs and fixed in-flight limits). (2) If not, makespan minimisation from
      the best order so far. (3) With ``memory_pass``, the rest of the time lowers peak
      activation memory with the makespan held (``memory.reduce_peak``: in-flight budgets,
      capacity rungs, exact peak, time windows).
    - ``"auto"`` (default): the greedy as start, then ``"cpsat"``'s phases, with a short
      anneal before the makespan minimisation of (2) to give it a better hint.

    All of it fits in ``time_limit`` seconds (a small margin is kept for validation). Time
    shares, attempt lengths and steps come from ``policy`` (:class:`SearchPolicy`; the
    default instance when ``None``). ``workers`` is CP-SAT's worker count and the annealer's
    process count (``policy.default_workers`` when ``None``); ``seed`` makes runs repeatable up
    to CP-SAT's timing. ``progress(phase, fraction, best_makespan)`` is called after each phase.

    Returns a :class:`Schedule`: the order per group, makespan, peak activation, lower bound,
    baselines (serial 1F1B, concatenated 1F1B, greedy), seconds spent, ``optimal`` (the
    makespan equals the lower bound, or CP-SAT proved it minimal) and ``stats`` (per-phase
    makespan and peak, every at-bound attempt's status, the memory pass's log).

    Raises :class:`ProblemError` for an unknown ``solver`` or ``time_limit <= 0``;
    :class:`InfeasibleError` when a ``memory_capacity`` is set and no order within it exists
    (proven by CP-SAT, or for ``"anneal"`` when not even concatenated 1F1B fits) or none was
    found in time; :class:`CapacityError` when ``"greedy"`` or ``"concatenated_1f1b"`` breaks
    the capacity.
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
            policy=policy or DEFAULT_POLICY,
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
