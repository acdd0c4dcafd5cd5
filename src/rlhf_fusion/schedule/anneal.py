"""The RLHFuse paper's simulated annealing, parallel over seeds.

Start from a valid order (the greedy's), propose a swap of two adjacent tasks on one group,
reject neighbours that deadlock (or break a memory capacity), accept a worse one with
probability exp((e - e') / T), cool T <- alpha * T until T < eps, keep the best. A second pass
anneals on peak activation memory while refusing any move that lengthens the makespan.

The cooling rate is derived from the time budget, so a run ends on time whatever the problem
size: the number of steps is the budget divided by the measured cost of one simulation.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .evaluate import CompiledProblem, IdOrder
from .problem import Problem


@dataclass
class AnnealResult:
    order: IdOrder
    makespan: float
    peak: float
    steps: int
    seed: int


def _energy(cp: CompiledProblem, order: IdOrder) -> tuple[float, float] | None:
    res = cp.simulate(order)
    if res is None:
        return None
    makespan, end = res
    # Mean completion time breaks ties between equal makespans, giving the walk a slope.
    return makespan, makespan + 1e-3 * sum(end) / len(end)


def anneal_once(
    cp: CompiledProblem,
    start: IdOrder,
    *,
    seconds: float,
    seed: int,
    memory_fraction: float = 0.3,
    caps: Sequence[float] | None = None,
    t_end: float = 1e-3,
) -> AnnealResult:
    rng = random.Random(seed)
    order = [list(g) for g in start]
    base = _energy(cp, order)
    if base is None:
        raise ValueError("anneal: the starting order deadlocks")
    tasks = cp.tasks
    same_lane = lambda a, b: tasks[a][:4] == tasks[b][:4]  # noqa: E731 - tiny hot-path helper
    movable = [g for g in range(len(order)) if len(order[g]) > 1]

    def propose(cur: IdOrder) -> tuple[int, int] | None:
        g = rng.choice(movable)
        k = rng.randrange(len(cur[g]) - 1)
        a, b = cur[g][k], cur[g][k + 1]
        if same_lane(a, b) or cp.pred[b] == a:
            return None
        return g, k

    t0 = time.perf_counter()
    # Measure one evaluation to turn the time budget into a number of steps.
    probe = time.perf_counter()
    _energy(cp, order)
    per_step = max(1e-6, time.perf_counter() - probe)
    budget = {"makespan": seconds * (1 - memory_fraction), "memory": seconds * memory_fraction}

    steps = 0
    cur_e = base
    best_order, best_e = [list(g) for g in order], base
    temp0 = max(cp.duration)
    n_steps = max(1, int(budget["makespan"] / per_step))
    alpha = (t_end / temp0) ** (1.0 / n_steps)
    temp = temp0
    deadline = t0 + budget["makespan"]
    while temp > t_end and time.perf_counter() < deadline:
        steps += 1
        temp *= alpha
        mv = propose(order)
        if mv is None:
            continue
        g, k = mv
        order[g][k], order[g][k + 1] = order[g][k + 1], order[g][k]
        new_e = _energy(cp, order)
        ok = new_e is not None and cp.fits(order, caps)
        if ok and (new_e[1] <= cur_e[1] or rng.random() < math.exp((cur_e[1] - new_e[1]) / temp)):
            cur_e = new_e
            if new_e[1] < best_e[1]:
                best_e, best_order = new_e, [list(x) for x in order]
        else:
            order[g][k], order[g][k + 1] = order[g][k + 1], order[g][k]

    # Memory pass: anneal on the peak, never letting the makespan grow.
    limit = best_e[0] + 1e-9
    order = [list(g) for g in best_order]
    cur_p = cp.peak(order)
    best_p = cur_p
    mem_best = [list(g) for g in order]
    temp0 = max(abs(m) for m in cp.mem) or 1.0
    n_steps = max(1, int(budget["memory"] / per_step))
    alpha = (t_end / temp0) ** (1.0 / n_steps)
    temp = temp0
    deadline = time.perf_counter() + budget["memory"]
    while temp > t_end and time.perf_counter() < deadline:
        steps += 1
        temp *= alpha
        mv = propose(order)
        if mv is None:
            continue
        g, k = mv
        order[g][k], order[g][k + 1] = order[g][k + 1], order[g][k]
        ms = cp.makespan(order)
        new_p = cp.peak(order) if ms is not None and ms <= limit else None
        if (
            new_p is not None
            and cp.fits(order, caps)
            and (new_p <= cur_p or rng.random() < math.exp((cur_p - new_p) / temp))
        ):
            cur_p = new_p
            if new_p < best_p:
                best_p, mem_best = new_p, [list(x) for x in order]
        else:
            order[g][k], order[g][k + 1] = order[g][k + 1], order[g][k]
    return AnnealResult(mem_best, best_e[0], best_p, steps, seed)


def _worker(args: tuple) -> AnnealResult:
    problem, start, seconds, seed, memory_fraction, caps = args
    cp = CompiledProblem(problem)
    return anneal_once(cp, start, seconds=seconds, seed=seed, memory_fraction=memory_fraction, caps=caps)


def anneal(
    problem: Problem,
    cp: CompiledProblem,
    start: IdOrder,
    *,
    seconds: float,
    seed: int = 0,
    workers: int | None = None,
    memory_fraction: float = 0.3,
    caps: Sequence[float] | None = None,
) -> AnnealResult:
    """Anneal from ``start`` with one seed per worker process; the best (makespan, peak) wins."""
    workers = max(1, workers or os.cpu_count() or 1)
    if multiprocessing.current_process().daemon:
        workers = 1  # daemonic processes (e.g. a pipeline rank) cannot have children
    if workers == 1:
        return anneal_once(cp, start, seconds=seconds, seed=seed, memory_fraction=memory_fraction, caps=caps)
    jobs = [(problem, start, seconds, seed + i, memory_fraction, caps) for i in range(workers)]
    # fork is cheap and the planner holds no threads yet; spawn where fork does not exist.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        results = list(pool.map(_worker, jobs))
    return min(results, key=lambda r: (r.makespan, r.peak))
