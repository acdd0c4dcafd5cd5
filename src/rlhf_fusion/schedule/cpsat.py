"""Exact search with OR-Tools CP-SAT: interval variables, no-overlap per stage group.

Micro-batches of one model copy are interchangeable, so the forwards (and the backwards) of
one stage can run in micro-batch order without loss of optimality: any schedule relabels that
way with the same times and the same memory. Those precedences prune the search hugely.

Memory has two encodings:
- ``inflight`` (used by the memory pass): per group and resident model an integer ``k``, the
  most micro-batches it may hold at once, enforced as precedences (forward ``i + k`` starts
  after backward ``i`` ends). ``sum(activation * k)`` bounds the group's true peak from above,
  and precedences propagate far better than a cumulative over variable-length intervals.
- ``cumulative`` (exact, used for hard capacities): one interval per activation, from its
  forward's start to its backward's end, under a cumulative of the capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .evaluate import CompiledProblem, IdOrder

_SCALES = (1, 2, 4, 5, 10, 20, 25, 50, 100, 1000, 10_000)


def integer_scale(values: Sequence[float]) -> int:
    """Smallest factor (up to 10^4) that makes every value integral."""
    for scale in _SCALES:
        if all(abs(v * scale - round(v * scale)) < 1e-9 * max(1.0, abs(v * scale)) for v in values):
            return scale
    # Rounded times: the result is re-simulated with the true times, so only quality suffers.
    return _SCALES[-1]


@dataclass
class CpSatResult:
    order: IdOrder | None
    objective: float | None  # makespan or peak bound, in problem units
    proven_optimal: bool
    infeasible: bool
    status: str
    seconds: float


def order_from_starts(cp: CompiledProblem, starts: Sequence[float]) -> IdOrder:
    order: IdOrder = [[] for _ in range(cp.num_groups)]
    for t in sorted(range(len(starts)), key=lambda i: (starts[i], i)):
        order[cp.group[t]].append(t)
    return order


def lanes_of(cp: CompiledProblem) -> dict[tuple, list[int]]:
    """Tasks of each (model, copy, op, stage), in micro-batch order."""
    lanes: dict[tuple, list[int]] = {}
    for t, task in enumerate(cp.tasks):
        lanes.setdefault((task.model, task.copy, task.op, task.stage), []).append(t)
    for lane in lanes.values():
        lane.sort(key=lambda t: cp.tasks[t].micro_batch)
    return lanes


Stage = tuple[int, int, int]  # (model, copy, stage)


def stages_by_group(cp: CompiledProblem) -> tuple[list[list[Stage]], dict[Stage, float], dict[Stage, int]]:
    """Per group the model stages it hosts, and each stage's activation and micro-batch count."""
    groups: list[list[Stage]] = [[] for _ in range(cp.num_groups)]
    act: dict[Stage, float] = {}
    mbs: dict[Stage, int] = {}
    for (model, copy, op, stage), tasks in lanes_of(cp).items():
        if op == "F":
            lane = (model, copy, stage)
            groups[cp.group[tasks[0]]].append(lane)
            act[lane] = cp.mem[tasks[0]]
            mbs[lane] = len(tasks)
    return groups, act, mbs


def inflight_counts(cp: CompiledProblem, order: IdOrder) -> dict[tuple, int]:
    """Largest number of micro-batches each (model, copy, stage) holds at once under ``order``."""
    out: dict[tuple, int] = {}
    for tasks in order:
        level: dict[tuple, int] = {}
        for t in tasks:
            task = cp.tasks[t]
            key = (task.model, task.copy, task.stage)
            level[key] = level.get(key, 0) + (1 if task.op == "F" else -1)
            out[key] = max(out.get(key, 0), level[key])
    return out


