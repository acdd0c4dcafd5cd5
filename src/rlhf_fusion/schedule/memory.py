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
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

from .cpsat import Stage as Lane
from .cpsat import inflight_counts, solve_cpsat, solve_time_window, stages_by_group
from .evaluate import CompiledProblem, IdOrder
from .staircase import Build, staircase_constraints

_EPS = 1e-9
RUNGS = (1.0, 1.1, 1.25, 1.5, 2.0)
_STALE_ROUNDS = 40
# Of the time the rungs leave, the exact-peak run takes this share and the windows the rest
# (on Table 3 the exact run gains more; 0.5 traded 03 for 00 within run-to-run noise).
_EXACT_SHARE = 0.85

_BUDGET_SHARE = 0.9  # of the pass, for the in-flight budgets
# One in-flight budget attempt, plus a second per 400 tasks; on Table 3 the ones that succeed
# take 1-4 s on 2 cores (8-12 s on the 3,072-task settings).
_BUDGET_ATTEMPT_SECONDS = 4.0
_BUDGET_ATTEMPT_MAX = 15.0
_BUDGET_RESOLUTION = 0.02  # stop bisecting the target ratio below this gap
_BUDGET_STEP = 0.06
# A staircase attempt (``staircase.py``) gets this many times a fixed-limit attempt's time:
# the ones at the serial peak take 8.5-21.5 s on 2 cores (table3-01, release variant, eight
# seeds; 4x gave it 19.8 s, and one seed in eight missed), 15-17 s on table3-07.
_STAIR_TIME = 5.0
_STAIR_MAX = 25.0
# After the first staircase, targets step down at most this far below the best peak: steps
# that size take 2-7 s on Table 3, where halving the gap went undecided for 20 s
# (table3-10 1.24x -> 1.11x; in isolation 1.2x takes 4 s and 1.15x is undecided in 30 s).
_STAIR_STEP = 0.06
# CP-SAT's presolve probing spent 21 s of a 30 s staircase attempt on table3-10 (its step
# booleans) and then stopped; without it the same model is decided in 4 s (06: 7 s).
STAIR_PARAMS = {"cp_model_probing_level": 0}
STAIRCASE = "staircase"
# The staircase whose steady model keeps its 1F1B count and whose burster catches up after it
# drains: table3-01 and 07 reach 1.0x with it (15-17 s); tried first, the plain one next.
RELEASE = "release"
STAIRS = (RELEASE, STAIRCASE)
# The in-flight budget (x the serial peak) under which the search first looks for the bound.
BOUND_BUDGET = 1.5


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


def budget_attempt_seconds(cp: CompiledProblem) -> float:
    """One fixed-limit attempt: deciding takes longer on bigger problems (model building
    included)."""
    return min(_BUDGET_ATTEMPT_MAX, _BUDGET_ATTEMPT_SECONDS + len(cp.tasks) / 400)


