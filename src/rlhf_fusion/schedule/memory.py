"""The memory pass: lower peak activation memory without letting the makespan grow.

First one exact round over all groups (cumulative memory, makespan held) for half the budget,
then large-neighbourhood search over groups: the groups at the current peak form the window; every
other group keeps its order (so its peak cannot change) and CP-SAT reorders the window to
minimise its peak with the makespan held. When a window cannot improve, it grows by the
neighbouring groups that feed it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .cpsat import solve_window
from .evaluate import CompiledProblem, IdOrder

_EPS = 1e-9


def reduce_peak(
    cp: CompiledProblem,
    order: IdOrder,
    *,
    makespan: float,
    seconds: float,
    caps: Sequence[float] | None = None,
    workers: int = 1,
    seed: int = 0,
    stats: dict[str, Any] | None = None,
    max_window: int = 4,
) -> IdOrder:
    deadline = time.perf_counter() + seconds
    best = [list(g) for g in order]
    n_groups = len(best)
    rounds = 1
    res = solve_window(
        cp, best, range(n_groups), makespan=makespan, time_limit=seconds / 2, caps=caps,
        workers=workers, seed=seed,
    )
    if res is not None:
        ms = cp.makespan(res[0])
        if ms is not None and ms <= makespan + _EPS and cp.peak(res[0]) < cp.peak(best) - _EPS:
            best = res[0]
    width = 0  # extra neighbours added around the peak groups
    while time.perf_counter() < deadline - 0.2:
        peaks = cp.group_peaks(best)
        top = max(peaks)
        window = {g for g, p in enumerate(peaks) if p >= top - _EPS}
        for _ in range(width):
            window |= {h for g in window for h in (g - 1, g + 1) if 0 <= h < n_groups}
        if len(window) > max(max_window, sum(p >= top - _EPS for p in peaks)) and width > 0:
            break
        budget = min(deadline - time.perf_counter(), max(2.0, seconds / 6))
        rounds += 1
        res = solve_window(
            cp, best, sorted(window), makespan=makespan, time_limit=budget, caps=caps,
            workers=workers, seed=seed + rounds,
        )
        if res is not None:
            cand, _ = res
            ms = cp.makespan(cand)
            if ms is not None and ms <= makespan + _EPS and max(cp.group_peaks(cand)) < top - _EPS:
                best = cand
                width = 0
                continue
        width += 1
    if stats is not None:
        stats["memory_pass"] = {"rounds": rounds, "peak_activation": round(cp.peak(best), 6)}
    return best
