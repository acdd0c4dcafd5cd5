"""The search behind ``solve(solver="anneal" | "cpsat" | "auto")``.

``auto``: greedy, then CP-SAT. CP-SAT first asks whether the lower bound is reachable (a
makespan capped at the bound propagates strongly and is usually decided in seconds; the first
attempt also keeps activation memory within a release staircase, later ones alternate
unconstrained runs and fixed in-flight limits). If not, a short anneal gives a
better hint for minimising the makespan. The rest of the budget goes to the memory pass, with
the makespan held.
"""

from __future__ import annotations

import time
from typing import Any

from .anneal import anneal
from .baselines import concatenated_1f1b
from .cpsat import solve_cpsat
from .evaluate import CompiledProblem, IdOrder
from .greedy import greedy
from .memory import bound_budget_limits, bound_staircase, reduce_peak, stair_attempt_seconds
from .policy import DEFAULT_POLICY, SearchPolicy
from .problem import InfeasibleError, Problem, Task

__all__ = ["InfeasibleError", "search"]


def search(
    problem: Problem,
    cp: CompiledProblem,
    *,
    solver: str,
    time_limit: float,
    seed: int,
    workers: int | None,
    memory_pass: bool,
    lower_bound: float,
    progress=None,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> tuple[list[list[Task]], bool, dict[str, Any]]:
    p = policy
    t0 = time.perf_counter()
    # Leave room for validating and packaging the result inside the caller's budget.
    deadline = t0 + time_limit - min(p.result_margin_max, p.result_margin * time_limit)
    caps = list(problem.memory_capacity) if problem.memory_capacity is not None else None
    workers = workers or p.default_workers
    stats: dict[str, Any] = {"phases": []}

    def note(phase: str, order: IdOrder, **extra: Any) -> None:
        ms = cp.makespan(order)
        entry = {"phase": phase, "makespan": ms, "peak_activation": round(cp.peak(order), 6)}
        entry.update(extra)
        entry["elapsed"] = round(time.perf_counter() - t0, 3)
        stats["phases"].append(entry)
        if progress is not None:
            progress(phase, min(1.0, entry["elapsed"] / time_limit), ms)

    # A valid start: the greedy, or concatenated 1F1B (whose per-group peak is the serial one)
    # when the greedy breaks the capacity.
    concat = cp.ids(concatenated_1f1b(problem))
    serial_peak = max(cp.group_peaks(concat))
    best = cp.ids(greedy(problem))
    if not cp.fits(best, caps):
        best = concat
        if not cp.fits(best, caps) and solver == "anneal":
            raise InfeasibleError(
                "infeasible under capacity: even concatenated 1F1B needs "
                f"{max(cp.group_peaks(best)):g} on some group; raise memory_capacity or use "
                "solver='cpsat' to search for a lower-memory order"
            )
    start_valid = cp.fits(best, caps)
    if start_valid:
        note("start", best)
    optimal = False

    def remaining() -> float:
        return deadline - time.perf_counter()

    def run_anneal(seconds: float) -> None:
        nonlocal best
        res = anneal(
            cp, best, seconds=seconds, seed=seed, workers=workers,
            memory_fraction=p.anneal_memory_fraction, caps=caps,
        )
        stats["anneal"] = {"makespan": res.makespan, "peak_activation": round(res.peak, 6),
                           "steps_per_worker": res.steps}
        if (res.makespan, res.peak) < (cp.makespan(best), cp.peak(best)):
            best = res.order
        note("anneal", best)

    if solver == "anneal" and start_valid:
        run_anneal(remaining())

    if solver in ("cpsat", "auto"):
        best_ms = cp.makespan(best) if start_valid else float("inf")
        # The bound is the goal, so its feasibility check gets the largest share; it stops as
        # soon as it finds a schedule.
        t_phase = time.perf_counter()
        phase1 = remaining() * (p.makespan_share if memory_pass else 1.0)
        # 1) Is the lower bound reachable? CP-SAT's time to decide this is heavy-tailed (one
        # seed decides a model quickly, another not at all), so it restarts with another seed
        # rather than spending the whole share on one run. With the memory pass on, the first
        # attempt runs under a release staircase worth bound_budget x the serial peak
        # (``staircase.py``): its precedences prune the search, and the schedule it finds is
        # already within that budget, from which staircases step down. The attempts after it
        # alternate unconstrained runs (for problems where the limits exclude every schedule
        # at the bound) and fixed in-flight limits. Measured figures: docs/planner.md.
        if best_ms > lower_bound + 1e-9:
            share = phase1 * p.bound_share
            limits = stair = None
            if memory_pass and serial_peak > 0:
                limits = bound_budget_limits(cp, concat, p.bound_budget * serial_peak, caps)
                stair = bound_staircase(cp, concat, p.bound_budget * serial_peak, caps)
            # Unhinted first: on the hardest Table 3 setting it is the run that gets there.
            hints = [None, best if start_valid else None, concat]
            attempt = unconstrained = 0
            last: str | None = None
            statuses = []
            # An unconstrained run that succeeds takes about the same time whatever the seed,
            # so it gets time by size.
            per_unconstrained = p.attempt_at_bound_seconds(len(cp.tasks))
            while True:
                left = share - (time.perf_counter() - t_phase)
                inflight = extra = params = None
                if stair is not None:
                    kind, per = "release", stair_attempt_seconds(cp, p)
                    params = p.stair_cpsat_params()
                    inflight, extra = stair
                elif limits is not None and last in (None, "unconstrained"):
                    kind, per, inflight = "limited", p.attempt_seconds, limits
                else:
                    kind, per = "unconstrained", per_unconstrained
                if kind == "unconstrained" and unconstrained == 0 and attempt > 0:
                    # The bound comes first: after a failed memory-limited attempt, one
                    # unconstrained run gets its full time even past the share.
                    budget = min(per, p.unconstrained_reserve * remaining())
                    if budget < p.min_attempt_seconds:
                        break
                elif left < p.min_attempt_seconds:
                    break
                else:
                    budget = left if left < p.stretch_last_attempt * per else per
                r = solve_cpsat(
                    cp,
                    time_limit=budget,
                    lower_bound=lower_bound,
                    makespan_cap=lower_bound,
                    memory_cap=caps,
                    inflight=inflight,
                    extra=extra,
                    hint_order=hints[unconstrained % len(hints)] if kind == "unconstrained" else None,
                    workers=workers,
                    seed=seed + attempt,
                    params=params,
                )
                statuses.append(("" if kind == "unconstrained" else kind + " ") + r.status)
                attempt += 1
                unconstrained += kind == "unconstrained"
                last = kind
                if r.order is not None and cp.fits(r.order, caps):
                    best, best_ms, start_valid = r.order, cp.makespan(r.order), True
                    note("cpsat-bound", best, attempts=attempt)
                    break
                if kind == "release":
                    stair = None  # one try: its time is better spent unconstrained next
                elif r.infeasible and kind == "limited":
                    limits = None  # proven too tight: the unconstrained attempts only
                elif r.infeasible:
                    break
            stats["cpsat_at_bound"] = statuses
        # 2) Otherwise anneal briefly for a better hint, then minimise the makespan from it.
        if solver == "auto" and start_valid and best_ms > lower_bound + 1e-9:
            run_anneal(min(remaining() * p.hint_anneal_share, p.hint_anneal_max))
            best_ms = cp.makespan(best)
        left = phase1 - (time.perf_counter() - t_phase)
        if best_ms > lower_bound + 1e-9 and left > p.min_attempt_seconds:
            r = solve_cpsat(
                cp, time_limit=left, lower_bound=lower_bound,
                makespan_cap=None if best_ms == float("inf") else best_ms,
                memory_cap=caps, hint_order=best if start_valid else None, workers=workers, seed=seed,
            )
            stats["cpsat_makespan"] = r.status
            if r.order is not None and cp.makespan(r.order) < best_ms:
                best, best_ms, start_valid = r.order, cp.makespan(r.order), True
                note("cpsat-makespan", best)
            optimal = r.proven_optimal
            if r.infeasible and caps is not None and not start_valid:
                raise InfeasibleError(
                    "infeasible under capacity: no order keeps every group within "
                    f"memory_capacity={caps}; raise the capacity or use fewer micro-batches in flight"
                )
        if not start_valid:
            raise InfeasibleError(
                f"no schedule within memory_capacity={caps} was found in {time_limit:g} s; "
                "raise the capacity or the time limit"
            )
        # 3) Memory pass: hold the makespan, lower the peak.
        if memory_pass and remaining() > p.min_attempt_seconds:
            best = reduce_peak(
                cp, best, makespan=best_ms, seconds=remaining(), fallback=concat,
                serial_peak=serial_peak, caps=caps, workers=workers, seed=seed, stats=stats,
                lower_bound=lower_bound, policy=p,
            )
            note("memory", best)
    if not start_valid:
        raise InfeasibleError(f"no schedule within memory_capacity={caps}")
    stats["optimal"] = optimal
    return cp.tasks_of(best), optimal, stats