def solve_cpsat(
    cp: CompiledProblem,
    *,
    time_limit: float,
    minimize: str = "makespan",
    lower_bound: float | None = None,
    makespan_cap: float | None = None,
    memory_cap: Sequence[float] | None = None,
    inflight: dict[tuple[int, int, int], int] | None = None,
    hint_order: IdOrder | None = None,
    workers: int = 1,
    seed: int = 0,
    on_solution: Callable[[float], None] | None = None,
    extra: Callable[..., None] | None = None,
    params: Mapping[str, Any] | None = None,
) -> CpSatResult:
    """One CP-SAT pass.

    ``minimize="makespan"``: minimise the makespan, within ``makespan_cap`` if given (a cap at
    the lower bound turns it into a fast feasibility check), respecting ``memory_cap`` (per
    group, exact cumulative encoding) if given.
    ``extra(model, start, end, lanes)`` may add constraints (``staircase.py`` adds its
    precedences) before the model is solved. ``params`` overrides CP-SAT parameters by name.
    ``minimize="peak"``: minimise the in-flight memory bound with the makespan held at
    ``makespan_cap``; ``memory_cap`` bounds each group's in-flight bound.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    scale = integer_scale(cp.duration)
    dur = [round(d * scale) for d in cp.duration]
    mem_scale = integer_scale([abs(m) for m in cp.mem])
    act = [round(abs(m) * mem_scale) for m in cp.mem]
    horizon = sum(dur)
    if makespan_cap is not None:
        horizon = min(horizon, math.floor(makespan_cap * scale + 1e-6))
    n = len(cp.tasks)

    model = cp_model.CpModel()
    start = [model.NewIntVar(0, max(0, horizon - dur[t]), f"s{t}") for t in range(n)]
    end = [start[t] + dur[t] for t in range(n)]
    intervals = [model.NewFixedSizeIntervalVar(start[t], dur[t], f"i{t}") for t in range(n)]
    makespan = model.NewIntVar(0, horizon, "makespan")
    if lower_bound is not None:
        model.Add(makespan >= min(horizon, math.ceil(lower_bound * scale - 1e-6)))
    for t in range(n):
        if cp.pred[t] >= 0:
            model.Add(start[t] >= end[cp.pred[t]])
        if cp.succ[t] < 0:
            model.Add(makespan >= end[t])
    lanes = lanes_of(cp)
    for lane in lanes.values():
        for a, b in zip(lane, lane[1:]):
            model.Add(start[b] >= end[a])
    # In-flight limits per (model, copy, stage): forward i+k waits for backward i to end.
    for (mi, c, s), k in (inflight or {}).items():
        fl, bl = lanes[(mi, c, "F", s)], lanes[(mi, c, "B", s)]
        for i in range(len(fl) - k):
            model.Add(start[fl[i + k]] >= end[bl[i]])
    if extra is not None:
        extra(model, start, end, lanes)
    groups: list[list[int]] = [[] for _ in range(cp.num_groups)]
    for t in range(n):
        groups[cp.group[t]].append(t)
    for g in groups:
        model.AddNoOverlap([intervals[t] for t in g])

    caps = None if memory_cap is None else [math.floor(c * mem_scale + 1e-6) for c in memory_cap]
    peak_var = None
    k_vars: dict[tuple, tuple] = {}
    if minimize == "peak":
        peak_var = model.NewIntVar(0, sum(a for t, a in enumerate(act) if cp.mem[t] > 0), "peak")
        per_group: list[list] = [[] for _ in range(cp.num_groups)]
        for (mi, c, op, s), fl in lanes.items():
            if op != "F":
                continue
            bl = lanes[(mi, c, "B", s)]
            mbs = len(fl)
            k = model.NewIntVar(1, mbs, f"k{mi}_{c}_{s}")
            # le[j] <=> k <= j; monotone, and each enforces "forward i+j waits for backward i".
            le = [model.NewBoolVar(f"le{mi}_{c}_{s}_{j}") for j in range(mbs)]
            for j in range(1, mbs - 1):
                model.AddImplication(le[j], le[j + 1])
            model.Add(k == mbs - sum(le[1:]))
            for j in range(1, mbs):
                for i in range(mbs - j):
                    model.Add(start[fl[i + j]] >= end[bl[i]]).OnlyEnforceIf(le[j])
            g = cp.group[fl[0]]
            per_group[g].append(act[fl[0]] * k)
            k_vars[(mi, c, s)] = (k, le)
        for g, terms in enumerate(per_group):
            if terms:
                model.Add(peak_var >= sum(terms))
                if caps is not None:
                    model.Add(sum(terms) <= caps[g])
        model.Minimize(peak_var)
    elif minimize == "cumulative_peak":
        # Exact peak: per group a cumulative whose capacity is a variable, the largest of them
        # minimised (plus their sum, so any group's reduction counts).
        total = sum(a for t, a in enumerate(act) if cp.mem[t] > 0)
        peak_var = model.NewIntVar(0, total, "peak")
        gcaps = []
        for gi, (ivs, dem) in enumerate(_residency(model, cp, groups, act, dur, start, end, horizon)):
            if ivs:
                ub = sum(dem) if caps is None else min(sum(dem), caps[gi])
                cg = model.NewIntVar(max(dem), ub, f"cap{gi}")
                model.AddCumulative(ivs, dem, cg)
                model.Add(peak_var >= cg)
                gcaps.append(cg)
        if caps is not None:
            _lane_inflight_limits(model, cp, lanes, caps, act, start, end)
        model.Minimize(peak_var * (len(gcaps) + 1) + sum(gcaps))
    else:
        if caps is not None:
            for gi, (ivs, dem) in enumerate(
                _residency(model, cp, groups, act, dur, start, end, horizon)
            ):
                if ivs:
                    model.AddCumulative(ivs, dem, caps[gi])
            _lane_inflight_limits(model, cp, lanes, caps, act, start, end)
        model.Minimize(makespan)

    if hint_order is not None:
        res = cp.simulate(hint_order)
        if res is not None:
            ends = res[1]
            for t in range(n):
                model.AddHint(start[t], round((ends[t] - cp.duration[t]) * scale))
            if k_vars:
                counts = inflight_counts(cp, hint_order)
                for key, (k, le) in k_vars.items():
                    model.AddHint(k, counts[key])
                    for j in range(1, len(le)):
                        model.AddHint(le[j], counts[key] <= j)

    solver = cp_model.CpSolver()
    # The caller's budget covers building the model too.
    solver.parameters.max_time_in_seconds = max(0.05, time_limit - (time.perf_counter() - t0))
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    for name, value in (params or {}).items():
        setattr(solver.parameters, name, value)
    # Not repair_hint: with OR-Tools 9.15 it aborts the whole process on some of these models
    # ("Check failed: heuristics.fixed_search != nullptr", google/or-tools#5025), although it
    # helps where it runs (docs/planner.md).
    unit = scale if minimize == "makespan" else mem_scale
    if minimize == "cumulative_peak":
        unit = mem_scale * (cp.num_groups + 1)

    class _Progress(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            if on_solution is not None:
                on_solution(self.ObjectiveValue() / unit)

    status = solver.Solve(model, _Progress())
    name = solver.StatusName(status)
    seconds = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpSatResult(None, None, False, status == cp_model.INFEASIBLE, name, seconds)
    starts = [solver.Value(s) for s in start]
    return CpSatResult(
        order_from_starts(cp, starts),
        solver.ObjectiveValue() / unit,
        status == cp_model.OPTIMAL,
        False,
        name,
        seconds,
    )


def _residency(model, cp, groups, act, dur, start, end, horizon) -> list[tuple[list, list]]:  # noqa: ANN001
    """Per group, the intervals during which forwards hold activations (forward start to the
    matching backward's end) and their sizes: the operands of a cumulative constraint."""
    bwd = {}
    for t, task in enumerate(cp.tasks):
        if task.op == "B":
            bwd[(task.model, task.copy, task.stage, task.micro_batch)] = t
    out = []
    for g in groups:
        ivs, dem = [], []
        for t in g:
            task = cp.tasks[t]
            if task.op == "F" and act[t] > 0:
                b = bwd[(task.model, task.copy, task.stage, task.micro_batch)]
                size = model.NewIntVar(dur[t], horizon, f"m{t}")
                ivs.append(model.NewIntervalVar(start[t], size, end[b], f"a{t}"))
                dem.append(act[t])
        out.append((ivs, dem))
    return out


def _lane_inflight_limits(model, cp, lanes, caps, act, start, end) -> None:  # noqa: ANN001
    # Implied by the cap whatever the other residents hold: a lane never has more than
    # floor(cap / activation) micro-batches in flight. As precedences these propagate much
    # better than the cumulative alone.
    for (mi, c, op, s), fl in lanes.items():
        if op != "F" or act[fl[0]] == 0:
            continue
        bl = lanes[(mi, c, "B", s)]
        k = max(1, caps[cp.group[fl[0]]] // act[fl[0]])
        for i in range(len(fl) - k):
            model.Add(start[fl[i + k]] >= end[bl[i]])


def solve_time_window(
    cp: CompiledProblem,
    order: IdOrder,
    t_lo: float,
    t_hi: float,
    *,
    makespan: float,
    time_limit: float,
    caps: Sequence[float] | None = None,
    workers: int = 1,
    seed: int = 0,
) -> IdOrder | None:
    """Re-time the tasks that start inside [t_lo, t_hi); every other task keeps its start.

    Minimises the sum of the groups' peaks (exact cumulative per group), so a reduction on any
    one group counts, and never lets a group's peak exceed the current global peak.
    """
    t0 = time.perf_counter()
    from ortools.sat.python import cp_model

    res = cp.simulate(order)
    if res is None:
        return None
    scale = integer_scale(cp.duration)
    dur = [round(d * scale) for d in cp.duration]
    mem_scale = integer_scale([abs(m) for m in cp.mem])
    act = [round(abs(m) * mem_scale) for m in cp.mem]
    horizon = math.floor(makespan * scale + 1e-6)
    cur = [round((res[1][t] - cp.duration[t]) * scale) for t in range(len(cp.tasks))]
    lo, hi = round(t_lo * scale), round(t_hi * scale)
    free = [lo <= cur[t] < hi for t in range(len(cp.tasks))]
    n = len(cp.tasks)
    model = cp_model.CpModel()
    start = [
        model.NewIntVar(0, max(0, horizon - dur[t]), f"s{t}") if free[t] else model.NewConstant(cur[t])
        for t in range(n)
    ]
    end = [start[t] + dur[t] for t in range(n)]
    for t in range(n):
        p = cp.pred[t]
        if p >= 0 and (free[t] or free[p]):
            model.Add(start[t] >= end[p])
    lanes = lanes_of(cp)
    for lane in lanes.values():
        for a, b in zip(lane, lane[1:]):
            if free[a] or free[b]:
                model.Add(start[b] >= end[a])
    top = math.floor(cp.peak(order) * mem_scale + 1e-6)
    groups: list[list[int]] = [[] for _ in range(cp.num_groups)]
    for t in range(n):
        groups[cp.group[t]].append(t)
    bwd = {}
    for t, task in enumerate(cp.tasks):
        if task.op == "B":
            bwd[(task.model, task.copy, task.stage, task.micro_batch)] = t
    peaks = []
    for g, tasks in enumerate(groups):
        # Fixed tasks stay in the no-overlap and the cumulative: they are constants after
        # presolve, and leaving them out lets free tasks slide over them.
        model.AddNoOverlap([model.NewFixedSizeIntervalVar(start[t], dur[t], f"i{t}") for t in tasks])
        ivs, dem = [], []
        for t in tasks:
            task = cp.tasks[t]
            if task.op != "F" or act[t] == 0:
                continue
            b = bwd[(task.model, task.copy, task.stage, task.micro_batch)]
            size = model.NewIntVar(dur[t], horizon, f"m{t}")
            ivs.append(model.NewIntervalVar(start[t], size, end[b], f"a{t}"))
            dem.append(act[t])
        pg = model.NewIntVar(0, top, f"p{g}")
        cap = top if caps is None else min(top, math.floor(caps[g] * mem_scale + 1e-6))
        model.Add(pg <= cap)
        if ivs:
            model.AddCumulative(ivs, dem, pg)
        peaks.append(pg)
    model.Minimize(sum(peaks))
    for t in range(n):
        if free[t]:
            model.AddHint(start[t], cur[t])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit - (time.perf_counter() - t0))
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return order_from_starts(cp, [solver.Value(s) for s in start])
