"""Execution-plan search (ReaLHF §5): candidates per call, a greedy start, Metropolis-Hastings,
and exhaustive enumeration for clusters small enough.

Candidates of a call are every legal (mesh, strategy) on which the call fits alone (its model's
static memory plus its own dynamic memory, ReaLHF's filter; for a trainable model's generation
or inference call only the reallocated copy, which is all it holds there) and whose batch shape
works. The
search state assigns one candidate to each of the problem's calls (six for PPO, fewer without a
Critic or a reward model); its cost is the estimator's
(iteration time, times the OOM penalty when a GPU overflows).

* Greedy start: the best of the presets (co-located heuristic included), then coordinate
  descent: each call in turn takes its best candidate with the others fixed, until a pass
  changes nothing (or its share of the time runs out).
* Metropolis-Hastings: a move changes one call, uniformly chosen: to a uniformly drawn
  candidate, to another strategy on the same mesh, or to another call's layout (which creates
  or removes reallocations and fused rollouts). A worse plan is accepted with probability
  exp(-(c' - c) / (temperature * c_best)). Seeded: the same seed and ``max_steps`` give the same
  walk; the time limit only decides where it stops.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import PlacementError
from .estimate import Estimate, Estimator
from .graph import CALL_KIND, CALL_MODEL
from .mesh import enumerate_meshes
from .plan import CallPlacement, ExecutionPlan
from .presets import PRESET_NAMES, colocated_heuristic, frozen_offload, preset_plan
from .problem import PlacementProblem
from .strategy import strategies_for

Progress = Callable[[float, float, int], None]   # (fraction of time, best cost, steps)


def candidates(problem: PlacementProblem, estimator: Estimator) -> dict[str, list[CallPlacement]]:
    cost = estimator.cost
    meshes = enumerate_meshes(problem.cluster, problem.mesh_min_gpus)
    out: dict[str, list[CallPlacement]] = {}
    for call in problem.calls:
        model = CALL_MODEL[call]
        trainable = model in ("actor", "critic")
        offloaded = problem.offload_frozen and not trainable
        lst = []
        for mesh in meshes:
            cap = cost.capacity(mesh.group)
            for s in strategies_for(mesh, problem.models[model], max_tp=problem.max_tp,
                                    max_pp=problem.max_pp,
                                    zero3=problem.parallelism != "megatron"):
                if not cost.feasible(call, mesh, s):
                    continue
                # Alone, a trainable model's generation or inference call holds only the
                # reallocated copy (its training state lives with the training call), and an
                # offloaded model only its prefetched copy.
                copy = offloaded or (trainable and CALL_KIND[call] != "train")
                static = 0.0 if copy else cost.static_bytes(model, s, trainable)
                if static + cost.dynamic_bytes(call, mesh, s, copy) > cap:
                    continue
                lst.append(CallPlacement(mesh, s))
        if not lst:
            raise PlacementError(f"{call}: no mesh and strategy of this cluster fits "
                                 f"{model} ({problem.models[model].params / 1e9:g}B params); "
                                 "add GPUs, use larger-memory hardware or lower batch/lengths")
        out[call] = lst
    return out


@dataclass
class SearchResult:
    plan: ExecutionPlan
    estimate: Estimate
    heuristic: ExecutionPlan
    heuristic_estimate: Estimate
    presets: dict[str, Estimate] = field(default_factory=dict)
    steps: int = 0
    accepted: int = 0
    evaluations: int = 0
    seconds: float = 0.0
    greedy_cost: float = math.inf
    history: list[tuple[float, float]] = field(default_factory=list)   # (seconds, best cost)
    space: dict[str, int] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """Estimated time saved over the co-located heuristic, as a fraction of its time."""
        return 1 - self.estimate.cost / self.heuristic_estimate.cost

    @property
    def speedup(self) -> float:
        return self.heuristic_estimate.cost / self.estimate.cost


class _Cache:
    def __init__(self, est: Estimator, limit: int = 200_000):
        self.est, self.d, self.limit = est, {}, limit

    def __call__(self, plan: ExecutionPlan) -> float:
        k = plan.key()
        c = self.d.get(k)
        if c is None:
            c = self.est.estimate(plan, keep_timeline=False).cost
            if len(self.d) < self.limit:
                self.d[k] = c
        return c


def _presets(problem: PlacementProblem, est: Estimator) -> dict[str, ExecutionPlan]:
    out = {}
    for name in PRESET_NAMES:
        try:
            out[name] = preset_plan(problem, name, estimator=est)
        except PlacementError:
            continue   # a preset this cluster cannot express (e.g. halves of a 1-GPU node)
    return out


def search(problem: PlacementProblem, *, time_limit: float = 60.0, seed: int = 0,
           max_steps: int | None = None, temperature: float = 0.05,
           estimator: Estimator | None = None, progress: Progress | None = None,
           greedy_share: float = 0.3) -> SearchResult:
    """Greedy start, then Metropolis-Hastings until ``time_limit`` seconds or ``max_steps``."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    est = estimator or Estimator(problem)
    cost = _Cache(est)
    cands = candidates(problem, est)
    calls_of = problem.calls
    offload = frozen_offload(problem)
    heuristic = colocated_heuristic(problem, estimator=est)
    presets = _presets(problem, est)
    preset_est = {n: est.estimate(p, keep_timeline=False) for n, p in presets.items()}
    start = min(presets.values(), key=cost)
    history: list[tuple[float, float]] = []

    # The search walks over candidates only, so the start is snapped to them: each call keeps
    # the preset's choice when it is a candidate, else the nearest one (same mesh first).
    calls = {}
    for c in calls_of:
        pl = start.calls[c]
        calls[c] = pl if pl in cands[c] else min(
            cands[c], key=lambda x: (x.mesh.ranks != pl.mesh.ranks, x.strategy != pl.strategy,
                                     -x.mesh.size))
    cur = ExecutionPlan(calls, "searched", offload)
    cur_c = cost(cur)
    # Greedy coordinate descent.
    greedy_deadline = t0 + greedy_share * time_limit
    improved = True
    while improved and time.perf_counter() < greedy_deadline:
        improved = False
        for c in calls_of:
            for cand in cands[c]:
                if time.perf_counter() >= greedy_deadline:
                    break
                nxt = cur.replace(c, cand)
                nc = cost(nxt)
                if nc < cur_c * (1 - 1e-12):
                    cur, cur_c, improved = nxt, nc, True
    greedy_cost = cur_c
    best, best_c = cur, cur_c
    history.append((time.perf_counter() - t0, best_c))
    rng = random.Random(seed)
    steps = accepted = 0
    last_report = -1.0
    while True:
        if max_steps is not None and steps >= max_steps:
            break
        if steps % 64 == 0:
            now = time.perf_counter()
            if now >= deadline:
                break
            if progress is not None and now - last_report >= 0.25:
                last_report = now
                progress(min(1.0, (now - t0) / time_limit), best_c, steps)
        steps += 1
        c = calls_of[rng.randrange(len(calls_of))]
        move = rng.random()
        pl = cur.calls[c]
        if move < 0.5:
            cand = cands[c][rng.randrange(len(cands[c]))]
        elif move < 0.75:
            same = [x for x in cands[c] if x.mesh.ranks == pl.mesh.ranks]
            cand = same[rng.randrange(len(same))] if same else pl
        else:
            other = cur.calls[calls_of[rng.randrange(len(calls_of))]]
            cand = other if other in cands[c] else pl
        if cand == pl:
            continue
        nxt = cur.replace(c, cand)
        nc = cost(nxt)
        delta = (nc - cur_c) / (temperature * best_c)
        if delta <= 0 or rng.random() < math.exp(-delta):
            cur, cur_c = nxt, nc
            accepted += 1
            if nc < best_c * (1 - 1e-12):
                best, best_c = nxt, nc
                history.append((time.perf_counter() - t0, best_c))
    if progress is not None:
        progress(1.0, best_c, steps)
    best = ExecutionPlan(dict(best.calls), "searched", offload)
    h_est = est.estimate(heuristic)
    b_est = est.estimate(best)
    if h_est.cost < b_est.cost:   # never report a plan worse than the baseline it is shown beside
        best, b_est = ExecutionPlan(dict(heuristic.calls), "searched", offload), est.estimate(heuristic)
    return SearchResult(best, b_est, heuristic, h_est, preset_est, steps, accepted,
                        est.evaluations, time.perf_counter() - t0, greedy_cost, history,
                        {c: len(v) for c, v in cands.items()})


def count_plans(problem: PlacementProblem, estimator: Estimator | None = None) -> int:
    cands = candidates(problem, estimator or Estimator(problem))
    return math.prod(len(v) for v in cands.values())


def enumerate_best(problem: PlacementProblem, *, estimator: Estimator | None = None,
                   limit: int = 200_000) -> tuple[ExecutionPlan, Estimate, int]:
    """The optimum over every plan (and how many there were); for small clusters."""
    est = estimator or Estimator(problem)
    cands = candidates(problem, est)
    n = math.prod(len(v) for v in cands.values())
    if n > limit:
        raise PlacementError(f"{n} plans are too many to enumerate (limit {limit}); use "
                             "search() or raise min_mesh_gpus")
    offload = frozen_offload(problem)
    best, best_c = None, math.inf
    for combo in itertools.product(*(cands[c] for c in problem.calls)):
        plan = ExecutionPlan(dict(zip(problem.calls, combo)), "enumerated", offload)
        c = est.estimate(plan, keep_timeline=False).cost
        if c < best_c:
            best, best_c = plan, c
    assert best is not None
    return best, est.estimate(best), n
