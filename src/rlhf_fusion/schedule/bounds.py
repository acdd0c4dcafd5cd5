"""A lower bound on the makespan of any valid fused schedule.

The largest of three arguments:
- each model copy alone: a stage cannot start before its first forward arrives, must do all its
  micro-batches' work, and its last backward still has the earlier stages' backwards to run;
- all work spread perfectly over the N groups;
- each group: the earliest arrival of any resident's forward, plus all work on the group, plus
  the shortest backward tail among its residents.
"""

from __future__ import annotations

from .problem import Problem


def lower_bound(problem: Problem) -> float:
    best = 0.0
    total = 0.0
    for m in problem.models:
        mbs = m.micro_batches
        for s in range(m.pipeline_stages):
            work = mbs * (m.forward[s] + m.backward[s])
            best = max(best, m.arrival(s) + work + m.tail(s))
            total += m.copies * work
        best = max(best, m.work_per_micro_batch())
    best = max(best, total / problem.stage_groups)
    for g in range(problem.stage_groups):
        arrival = tail = float("inf")
        work = 0.0
        for mi, _c, s in problem.residents(g):
            m = problem.models[mi]
            arrival = min(arrival, m.arrival(s))
            tail = min(tail, m.tail(s))
            work += m.micro_batches * (m.forward[s] + m.backward[s])
        best = max(best, arrival + work + tail)
    return best
