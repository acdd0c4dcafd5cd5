"""Staircase in-flight limits: a limit that steps down at points CP-SAT chooses.

Fixed in-flight limits (``memory.budget_limits``) give each model on a group one count for the
whole run, so a group whose two residents both peak at their 1F1B counts needs room for both
at once. The schedules that reach the paper's peaks do not work that way: the lighter model
runs ahead and holds many micro-batches while the heavier one is still ramping up, then drops
to a small count for the rest of the run (on table3-07 the critic's first stage holds 13
micro-batches at t = 40 and 5 from t = 110, while the actor's stage on that group goes from 0
to 9). An exact cumulative capacity allows that too, but CP-SAT needs minutes to find such a
schedule at the bound (table3-07 at 1.0x: 80-170 s); the release variant below finds it in
17 s.

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

With ``release=True`` S keeps its whole 1F1B count ``a = n_S`` even where that leaves no room
for B (``c = 0``), and B gets its room back at the end: a suffix of B's forwards, again cut
where CP-SAT picks, runs in release levels ``m`` that wait for S's backward ``M_S - 1 - x_m``
(after which S never holds more than ``x_m``) and may hold ``fits_beside(x_m)``. Release
forwards are exempt from the steps down, and they stay safe: S cannot grow past ``x_m`` once
that backward has ended. table3-01 needs this shape: its group 0 is at the capacity with the
actor's 8 micro-batches alone, so the critic's last stage must work before the actor ramps up
and after it drains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .cpsat import Stage, stages_by_group
from .evaluate import CompiledProblem

_EPS = 1e-9
Build = Callable[..., None]  # solve_cpsat(extra=...): (model, start, end, lanes) -> None


def _suffix(model: Any, n: int, inside: list | None) -> list:
    """Booleans for "B's forward i is past this switch": a suffix of the forwards, inside the
    previous switch's suffix."""
    on = [model.NewBoolVar("") for _ in range(n)]
    for i in range(n - 1):
        model.AddImplication(on[i], on[i + 1])
    if inside is not None:
        for i in range(n):
            model.AddImplication(on[i], inside[i])
    return on


def staircase_constraints(
    cp: CompiledProblem,
    base: dict[Stage, int],
    caps: Sequence[float],
    burster: int,
    release: bool = False,
) -> tuple[dict[Stage, int], Build] | None:
    """Fixed in-flight limits and a ``solve_cpsat(extra=...)`` callback that together keep
    every group within ``caps`` (pass both: ``inflight=limits, extra=build``).

    ``base`` holds the 1F1B in-flight counts, ``burster`` is the model allowed to run ahead.
    A group with one resident holding activations gets the fixed limit ``floor(cap /
    activation)``. ``release`` lets S keep its 1F1B count and B catch up after S drains
    (module docstring). ``None`` when a group hosts more than two such residents, or the
    capacity leaves no room for the template.
    """
    groups, act, mbs = stages_by_group(cp)
    limits: dict[Stage, int] = {}
    stairs: list[tuple[Stage, Stage, list[tuple[int, int]], list[tuple[int, int]]]] = []
    for g, hosted in enumerate(groups):
        live = [lane for lane in hosted if act[lane] > 0]
        if not live:
            continue
        cap = caps[g]
        if len(live) == 1:
            limits[live[0]] = math.floor(cap / act[live[0]] + _EPS)
            if limits[live[0]] < 1:
                return None
            continue
        bursting = [lane for lane in live if lane[0] == burster]
        if len(live) != 2 or len(bursting) != 1:
            return None
        b = bursting[0]
        s = live[1 - live.index(b)]
        room_for_b = 0 if release else act[b]
        a = min(base[s], mbs[s], math.floor((cap - room_for_b) / act[s] + _EPS))

        def fits_beside(x: int, b: Stage = b, s: Stage = s, cap: float = cap) -> int:
            return max(0, min(mbs[b], math.floor((cap - act[s] * x) / act[b] + _EPS)))

        if a < 1 or fits_beside(1) < 1 or (not release and fits_beside(a) < 1):
            return None
        limits[s], limits[b] = a, fits_beside(1)
        # (T_l, K_l): from S's forward T_l on, B holds at most K_l; only the real steps down.
        steps, k_prev = [], limits[b]
        for t in range(1, a):
            k = fits_beside(t + 1)
            if k < k_prev:
                steps.append((t, k))
                k_prev = k
        # (x_m, K'_m): once S is down to x_m, B may hold K'_m again; only the real steps up.
        rises: list[tuple[int, int]] = []
        if release:
            for x in range(a - 1, -1, -1):
                k = min(limits[b], fits_beside(x))
                if k > k_prev:
                    rises.append((x, k))
                    k_prev = k
        stairs.append((s, b, steps, rises))

    def build(model: Any, start: Sequence[Any], end: Sequence[Any], lanes: dict) -> None:
        for s, b, steps, rises in stairs:
            fs = lanes[(s[0], s[1], "F", s[2])]
            bs = lanes[(s[0], s[1], "B", s[2])]
            fb, bb = lanes[(b[0], b[1], "F", b[2])], lanes[(b[0], b[1], "B", b[2])]
            # Release levels first: the forwards in them are exempt from the steps down.
            ups: list[list] = []
            for x, _ in rises:
                ups.append(_suffix(model, len(fb), ups[-1] if ups else None))
                for i in range(len(fb)):
                    model.Add(start[fb[i]] >= end[bs[len(bs) - 1 - x]]).OnlyEnforceIf(ups[-1][i])
            for m, (_, k) in enumerate(rises):
                for i in range(k, len(fb)):
                    # Level m's limit holds until the next level up takes over.
                    deeper = [ups[m + 1][i].Not()] if m + 1 < len(ups) else []
                    model.Add(start[fb[i]] >= end[bb[i - k]]).OnlyEnforceIf([ups[m][i], *deeper])
            held = [[ups[0][i].Not()] if ups else [] for i in range(len(fb))]
            prev = None
            for t, k in steps:
                on = _suffix(model, len(fb), prev)
                for i in range(k, len(fb)):
                    model.Add(start[fb[i]] >= end[bb[i - k]]).OnlyEnforceIf([on[i], *held[i]])
                    # Before the step, B may have ``i`` forwards going: S's forward T_l
                    # waits until all but ``k`` of them are back.
                    model.Add(start[fs[t]] >= end[bb[i - k]]).OnlyEnforceIf([on[i].Not(), *held[i]])
                prev = on

    return limits, build
