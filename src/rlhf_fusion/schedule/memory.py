"""The memory pass: lower peak activation memory without letting the makespan grow.

Moves, in this order:

1. In-flight budgets. For a target peak (a ratio of the serial 1F1B peak), every stage group
   splits that budget among the model stages it hosts as fixed in-flight limits (forward
   ``i + k`` of a stage waits for backward ``i``): each keeps its 1F1B count and the headroom
   goes first to the lighter model, whose extra forwards are what fill the heavier model's
   bubbles. Fixed limits are plain precedences, so CP-SAT decides "the held makespan within
   these limits" in seconds where an exact memory capacity at the same makespan stays
   undecided for minutes. Staircase limits (``staircase.py``) come first: they let the
   lighter model hold more early and step down later, which fixed limits cannot express.
   The target is bisected between the serial peak and the best peak so far; each split that
   works sets a new best.
2. Capacity rungs. Concatenated 1F1B holds exactly the serial 1F1B peak on every group, so it
   is a valid start under any capacity at or above that peak. For rungs of capacity from the
   serial peak upwards, CP-SAT minimises the makespan under the exact (cumulative) capacity
   starting from the best schedule that fits; the first rung that gets back to the held
   makespan wins. Only rungs below the best peak so far are tried.
3. Exact peak minimisation: CP-SAT minimises the exact peak (a cumulative per group whose
   capacity is a variable) with the makespan held, from the best order so far.
4. Time-window neighbourhoods. Tasks starting inside a window around the current peak are
   re-timed with everything else fixed, minimising the sum of the groups' peaks. It polishes
   whatever schedule the steps before leave.

Every time share, attempt length and step comes from ``policy.SearchPolicy``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .cpsat import CpSatResult, inflight_counts, solve_cpsat, solve_time_window, stages_by_group
from .cpsat import Stage as Lane
from .evaluate import CompiledProblem, IdOrder
from .policy import DEFAULT_POLICY, RELEASE, SearchPolicy
from .staircase import Build, staircase_constraints

_EPS = 1e-9

def budget_limits(
    cp: CompiledProblem,
    base: dict[Lane, int],
    caps: Sequence[float],
    rank: Sequence[int] | None,
) -> dict[Lane, int]:
    """Per-stage in-flight limits whose worst case fits ``caps`` on every group where the
    1F1B counts ``base`` leave room.

    ``rank[model]`` orders the models for the headroom (lowest first; the last gives up
    micro-batches first when a group is over); ``None`` splits it evenly by memory.
    """
    groups, act, mbs = stages_by_group(cp)
    k = dict(base)
    for g, lanes in enumerate(groups):
        live = [lane for lane in lanes if act[lane] > 0]
        if not live:
            continue
        room = caps[g] - sum(act[lane] * k[lane] for lane in live)
        if rank is None:
            share = room / len(live)
            for lane in live:
                d = math.floor(share / act[lane] + _EPS)
                d = max(1 - k[lane], min(mbs[lane] - k[lane], d))
                k[lane] += d
                room -= d * act[lane]
            pref = sorted(live, key=lambda lane: act[lane])
        else:
            pref = sorted(live, key=lambda lane: (rank[lane[0]], act[lane]))
        # Hand out what is left (or take back what is over) one micro-batch at a time.
        for lane in pref:
            while room >= act[lane] - _EPS and k[lane] < mbs[lane]:
                k[lane] += 1
                room -= act[lane]
        for lane in reversed(pref):
            while room < -_EPS and k[lane] > 1:
                k[lane] -= 1
                room += act[lane]
    return k


def _budget_ranks(cp: CompiledProblem) -> list[list[int] | None]:
    """Headroom orders to try: lighter model first, then an even split. (Heavier-first was
    proven infeasible or left undecided on every Table 3 setting, so it is not tried.)"""
    work: dict[int, float] = {}
    for t, task in enumerate(cp.tasks):
        if task.op == "F" and task.copy == 0:
            work[task.model] = work.get(task.model, 0.0) + cp.duration[t]
    rank = [0] * len(work)
    for r, m in enumerate(sorted(work, key=lambda m: (work[m], m))):
        rank[m] = r
    return [rank, None]


def _burster(cp: CompiledProblem) -> int:
    """The model that bursts in a staircase: the lighter one (it gets the headroom first)."""
    return _budget_ranks(cp)[0].index(0)


def _bound_targets(cp: CompiledProblem, target: float, caps: Sequence[float] | None) -> list[float]:
    user = list(caps) if caps is not None else [float("inf")] * cp.num_groups
    return [min(target, u) for u in user]


def bound_budget_limits(
    cp: CompiledProblem, concat: IdOrder, target: float, caps: Sequence[float] | None
) -> dict[Lane, int]:
    """In-flight limits for a peak of ``target`` (within ``caps``) from concatenated 1F1B's
    counts, headroom to the lighter model first."""
    return budget_limits(
        cp, inflight_counts(cp, concat), _bound_targets(cp, target, caps), _budget_ranks(cp)[0]
    )


def bound_staircase(
    cp: CompiledProblem, concat: IdOrder, target: float, caps: Sequence[float] | None
) -> tuple[dict[Lane, int], Build] | None:
    """Release-staircase limits and constraints for a peak of ``target`` (within ``caps``):
    what the at-bound search tries first (``None`` where the staircase does not apply)."""
    return staircase_constraints(
        cp, inflight_counts(cp, concat), _bound_targets(cp, target, caps), _burster(cp),
        release=True,
    )


def budget_attempt_seconds(cp: CompiledProblem, policy: SearchPolicy = DEFAULT_POLICY) -> float:
    """One fixed-limit attempt: deciding takes longer on bigger problems (model building
    included)."""
    return policy.budget_attempt(len(cp.tasks))


def stair_attempt_seconds(cp: CompiledProblem, policy: SearchPolicy = DEFAULT_POLICY) -> float:
    """One staircase attempt (several times a fixed-limit one, capped)."""
    return policy.stair_attempt(len(cp.tasks))


@dataclass
class _BudgetSearch:
    """Step 1 of the pass: bisect a target peak between the serial peak and the best so far,
    each target turned into in-flight limits that CP-SAT must meet at the held makespan.

    Targets are ratios to the serial peak. ``lo`` is the highest target that failed (none yet:
    just below 1). At each target the kinds are tried in turn from ``first``: the staircase
    variants of ``policy.stair_kinds``, then fixed limits with the headroom to the lighter model,
    then an even split. A kind proven infeasible makes way for the next; an undecided one ends
    the target (retried once, see :meth:`next_target`). With a ``floor`` below the makespan an
    attempt keeps shortening the makespan after its first schedule, and a shorter makespan wins
    over a lower peak.
    """

    cp: CompiledProblem
    best: IdOrder
    makespan: float
    floor: float
    deadline: float
    base: dict[Lane, int]
    serial_peak: float
    user_caps: Sequence[float]
    workers: int
    seed: int
    log: list[dict[str, Any]]
    policy: SearchPolicy
    kinds: list[Any] = field(init=False)
    burster: int = field(init=False)
    per_attempt: float = field(init=False)
    lo: float = field(init=False)
    first: int = 0  # index into ``kinds`` of the kind tried first at the next target
    attempt: int = 0  # CP-SAT runs so far (each gets its own seed)
    probe: int = 0  # targets since the last (re)start
    undecided: bool = False  # did a target fail without a proof since the last (re)start?
    # A target that went undecided is tried once more, with another seed and the next kind
    # first, before it counts as failed: runs that work finish quickly or not at all, and
    # where one split times out the other may not (docs/planner.md).
    retry: float | None = None

    def __post_init__(self) -> None:
        self.kinds = [*self.policy.stair_kinds, *_budget_ranks(self.cp)]
        self.burster = _burster(self.cp)
        self.per_attempt = budget_attempt_seconds(self.cp, self.policy)
        self.lo = 1.0 - self.policy.budget_resolution

    def run(self) -> IdOrder:
        while self.seconds_left() >= self.policy.budget_min_seconds:
            hi = self.cp.peak(self.best) / self.serial_peak
            if hi - self.lo <= self.policy.budget_resolution:
                if self.restart():
                    continue
                break
            if self.skip_staircases(hi):
                continue
            target, retried = self.next_target(hi)
            if target >= hi - _EPS:
                break  # the best is at (or under) the serial peak: no target below it is left
            self.probe += 1
            if not self.try_target(target, retried) and self.retry is None:
                self.lo = target
        return self.best

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()

    def is_stair(self, kind: Any) -> bool:
        return kind in self.policy.stair_kinds

    def restart(self) -> bool:
        """The targets have converged. An undecided failure proves nothing, so with time left
        start again below the best, with longer attempts and the next kind first. False when
        there is nothing to restart for."""
        p = self.policy
        if not self.undecided or self.seconds_left() < p.restart_min_attempts * self.per_attempt:
            return False
        self.lo, self.probe, self.undecided = 1.0 - p.budget_resolution, 0, False
        self.per_attempt *= p.restart_time_factor
        self.first = (self.first + 1) % len(self.kinds)
        return True

    def skip_staircases(self, hi: float) -> bool:
        """From a memory-blind start (the at-bound search ended unconstrained) a staircase at a
        high target goes undecided on big settings (table3-09 at 2.06x: 20 s), where one bold
        fixed-limit probe gets to ``bound_budget`` in seconds: above it, fixed limits lead."""
        if self.retry is None and hi > self.policy.bound_budget + _EPS and self.is_stair(
            self.kinds[self.first]
        ):
            self.first = len(self.policy.stair_kinds)
            return True
        return False

    def next_target(self, hi: float) -> tuple[float, bool]:
        """The next target ratio, and whether it is a retry. Successes land close to their
        target and cost a few seconds; failures cost the whole attempt. Staircases: one probe
        just past halfway, then bisection in steps of at most ``stair_step``. Fixed limits: one
        bold first probe (never below a ``budget_step`` under ``bound_budget``, which the
        at-bound search reaches), then steps of at most ``budget_step`` below the best."""
        p = self.policy
        lo = self.lo
        if self.retry is not None:
            target, self.retry = self.retry, None
            self.first = (self.first + 1) % len(self.kinds)
            return max(1.0, target), True
        if self.is_stair(self.kinds[self.first]):
            if self.probe == 0:
                target = lo + (hi - lo) * p.stair_first_probe
            else:
                target = max(lo + (hi - lo) / 2, hi - p.stair_step)
        elif self.probe == 0:
            target = max(
                lo + (hi - lo) * p.budget_first_probe, min(hi, p.bound_budget) * (1 - p.budget_step)
            )
        else:
            target = max(lo + (hi - lo) / 2, hi * (1 - p.budget_step))
        return max(1.0, target), False

    def try_target(self, target: float, retried: bool) -> bool:
        """Try the kinds in turn at ``target``; True when one found a better schedule."""
        caps = [min(target * self.serial_peak, u) for u in self.user_caps]
        for j in range(len(self.kinds)):
            kind = self.kinds[(self.first + j) % len(self.kinds)]
            left = self.seconds_left()
            if left < self.policy.min_attempt_seconds:
                break
            res = self.attempt_kind(kind, caps, left)
            if res is None:
                continue  # the staircase does not apply to this problem
            self.attempt += 1
            self.log.append({"budget": round(target, 3), "split": "even" if kind is None else kind,
                             "status": res.status, "seconds": round(res.seconds, 2)})
            if self.accept(res):
                # The kind that worked goes first next time; the staircases once under
                # ``bound_budget``.
                under = self.cp.peak(self.best) <= self.policy.bound_budget * self.serial_peak + _EPS
                self.first = 0 if under else (self.first + j) % len(self.kinds)
                return True
            if not res.infeasible:
                # Too hard at this target for now: one retry, then raise it.
                self.undecided = True
                if not retried:
                    self.retry = target
                break
        return False

    def attempt_kind(self, kind: Any, caps: list[float], left: float) -> CpSatResult | None:
        """One CP-SAT run at the held makespan under ``kind``'s limits for ``caps``.

        No hint: every order at hand breaks the new limits, and hinting one made CP-SAT chase
        it instead of the limits (no decision in 5 s where unhinted took 1-3 s; a staircase
        hinted with the last staircase schedule: table3-10 at 1.18x took 13 s or more,
        unhinted 4 s)."""
        p = self.policy
        common = dict(lower_bound=self.floor, makespan_cap=self.makespan, workers=self.workers,
                      seed=self.seed + self.attempt)
        if self.is_stair(kind):
            stair = staircase_constraints(
                self.cp, self.base, caps, self.burster, release=kind == RELEASE
            )
            if stair is None:
                return None
            limits, extra = stair
            return solve_cpsat(
                self.cp, time_limit=min(self.per_attempt * p.stair_time, p.stair_max, left),
                inflight=limits, extra=extra, params=p.stair_cpsat_params(), **common,
            )
        return solve_cpsat(
            self.cp, time_limit=min(self.per_attempt, left),
            inflight=budget_limits(self.cp, self.base, caps, kind), **common,
        )

    def accept(self, res: CpSatResult) -> bool:
        """Keep ``res`` when it is within the held makespan and the user's capacity, and
        shorter or lower than the best."""
        cp = self.cp
        got = None if res.order is None else cp.makespan(res.order)
        if (
            got is not None
            and got <= self.makespan + _EPS
            and all(p <= u + _EPS for p, u in zip(cp.group_peaks(res.order), self.user_caps))
            and (got, cp.peak(res.order)) < (self.makespan, cp.peak(self.best) - _EPS)
        ):
            self.makespan = got
            self.best = res.order
            return True
        return False


def _inflight_budgets(
    cp: CompiledProblem,
    best: IdOrder,
    *,
    makespan: float,
    deadline: float,
    base: dict[Lane, int],
    serial_peak: float,
    user_caps: Sequence[float],
    workers: int,
    seed: int,
    log: list[dict[str, Any]],
    lower_bound: float | None = None,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> IdOrder:
    """Bisect a target peak between the serial peak and the best so far under in-flight limits
    (:class:`_BudgetSearch`).

    With ``lower_bound`` below ``makespan`` an attempt keeps shortening the makespan after its
    first schedule (limits made CP-SAT find shorter schedules than it found without them), and
    a shorter makespan wins over a lower peak.
    """
    floor = makespan if lower_bound is None else min(makespan, lower_bound)
    return _BudgetSearch(
        cp, best, makespan=makespan, floor=floor, deadline=deadline, base=base,
        serial_peak=serial_peak, user_caps=user_caps, workers=workers, seed=seed, log=log,
        policy=policy,
    ).run()


def reduce_peak(
    cp: CompiledProblem,
    order: IdOrder,
    *,
    makespan: float,
    seconds: float,
    fallback: IdOrder,
    serial_peak: float,
    caps: Sequence[float] | None = None,
    workers: int = 1,
    seed: int = 0,
    stats: dict[str, Any] | None = None,
    lower_bound: float | None = None,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> IdOrder:
    """Return an order with makespan <= ``makespan`` and the lowest peak found in ``seconds``.

    ``fallback`` is an order whose every group peak is at most ``serial_peak`` (concatenated
    1F1B), used to seed the capacity rungs. Given the ``lower_bound``, the in-flight budgets
    may also shorten the makespan towards it; the later steps then hold the shorter one.
    """
    p = policy
    # A CP-SAT model is built before its time limit starts to bind, so the last step must start
    # that much before the end (``policy.build_tasks_per_second``).
    deadline = time.perf_counter() + seconds - len(cp.tasks) / p.build_tasks_per_second
    best = [list(g) for g in order]
    log: list[dict[str, Any]] = []
    user_caps = list(caps) if caps is not None else [float("inf")] * cp.num_groups

    # 1) In-flight budgets: most of the pass when they work, and they fail fast when not.
    if cp.peak(best) > serial_peak + _EPS:
        share = p.budget_share * (deadline - time.perf_counter())
        best = _inflight_budgets(
            cp, best, makespan=makespan, deadline=time.perf_counter() + share,
            base=inflight_counts(cp, fallback), serial_peak=serial_peak, user_caps=user_caps,
            workers=workers, seed=seed, log=log, lower_bound=lower_bound, policy=p,
        )
        makespan = min(makespan, cp.makespan(best) or makespan)

    # 2) Capacity rungs, lowest first; a rung's best schedule seeds the next (it fits there too).
    seed_order = fallback if cp.fits(fallback, [serial_peak + _EPS] * cp.num_groups) else None
    rungs = [r for r in p.rungs if r * serial_peak < cp.peak(best) - _EPS]
    rung_share = p.rung_share * (deadline - time.perf_counter())
    for i, r in enumerate(rungs):
        left = deadline - time.perf_counter()
        if seed_order is None or left < p.min_attempt_seconds:
            break
        # Later rungs are looser and get more time; together they take ``rung_share``.
        budget = min(left, rung_share * (1 + i) / sum(range(1, len(rungs) + 1)))
        cap = [min(r * serial_peak, u) for u in user_caps]
        res = solve_cpsat(
            cp, time_limit=budget, lower_bound=makespan, memory_cap=cap, hint_order=seed_order,
            workers=workers, seed=seed + i,
        )
        got = None if res.order is None else cp.makespan(res.order)
        log.append({"rung": r, "status": res.status, "makespan": got,
                    "seconds": round(res.seconds, 2)})
        if res.order is not None and cp.fits(res.order, cap):
            seed_order = res.order
            if got is not None and got <= makespan + _EPS and cp.peak(res.order) < cp.peak(best):
                best = res.order
                break

    # 3) Exact peak with the makespan held, when the rungs did not get there: one long run
    # (restarting it from its own best order loses the solver's progress).
    left = deadline - time.perf_counter()
    if cp.peak(best) > serial_peak + _EPS and left > p.exact_min_seconds:
        res = solve_cpsat(
            cp,
            time_limit=p.exact_share * left,
            minimize="cumulative_peak",
            lower_bound=makespan,
            makespan_cap=makespan,
            memory_cap=caps,
            hint_order=best,
            workers=workers,
            seed=seed,
        )
        got = None if res.order is None else cp.makespan(res.order)
        log.append({"exact_peak": res.status, "makespan": got, "seconds": round(res.seconds, 2)})
        if (
            got is not None
            and got <= makespan + _EPS
            and cp.fits(res.order, caps)
            and cp.peak(res.order) < cp.peak(best) - _EPS
        ):
            best = res.order

    # 4) Time-window polishing around the peak, until the serial 1F1B peak is matched (the
    # paper's best outcome) or windows stop helping.
    rng = random.Random(seed)
    ms = cp.makespan(best) or makespan
    width = ms * p.window_fraction
    rounds = stale = 0
    while (
        time.perf_counter() < deadline - p.window_end_margin
        and cp.peak(best) > serial_peak + _EPS
        and stale < p.window_stale_rounds
    ):
        rounds += 1
        stale += 1
        lo = rng.uniform(-width / 2, ms - width / 2)
        cand = solve_time_window(
            cp, best, lo, lo + width, makespan=makespan,
            time_limit=min(p.window_seconds, deadline - time.perf_counter()), caps=caps,
            workers=workers,
            seed=seed + rounds,
        )
        if cand is None:
            continue
        cm = cp.makespan(cand)
        if cm is None or cm > makespan + _EPS or not cp.fits(cand, caps):
            continue
        if (cp.peak(cand), sum(cp.group_peaks(cand))) < (cp.peak(best), sum(cp.group_peaks(best)) - _EPS):
            best = cand
            stale = 0
    if stats is not None:
        stats["memory_pass"] = {"rungs": log, "window_rounds": rounds,
                                "peak_activation": round(cp.peak(best), 6)}
    return best