def stair_attempt_seconds(cp: CompiledProblem) -> float:
    """One staircase attempt (several times a fixed-limit one, capped)."""
    return min(budget_attempt_seconds(cp) * _STAIR_TIME, _STAIR_MAX)


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
) -> IdOrder:
    """Bisect a target peak between the serial peak and the best so far under in-flight limits.

    With ``lower_bound`` below ``makespan`` an attempt keeps shortening the makespan after its
    first schedule (limits made CP-SAT find shorter schedules than it found without them), and
    a shorter makespan wins over a lower peak.
    """
    floor = makespan if lower_bound is None else min(makespan, lower_bound)
    ranks: list[Any] = [*STAIRS, *_budget_ranks(cp)]
    burster = _burster(cp)
    per_attempt = budget_attempt_seconds(cp)
    # Ratios to the serial peak; lo is the highest target that failed (none yet: just below 1).
    lo = 1.0 - _BUDGET_RESOLUTION
    first = 0
    attempt = 0
    probe = 0  # attempts since the last restart
    undecided = False  # did a target fail without a proof since the last restart?
    # A target that timed out once is tried once more, with another seed and the other split
    # first, before it counts as failed: runs that work finish in 5-7 s or not at all (06 at
    # 1.41x: 3 of 4 seeds), and where one split times out the other may not (00 at 1.2x).
    retry: float | None = None
    while deadline - time.perf_counter() >= 1.0:
        hi = cp.peak(best) / serial_peak
        if hi - lo <= _BUDGET_RESOLUTION:
            # An undecided failure proves nothing, so with time left start again below the
            # best with longer attempts and the other split first (on table3-00 a target
            # that timed out at 6 s with one split was decided in 8 s with the other).
            if not undecided or deadline - time.perf_counter() < 2 * per_attempt:
                break
            lo, probe, undecided = 1.0 - _BUDGET_RESOLUTION, 0, False
            per_attempt *= 1.5
            first = (first + 1) % len(ranks)
            continue
        # Successes land close to their target and cost a few seconds; failures cost the whole
        # attempt. With fixed limits: one bold first probe from a high peak (never below a
        # step under BOUND_BUDGET, which the at-bound search reaches), then steps of at most
        # _BUDGET_STEP below the best. Staircases reach far lower peaks: one probe just past
        # halfway, then bisection in steps of at most _STAIR_STEP.
        if retry is not None:
            r, retry, retried = retry, None, True
            first = (first + 1) % len(ranks)
        elif hi > BOUND_BUDGET + _EPS and ranks[first] in STAIRS:
            # From a memory-blind start (the at-bound search ended unconstrained) a staircase
            # at a high target goes undecided on big settings (table3-09 at 2.06x: 20 s),
            # where one bold fixed-limit probe gets to 1.5x in seconds.
            first = len(STAIRS)
            continue
        elif ranks[first] in STAIRS:
            r = lo + (hi - lo) * 0.55 if probe == 0 else max(lo + (hi - lo) / 2, hi - _STAIR_STEP)
            retried = False
        elif probe == 0:
            r, retried = max(lo + (hi - lo) * 0.3, min(hi, BOUND_BUDGET) * (1 - _BUDGET_STEP)), False
        else:
            r, retried = max(lo + (hi - lo) / 2, hi * (1 - _BUDGET_STEP)), False
        r = max(1.0, r)
        if r >= hi - _EPS:
            break  # the best is at (or under) the serial peak: no target below it is left
        probe += 1
        caps = [min(r * serial_peak, u) for u in user_caps]
        ok = False
        for j in range(len(ranks)):
            rank = ranks[(first + j) % len(ranks)]
            left = deadline - time.perf_counter()
            if left < 0.5:
                break
            # No hint: every order at hand breaks the new limits, and hinting one made CP-SAT
            # chase it instead of the limits (no decision in 5 s where unhinted took 1-3 s;
            # a staircase hinted with the last staircase schedule: table3-10 at 1.18x took
            # 13 s or more, unhinted 4 s).
            if rank in STAIRS:
                stair = staircase_constraints(cp, base, caps, burster, release=rank == RELEASE)
                if stair is None:
                    continue
                limits, extra = stair
                res = solve_cpsat(
                    cp, time_limit=min(per_attempt * _STAIR_TIME, _STAIR_MAX, left), lower_bound=floor,
                    makespan_cap=makespan, inflight=limits, extra=extra, workers=workers,
                    seed=seed + attempt, params=STAIR_PARAMS,
                )
            else:
                res = solve_cpsat(
                    cp, time_limit=min(per_attempt, left), lower_bound=floor, makespan_cap=makespan,
                    inflight=budget_limits(cp, base, caps, rank), workers=workers,
                    seed=seed + attempt,
                )
            attempt += 1
            got = None if res.order is None else cp.makespan(res.order)
            log.append({"budget": round(r, 3), "split": "even" if rank is None else rank,
                        "status": res.status, "seconds": round(res.seconds, 2)})
            if (
                got is not None
                and got <= makespan + _EPS
                and all(p <= u + _EPS for p, u in zip(cp.group_peaks(res.order), user_caps))
                and (got, cp.peak(res.order)) < (makespan, cp.peak(best) - _EPS)
            ):
                makespan = got
                best = res.order
                # The split that worked goes first next time; the staircases once under 1.5x.
                first = 0 if cp.peak(best) <= BOUND_BUDGET * serial_peak + _EPS else (first + j) % len(ranks)
                ok = True
                break
            if not res.infeasible:
                # Too hard at this target for now: one retry (above), then raise it.
                undecided = True
                if not retried:
                    retry = r
                break
        if not ok and retry is None:
            lo = r
    return best


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
) -> IdOrder:
    """Return an order with makespan <= ``makespan`` and the lowest peak found in ``seconds``.

    ``fallback`` is an order whose every group peak is at most ``serial_peak`` (concatenated
    1F1B), used to seed the capacity rungs. Given the ``lower_bound``, the in-flight budgets
    may also shorten the makespan towards it; the later steps then hold the shorter one.
    """
    # A CP-SAT model is built before its time limit starts to bind (a second per 800 tasks
    # here: the exact-peak model on table3-10 ran 1.6 s past a 1,500-task margin), so the last
    # step must start that much before the end.
    deadline = time.perf_counter() + seconds - len(cp.tasks) / 800
    best = [list(g) for g in order]
    log: list[dict[str, Any]] = []
    user_caps = list(caps) if caps is not None else [float("inf")] * cp.num_groups

    # 1) In-flight budgets: most of the pass when they work, and they fail fast when not.
    if cp.peak(best) > serial_peak + _EPS:
        share = _BUDGET_SHARE * (deadline - time.perf_counter())
        best = _inflight_budgets(
            cp, best, makespan=makespan, deadline=time.perf_counter() + share,
            base=inflight_counts(cp, fallback), serial_peak=serial_peak, user_caps=user_caps,
            workers=workers, seed=seed, log=log, lower_bound=lower_bound,
        )
        makespan = min(makespan, cp.makespan(best) or makespan)

    # 2) Capacity rungs, lowest first; a rung's best schedule seeds the next (it fits there too).
    seed_order = fallback if cp.fits(fallback, [serial_peak + _EPS] * cp.num_groups) else None
    rungs = [r for r in RUNGS if r * serial_peak < cp.peak(best) - _EPS]
    rung_share = 0.35 * (deadline - time.perf_counter())
    for i, r in enumerate(rungs):
        left = deadline - time.perf_counter()
        if seed_order is None or left < 0.5:
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
    if cp.peak(best) > serial_peak + _EPS and left > 1.0:
        res = solve_cpsat(
            cp,
            time_limit=_EXACT_SHARE * left,
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
    width = ms / 4
    rounds = stale = 0
    while (
        time.perf_counter() < deadline - 0.3
        and cp.peak(best) > serial_peak + _EPS
        and stale < _STALE_ROUNDS
    ):
        rounds += 1
        stale += 1
        lo = rng.uniform(-width / 2, ms - width / 2)
        cand = solve_time_window(
            cp, best, lo, lo + width, makespan=makespan,
            time_limit=min(5.0, deadline - time.perf_counter()), caps=caps, workers=workers,
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
