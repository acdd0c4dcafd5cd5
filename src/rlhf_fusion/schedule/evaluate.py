"""Evaluate a schedule: simulate it, measure makespan and peak activation memory, validate it.

A schedule is an ``order``: for each stage group, the tasks it runs, in execution order. A task
starts when its group is free and the previous task of its micro-batch chain (F stage 0..S-1,
then B stage S-1..0) has ended. A forward holds its activation until the matching backward
ends; a group runs one task at a time, so its memory level only moves at its own task
boundaries and its peak is the largest prefix sum of +activation (F) / -activation (B).

Solvers call the integer-coded :class:`CompiledProblem` in their inner loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .problem import Problem, ProblemError, Task

Order = Sequence[Sequence[Task]]
IdOrder = list[list[int]]

_EPS = 1e-9


class ScheduleError(ProblemError):
    """A schedule that is not valid for its problem; the message names the offending task."""


class DeadlockError(ScheduleError):
    pass


class CapacityError(ScheduleError):
    pass


def describe(problem: Problem, task: Task) -> str:
    m = problem.models[task.model]
    return f"{m.name} copy {task.copy} {task.op} stage {task.stage} micro-batch {task.micro_batch}"


class CompiledProblem:
    """The problem's tasks as integers with flat arrays, for fast repeated simulation."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.tasks: list[Task] = problem.tasks()
        self.index: dict[Task, int] = {t: i for i, t in enumerate(self.tasks)}
        n = len(self.tasks)
        self.duration = [0.0] * n
        self.pred = [-1] * n
        self.succ = [-1] * n
        self.group = [0] * n
        self.mem = [0.0] * n  # +activation for F, -activation for B
        for i, t in enumerate(self.tasks):
            m = problem.models[t.model]
            self.duration[i] = m.duration(t.op, t.stage)
            self.group[i] = m.group_of(t.copy, t.stage)
            a = m.activation[t.stage]
            self.mem[i] = a if t.op == "F" else -a
            p = problem.predecessor(t)
            if p is not None:
                j = self.index[p]
                self.pred[i] = j
                self.succ[j] = i
        self.num_groups = problem.stage_groups

    def ids(self, order: Order) -> IdOrder:
        try:
            return [[self.index[t] for t in tasks] for tasks in order]
        except KeyError as exc:
            t = exc.args[0]
            raise ScheduleError(f"order holds a task outside the problem: {t}") from None

    def tasks_of(self, order: IdOrder) -> list[list[Task]]:
        return [[self.tasks[i] for i in g] for g in order]

    def simulate(self, order: IdOrder) -> tuple[float, list[float]] | None:
        """Makespan and per-task end times, or None on deadlock.

        Event-driven: a group runs down its list until its next task waits on an unfinished
        predecessor, then parks on that predecessor and resumes when it completes.
        """
        n_groups = len(order)
        end = [-1.0] * len(self.tasks)
        free = [0.0] * n_groups
        ptr = [0] * n_groups
        waiting: dict[int, int] = {}
        dur, pred = self.duration, self.pred
        stack = list(range(n_groups))
        while stack:
            g = stack.pop()
            tasks = order[g]
            k, f = ptr[g], free[g]
            while k < len(tasks):
                t = tasks[k]
                p = pred[t]
                if p >= 0:
                    e = end[p]
                    if e < 0:
                        waiting[p] = g
                        break
                    if e > f:
                        f = e
                f += dur[t]
                end[t] = f
                k += 1
                w = waiting.pop(t, None)
                if w is not None:
                    stack.append(w)
            ptr[g], free[g] = k, f
        for g in range(n_groups):
            if ptr[g] < len(order[g]):
                return None
        return (max(free) if free else 0.0), end

    def makespan(self, order: IdOrder) -> float | None:
        res = self.simulate(order)
        return None if res is None else res[0]

    def group_peaks(self, order: IdOrder) -> list[float]:
        mem = self.mem
        peaks = []
        for tasks in order:
            level = peak = 0.0
            for t in tasks:
                level += mem[t]
                if level > peak:
                    peak = level
            peaks.append(peak)
        return peaks

    def peak(self, order: IdOrder) -> float:
        return max(self.group_peaks(order), default=0.0)

    def fits(self, order: IdOrder, caps: Sequence[float] | None) -> bool:
        """Whether every group's peak stays within its capacity (always, without one)."""
        return caps is None or all(p <= c + _EPS for p, c in zip(self.group_peaks(order), caps))


