"""The RLHFuse paper's greedy list scheduler, the annealer's starting point.

Each step looks at one candidate per (group, resident model copy stage, op): the next forward
in micro-batch order, and the next backward whose chain predecessor is done. It computes each
candidate's earliest start, drops a smaller model's candidate that would end after the earliest
start of a larger model's candidate on the same group (so small tasks never delay the larger
model's critical path), and places the candidate with the smallest start (backward before
forward on ties, then enumeration order: group, model, copy, stage, F before B).
"""

from __future__ import annotations

from .problem import Problem, Task


def greedy(problem: Problem) -> list[list[Task]]:
    models = problem.models
    n = problem.stage_groups
    # Per (model, copy, stage): next forward / backward micro-batch and end-time tables.
    next_f: dict[tuple[int, int, int], int] = {}
    next_b: dict[tuple[int, int, int], int] = {}
    end_f: dict[tuple[int, int, int], list[float]] = {}
    end_b: dict[tuple[int, int, int], list[float]] = {}
    residents = [problem.residents(g) for g in range(n)]
    for g in range(n):
        for key in residents[g]:
            next_f[key] = next_b[key] = 0
            mbs = models[key[0]].micro_batches
            end_f[key] = [-1.0] * mbs
            end_b[key] = [-1.0] * mbs
    larger = [[problem.larger_than(a, b) for b in range(len(models))] for a in range(len(models))]
    free = [0.0] * n
    order: list[list[Task]] = [[] for _ in range(n)]
    remaining = problem.num_tasks()

    while remaining:
        best = None  # (start, is_forward, enumeration index, group, key, op, mb, end)
        idx = 0
        for g in range(n):
            cands = []
            for key in residents[g]:
                mi, c, s = key
                m = models[mi]
                # Forward candidate: next micro-batch in order, once the previous stage sent it.
                mb = next_f[key]
                if mb < m.micro_batches:
                    ready = 0.0 if s == 0 else end_f[(mi, c, s - 1)][mb]
                    if ready >= 0:
                        start = max(free[g], ready)
                        cands.append((start, start + m.forward[s], 1, idx, key, "F", mb))
                idx += 1
                mb = next_b[key]
                if mb < m.micro_batches:
                    if s == m.pipeline_stages - 1:
                        ready = end_f[key][mb]
                    else:
                        ready = end_b[(mi, c, s + 1)][mb]
                    if ready >= 0:
                        start = max(free[g], ready)
                        cands.append((start, start + m.backward[s], 0, idx, key, "B", mb))
                idx += 1
            for cand in cands:
                mi = cand[4][0]
                dropped = any(
                    larger[other[4][0]][mi] and cand[1] > other[0] for other in cands
                )
                if dropped:
                    continue
                rank = (cand[0], cand[2], cand[3])
                if best is None or rank < best[0]:
                    best = (rank, g, cand)
        assert best is not None, "greedy found no ready task; the problem is malformed"
        _, g, (start, end, _, _, key, op, mb) = best
        mi, c, s = key
        if op == "F":
            end_f[key][mb] = end
            next_f[key] += 1
        else:
            end_b[key][mb] = end
            next_b[key] += 1
        free[g] = end
        order[g].append(Task(mi, c, op, s, mb))
        remaining -= 1
    return order
