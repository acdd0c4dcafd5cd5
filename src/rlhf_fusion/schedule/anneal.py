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
    # Time one evaluation to turn the time budget into a number of steps.
    probe = time.perf_counter()
    if _energy(cp, order) is None:
        raise ValueError("anneal: the starting order deadlocks")
    per_step = max(1e-6, time.perf_counter() - probe)
    tasks = cp.tasks
    movable = [g for g in range(len(order)) if len(order[g]) > 1]
    steps = 0

    def walk(order: IdOrder, score, temp0: float, budget: float) -> tuple[IdOrder, float]:
        """Adjacent-swap annealing on ``score`` (None: reject); returns the best order seen."""
        nonlocal steps
        cur = best = score(order)
        best_order = [list(g) for g in order]
        alpha = (t_end / temp0) ** (1.0 / max(1, int(budget / per_step)))
        temp, deadline = temp0, time.perf_counter() + budget
        while temp > t_end and time.perf_counter() < deadline:
            steps += 1
            temp *= alpha
            g = rng.choice(movable)
            k = rng.randrange(len(order[g]) - 1)
            a, b = order[g][k], order[g][k + 1]
            # Swapping two tasks of one lane only relabels micro-batches; a task and its own
            # predecessor can never swap.
            if tasks[a][:4] == tasks[b][:4] or cp.pred[b] == a:
                continue
            order[g][k], order[g][k + 1] = b, a
            new = score(order) if cp.fits(order, caps) else None
            if new is not None and (new <= cur or rng.random() < math.exp((cur - new) / temp)):
                cur = new
                if new < best:
                    best, best_order = new, [list(x) for x in order]
            else:
                order[g][k], order[g][k + 1] = a, b
        return best_order, best

    def by_makespan(o: IdOrder) -> float | None:
        e = _energy(cp, o)
        return None if e is None else e[1]

    order, _ = walk(order, by_makespan, max(cp.duration), seconds * (1 - memory_fraction))
    limit = cp.makespan(order) + 1e-9

    def by_peak(o: IdOrder) -> float | None:
        # The memory pass never lets the makespan grow.
        ms = cp.makespan(o)
        return None if ms is None or ms > limit else cp.peak(o)

    order, peak = walk(order, by_peak, max(abs(m) for m in cp.mem) or 1.0, seconds * memory_fraction)
    return AnnealResult(order, cp.makespan(order), peak, steps, seed)


def _worker(args: tuple) -> AnnealResult:
    problem, start, seconds, seed, memory_fraction, caps = args
    cp = CompiledProblem(problem)
    return anneal_once(cp, start, seconds=seconds, seed=seed, memory_fraction=memory_fraction, caps=caps)


def anneal(
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
    # Each worker compiles the problem again rather than unpickling the compiled arrays.
    jobs = [(cp.problem, start, seconds, seed + i, memory_fraction, caps) for i in range(workers)]
    # fork is cheap and the planner holds no threads yet; spawn where fork does not exist.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        results = list(pool.map(_worker, jobs))
    return min(results, key=lambda r: (r.makespan, r.peak))
