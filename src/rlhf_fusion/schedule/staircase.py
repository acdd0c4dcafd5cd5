"""Staircase in-flight limits: fixed limits that change once, at a point CP-SAT chooses.

Fixed in-flight limits (``memory.budget_limits``) give each model on a group one count for the
whole run, so a group whose two residents both peak at their 1F1B counts needs room for both
at once. The schedules that reach the paper's peaks do not work that way: the lighter model
runs ahead and holds many micro-batches while the heavier one is still ramping up, then drops
to a small count for the rest of the run (on table3-07 the critic's first stage holds 13
micro-batches at t = 40 and 5 from t = 110, while the actor's stage on that group goes from 0
to 9). An exact cumulative capacity allows that too, but CP-SAT needs minutes to find such a
schedule at the bound (table3-07 at 1.0x: 80-170 s); these limits find it in 15-35 s.

For a target capacity ``cap`` on a group hosting a steady resident S (activation ``a_S``,
1F1B count ``n_S``) and a bursting resident B (``a_B``):

- S may hold ``a = min(n_S, floor((cap - a_B) / a_S))`` micro-batches;
- B's limit steps down a staircase ``K_0 > K_1 > ... > c``, where ``K_l`` is what fits beside
  ``T_l + 1`` micro-batches of S (``T_l = l``), down to ``c`` beside ``a``;
- the step to ``K_l`` happens at a forward index of B that CP-SAT picks (monotone booleans),
  and S's forward number ``T_l`` waits until B is down to ``K_l``.

Every level holds at most ``a_S * min(T_{l+1}, a) + a_B * K_l <= cap``, so any schedule
obeying these precedences is within the capacity; all constraints are (enforced) precedences,
which CP-SAT propagates well.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .cpsat import lanes_of
from .evaluate import CompiledProblem

_EPS = 1e-9
Lane = tuple[int, int, int]  # (model, copy, stage)


def staircase_constraints(
    cp: CompiledProblem,
    base: dict[Lane, int],
    caps: Sequence[float],
    burster: int,
) -> Callable[..., None] | None:
    """A ``solve_cpsat(extra=...)`` callback that keeps every group within ``caps``.

    ``base`` holds the 1F1B in-flight counts, ``burster`` is the model allowed to run ahead.
    Groups hosting other than two residents with activations get fixed limits of
    ``floor(cap / activation)`` each when alone, or are left to the caller (``None`` is
    returned when a group cannot be covered, or the capacity is too small for the template).
    """
    plans: list[tuple[Any, ...]] = []
    by_group: dict[int, list[Lane]] = {}
    act: dict[Lane, float] = {}
    mbs: dict[Lane, int] = {}
    for (model, copy, op, stage), tasks in lanes_of(cp).items():
        if op != "F":
            continue
        lane = (model, copy, stage)
        act[lane], mbs[lane] = cp.mem[tasks[0]], len(tasks)
        if act[lane] > 0:
            by_group.setdefault(cp.group[tasks[0]], []).append(lane)
    for g, lanes in by_group.items():
        cap = caps[g]
        if len(lanes) == 1:
            (lane,) = lanes
            k = math.floor(cap / act[lane] + _EPS)
            if k < 1:
                return None
            plans.append(("fixed", lane, k))
            continue
        bursting = [lane for lane in lanes if lane[0] == burster]
        steady = [lane for lane in lanes if lane[0] != burster]
        if len(lanes) != 2 or len(bursting) != 1:
            return None
        b, s = bursting[0], steady[0]
        a = min(base[s], mbs[s], math.floor((cap - act[b]) / act[s] + _EPS))
        if a < 1:
            return None

        def fits_beside(x: int, b: Lane = b, s: Lane = s, cap: float = cap) -> int:
            return max(0, min(mbs[b], math.floor((cap - act[s] * x) / act[b] + _EPS)))

        levels = [(t, fits_beside(t + 1 if t + 1 < a else a)) for t in range(1, a)]
        first_k = fits_beside(1)
        if first_k < 1 or fits_beside(a) < 1:
            return None
        plans.append(("stair", s, a, b, first_k, levels))

    def build(model: Any, start: Sequence[Any], end: Sequence[Any], lanes: dict) -> None:
        for plan in plans:
            if plan[0] == "fixed":
                _, lane, k = plan
                _limit(model, start, end, lanes, lane, k)
                continue
            _, s, a, b, first_k, levels = plan
            _limit(model, start, end, lanes, s, a)
            _limit(model, start, end, lanes, b, first_k)
            fs = lanes[(s[0], s[1], "F", s[2])]
            fb, bb = lanes[(b[0], b[1], "F", b[2])], lanes[(b[0], b[1], "B", b[2])]
            prev_k, prev = first_k, None
            for t, k in levels:
                # ``levels[l]`` is (T_l, K_l): from S's forward T_l on, B holds at most K_l.
                if k >= prev_k or t >= len(fs):
                    continue
                on = [model.NewBoolVar("") for _ in fb]  # B's forward i is past the step
                for i in range(len(fb) - 1):
                    model.AddImplication(on[i], on[i + 1])
                if prev is not None:
                    for i in range(len(fb)):
                        model.AddImplication(on[i], prev[i])
                for i in range(k, len(fb)):
                    model.Add(start[fb[i]] >= end[bb[i - k]]).OnlyEnforceIf(on[i])
                    # Before the step, B may have ``i`` forwards going: S's forward T_l
                    # waits until all but ``k`` of them are back.
                    model.Add(start[fs[t]] >= end[bb[i - k]]).OnlyEnforceIf(on[i].Not())
                prev_k, prev = k, on

    return build


def _limit(model: Any, start: Sequence[Any], end: Sequence[Any], lanes: dict, lane: Lane, k: int) -> None:
    fl = lanes[(lane[0], lane[1], "F", lane[2])]
    bl = lanes[(lane[0], lane[1], "B", lane[2])]
    for i in range(len(fl) - k):
        model.Add(start[fl[i + k]] >= end[bl[i]])