@dataclass
class Evaluation:
    makespan: float
    peak_activation: float
    group_peaks: list[float]
    start: dict[Task, float]
    end: dict[Task, float]


def validate(problem: Problem, order: Order, compiled: CompiledProblem | None = None) -> Evaluation:
    """Check coverage, placement, data dependencies, deadlock and memory capacity.

    Returns the evaluation; raises :class:`ScheduleError` naming the first offending task.
    """
    cp = compiled or CompiledProblem(problem)
    if len(order) != problem.stage_groups:
        raise ScheduleError(f"order has {len(order)} groups; the problem has {problem.stage_groups}")
    seen: dict[Task, int] = {}
    for g, tasks in enumerate(order):
        for t in tasks:
            if t not in cp.index:
                raise ScheduleError(f"group {g}: task {t} is not part of the problem")
            if t in seen:
                raise ScheduleError(
                    f"{describe(problem, t)} is scheduled twice (groups {seen[t]} and {g})"
                )
            seen[t] = g
            home = problem.group_of(t)
            if home != g:
                raise ScheduleError(f"{describe(problem, t)} is on group {g} but must run on group {home}")
    if len(seen) != len(cp.tasks):
        missing = next(t for t in cp.tasks if t not in seen)
        raise ScheduleError(
            f"{len(cp.tasks) - len(seen)} tasks are missing, for example {describe(problem, missing)}"
        )
    ids = cp.ids(order)
    # A backward placed before its own forward on the same group can never run.
    for g, tasks in enumerate(order):
        pos = {t: k for k, t in enumerate(tasks)}
        for t in tasks:
            p = problem.predecessor(t)
            if p is not None and p in pos and pos[p] > pos[t]:
                raise ScheduleError(
                    f"group {g}: {describe(problem, t)} is ordered before the task it depends on, "
                    f"{describe(problem, p)}"
                )
    res = cp.simulate(ids)
    if res is None:
        raise DeadlockError(_deadlock_message(problem, cp, ids))
    makespan, end_list = res
    peaks = cp.group_peaks(ids)
    if problem.memory_capacity is not None:
        for g, tasks in enumerate(ids):
            cap = problem.memory_capacity[g]
            level = 0.0
            for t in tasks:
                level += cp.mem[t]
                if level > cap + _EPS:
                    raise CapacityError(
                        f"group {g}: activation memory reaches {level:g} > capacity {cap:g} at "
                        f"{describe(problem, cp.tasks[t])}"
                    )
    end = {cp.tasks[i]: e for i, e in enumerate(end_list)}
    start = {t: e - problem.duration(t) for t, e in end.items()}
    return Evaluation(makespan, max(peaks, default=0.0), peaks, start, end)


def _deadlock_message(problem: Problem, cp: CompiledProblem, order: IdOrder) -> str:
    # Replay to find where each group is stuck, then name one waiting task and its blocker.
    done = [False] * len(cp.tasks)
    ptr = [0] * len(order)
    progress = True
    while progress:
        progress = False
        for g, tasks in enumerate(order):
            while ptr[g] < len(tasks):
                t = tasks[ptr[g]]
                p = cp.pred[t]
                if p >= 0 and not done[p]:
                    break
                done[t] = True
                ptr[g] += 1
                progress = True
    stuck = [(g, order[g][ptr[g]]) for g in range(len(order)) if ptr[g] < len(order[g])]
    g, t = stuck[0]
    blocker = cp.tasks[cp.pred[t]]
    return (
        f"deadlock: group {g} waits at {describe(problem, cp.tasks[t])}, which needs "
        f"{describe(problem, blocker)} on group {problem.group_of(blocker)}, itself blocked "
        f"({len(stuck)} groups stuck)"
    )
