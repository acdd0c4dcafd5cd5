"""ReaLHF's Algorithm 1: the time of an execution plan's augmented dataflow graph.

Nodes become ready when all parents have ended (plus the edge's transfer delay); the ready node
with the earliest ready time runs next (ties: the lower index, i.e. topological order), starting
when it is ready and every GPU of its mesh is free, so calls on overlapping meshes serialize
and calls on disjoint meshes overlap. A node with ``prefetch_s`` (a host-offloaded model) loads
its weights over PCIe while the previous call on its GPUs runs, so it starts no earlier than
that call's start plus the load time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class TNode:
    name: str
    duration: float
    ranks: frozenset[int]
    parents: list[tuple[int, float]] = field(default_factory=list)   # (index, delay)
    prefetch_s: float = 0.0
    iteration: int = 0
    kind: str = "call"          # "call" | "realloc"
    call: str = ""              # the model function call (a reallocation: the one it feeds)
    model: str = ""             # the model it runs or moves


@dataclass
class Timeline:
    start: list[float]
    end: list[float]
    nodes: list[TNode]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def iteration_end(self, t: int) -> float:
        return max((e for e, n in zip(self.end, self.nodes) if n.iteration == t), default=0.0)

    def iteration_time(self) -> float:
        """Steady-state time of one iteration: the last iteration's end minus the one before
        (the first iteration has nothing to overlap with); the makespan for one iteration."""
        its = max((n.iteration for n in self.nodes), default=0)
        if its == 0:
            return self.makespan
        return self.iteration_end(its) - self.iteration_end(its - 1)


def simulate(nodes: list[TNode]) -> Timeline:
    n = len(nodes)
    children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    waiting = [len(x.parents) for x in nodes]
    for i, x in enumerate(nodes):
        for p, d in x.parents:
            children[p].append((i, d))
    ready = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    free: dict[int, float] = {}
    last_start: dict[int, float] = {}    # start of the latest call on each GPU
    heap = [(0.0, i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(heap)
    done = 0
    while heap:
        r, i = heapq.heappop(heap)
        x = nodes[i]
        s = max([r] + [free.get(g, 0.0) for g in x.ranks])
        if x.prefetch_s > 0:
            prev = max((last_start[g] for g in x.ranks if g in last_start), default=r)
            s = max(s, prev + x.prefetch_s)
        start[i], end[i] = s, s + x.duration
        for g in x.ranks:
            free[g] = end[i]
            last_start[g] = s
        done += 1
        for c, d in children[i]:
            ready[c] = max(ready[c], end[i] + d)
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(heap, (ready[c], c))
    if done != n:
        raise ValueError("the graph has a cycle; nodes never became ready")
    return Timeline(start, end, nodes)
