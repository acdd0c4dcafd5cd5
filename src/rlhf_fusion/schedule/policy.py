"""The tuning of ``solve(solver="auto" | "cpsat" | "anneal")`` in one place.

Every time share, attempt length, cap, step and CP-SAT override of the search (``search.py``)
and the memory pass (``memory.py``) is a field of :class:`SearchPolicy`, with the reason for its
value beside it. ``solve(..., policy=SearchPolicy(...))`` overrides any of them; the defaults are
the values the Table 3 results in ``benchmarks/results/table3.md`` were measured with (2 CPU
cores, 60 s per setting). Times are wall-clock seconds; "tasks" counts the problem's forward
and backward tasks (768 to 4,096 on Table 3), the measure by which CP-SAT models grow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .problem import ProblemError

RELEASE = "release"
"""Staircase variant: the steady model keeps its 1F1B count; the burster catches up after it."""
STAIRCASE = "staircase"
"""Staircase variant: the steady model is held to what leaves room for one burster micro-batch."""


@dataclass(frozen=True)
class SearchPolicy:
    """Tuning constants of the schedule search, each with the reason for its value."""

    # -- the whole search -------------------------------------------------------------------
    result_margin: float = 0.02
    """Share of ``time_limit`` kept back for validating and packaging the result, so that
    ``solve`` returns inside the caller's budget ..."""
    result_margin_max: float = 1.0
    """... but never more than this many seconds (validation takes well under a second)."""
    default_workers: int = 2
    """CP-SAT workers and annealing processes when the caller gives none: the 2-core machine
    every default below was measured on."""
    min_attempt_seconds: float = 0.5
    """A CP-SAT run (at the bound, makespan minimisation, the memory pass's budgets and rungs,
    and the pass itself) is only started with at least this much time left: building the
    model alone can take that long, so a shorter run cannot decide anything."""

    # -- phase 1: the makespan ----------------------------------------------------------------
    makespan_share: float = 0.7
    """Share of the time that goes to the makespan (the at-bound check, then the fallback
    minimisation) when the memory pass runs; the pass gets the rest and whatever phase 1 leaves
    unused. Without the memory pass the makespan gets everything. The makespan gets the larger
    part because it comes first: memory is only ever lowered with the makespan held."""
    bound_share: float = 0.85
    """Share of phase 1 for the at-bound attempts; the rest is for the fallback anneal and
    makespan minimisation. At 0.85 the hardest setting (table3-09, 4,096 tasks) fits a
    memory-limited attempt and a full unconstrained one."""
    bound_budget: float = 1.5
    """In-flight budget (times the serial 1F1B peak) of the first at-bound attempts. Under a
    release staircase worth 1.5x all 12 Table 3 settings reach the bound (in 0.5-18 s), and the
    memory pass starts near 1.45x instead of the 2-5x of a memory-blind schedule. The memory
    pass's first fixed-limit probe also stays at least a ``budget_step`` under it, and once the
    best peak is at or under it the staircases lead."""
    attempt_seconds: float = 12.0
    """One at-bound attempt under fixed in-flight limits, and the base of an unconstrained one:
    the attempts that succeed on Table 3 take 1-10 s on 2 cores. CP-SAT's time to decide the
    bound is heavy-tailed (the same model takes 6 s with one seed and times out with another),
    so it restarts with a new seed rather than spending the whole share on one run."""
    attempt_tasks_per_second: float = 400
    """An unconstrained at-bound attempt gets a second more per this many tasks: one that
    succeeds takes about the same time whatever the seed (table3-09: 17 s with each of three
    seeds), so its time is set by size, not by luck."""
    attempt_max: float = 25.0
    """Cap on an unconstrained at-bound attempt (the size rule gives at most 22 s on Table 3)."""
    unconstrained_reserve: float = 0.9
    """After a memory-limited attempt fails, the first unconstrained one gets its full time even
    past the share (the bound comes first; table3-09 needs 17 s), but at most this share of
    what is left of the whole search."""
    stretch_last_attempt: float = 2.0
    """When less than this many attempts' time is left in the share, the next attempt takes all
    of it instead of leaving a remainder too short to decide anything."""

    # -- annealing ------------------------------------------------------------------------------
    anneal_memory_fraction: float = 0.3
    """Share of an anneal's time spent on its second pass (lowering peak memory with the
    makespan held); the makespan pass, which comes first, gets the larger rest."""
    hint_anneal_share: float = 0.1
    """When the bound was not reached, a short anneal improves the hint for CP-SAT's makespan
    minimisation; it gets this share of the time left ..."""
    hint_anneal_max: float = 5.0
    """... and at most this many seconds: it only has to beat the greedy as a hint; the rest of
    phase 1 goes to CP-SAT's minimisation, which can also prove the result optimal."""

    # -- memory pass: overall ---------------------------------------------------------------
    build_tasks_per_second: float = 800
    """The pass ends a second per this many tasks before its deadline: a CP-SAT model is built
    before its time limit starts to bind (the exact-peak model on table3-10 ran 1.6 s past a
    smaller margin)."""
    budget_share: float = 0.9
    """Share of the pass for the in-flight budgets (step 1): they do most of the work when they
    succeed and fail fast when they cannot (a proof of infeasibility takes seconds)."""

    # -- memory pass: in-flight budgets -------------------------------------------------------
    budget_attempt_seconds: float = 4.0
    """One fixed-limit budget attempt: the ones that succeed on Table 3 take 1-4 s on 2 cores
    (8-12 s on the 3,072-task settings) ..."""
    budget_attempt_tasks_per_second: float = 400
    """... plus a second per this many tasks (deciding takes longer on bigger models) ..."""
    budget_attempt_max: float = 15.0
    """... capped at this many seconds."""
    budget_resolution: float = 0.02
    """Stop bisecting the target (a ratio to the serial peak) once the highest failed target and
    the best peak are this close; a finer step costs whole attempts for little memory."""
    budget_first_probe: float = 0.3
    """The first fixed-limit target lies this share of the way up from the serial peak to the
    best peak (a bold probe: successes land near their target and cost a few seconds) ..."""
    budget_step: float = 0.06
    """... but no lower than this fraction under ``min(best, bound_budget)``; later fixed-limit
    targets step down at most this fraction below the best."""
    stair_time: float = 5.0
    """A staircase attempt gets this many times a fixed-limit attempt's time: the release
    staircase at the serial peak takes 8.5-21.5 s on 2 cores (table3-01, eight seeds; at 4x
    one seed in eight missed), 15-17 s on table3-07."""
    stair_max: float = 25.0
    """Cap on a staircase attempt, at the at-bound search and in the memory pass."""
    stair_first_probe: float = 0.55
    """The first staircase target after a (re)start lies just past halfway from the serial peak
    to the best peak ..."""
    stair_step: float = 0.06
    """... and later ones at most this far (absolute ratio) below the best: steps that size take
    2-7 s on Table 3, where halving the gap went undecided for 20 s (table3-10 from 1.24x to
    1.11x; in isolation 1.2x takes 4 s and 1.15x is undecided in 30 s)."""
    stair_kinds: tuple[str, ...] = (RELEASE, STAIRCASE)
    """Staircase variants, in the order tried at each target, before the fixed limits. Release
    first: table3-01 and 07 reach 1.0x only with it (its group 0 is at capacity with the actor's
    1F1B count alone)."""
    stair_params: tuple[tuple[str, Any], ...] = (("cp_model_probing_level", 0),)
    """CP-SAT parameters for staircase attempts: presolve probing spent 21 s of a 30 s attempt on
    table3-10 (on the step booleans) and then stopped; without it the same model is decided in
    4 s (table3-06 at 1.25x: 7 s)."""
    restart_time_factor: float = 1.5
    """When the targets converge but a failure was only undecided, the bisection restarts below
    the best with attempts this much longer (and the next kind first: on table3-00 a target that
    timed out at 6 s with one split was decided in 8 s with the other) ..."""
    restart_min_attempts: float = 2.0
    """... provided at least this many (new-length) attempts' time is left."""
    budget_min_seconds: float = 1.0
    """No new budget target is started with less time left than this."""

    # -- memory pass: capacity rungs, exact peak, windows ---------------------------------------
    rungs: tuple[float, ...] = (1.0, 1.1, 1.25, 1.5, 2.0)
    """Capacities (times the serial peak) tried in step 2, lowest first; concatenated 1F1B fits
    every one of them, so each has a valid start. Coarse, because the budgets usually leave
    little for the rungs to gain."""
    rung_share: float = 0.35
    """Share of what the budgets leave for the rungs; later (looser) rungs get more of it."""
    exact_share: float = 0.85
    """Of the time the rungs leave, the exact-peak run (step 3) takes this share and the time
    windows the rest: on Table 3 the exact run gains more (0.5 traded table3-03 for 00 within
    run-to-run noise). One long run, since restarting it loses the solver's progress."""
    exact_min_seconds: float = 1.0
    """The exact-peak run is only started with at least this much time left."""
    window_fraction: float = 0.25
    """A time window (step 4) spans this fraction of the makespan: wide enough to move the
    tasks around a peak, narrow enough for CP-SAT to re-time them in seconds."""
    window_seconds: float = 5.0
    """Cap on one time-window run."""
    window_stale_rounds: int = 40
    """Windows stop after this many rounds in a row without improvement."""
    window_end_margin: float = 0.3
    """No window is started this close to the pass's deadline."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(value) or value < 0:
                    raise ProblemError(
                        f"SearchPolicy.{f.name}: must be a finite number >= 0, got {value}"
                    )
        for name in ("result_margin", "makespan_share", "bound_share", "unconstrained_reserve",
                     "anneal_memory_fraction", "hint_anneal_share", "budget_share", "rung_share",
                     "exact_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ProblemError(f"SearchPolicy.{name}: a share must be in (0, 1]")
        unknown = set(self.stair_kinds) - {RELEASE, STAIRCASE}
        if unknown:
            raise ProblemError(
                f"SearchPolicy.stair_kinds: unknown {sorted(unknown)}; use {RELEASE!r}, {STAIRCASE!r}"
            )

    def attempt_at_bound_seconds(self, tasks: int) -> float:
        """One unconstrained at-bound attempt for a problem of ``tasks`` tasks."""
        return min(self.attempt_max, self.attempt_seconds + tasks / self.attempt_tasks_per_second)

    def budget_attempt(self, tasks: int) -> float:
        """One fixed-limit budget attempt for a problem of ``tasks`` tasks."""
        return min(
            self.budget_attempt_max,
            self.budget_attempt_seconds + tasks / self.budget_attempt_tasks_per_second,
        )

    def stair_attempt(self, tasks: int) -> float:
        """One staircase attempt for a problem of ``tasks`` tasks."""
        return min(self.budget_attempt(tasks) * self.stair_time, self.stair_max)

    def stair_cpsat_params(self) -> dict[str, Any]:
        """``stair_params`` as ``solve_cpsat(params=...)`` takes them."""
        return dict(self.stair_params)


DEFAULT_POLICY = SearchPolicy()
