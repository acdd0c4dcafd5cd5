"""R_t control for a running job (RLHFuse §4.2): simulate, refine every iteration, converge.

Used by the PPO loop and the TRL trainers. The simulator
(:mod:`rlhf_fusion.rollout.planning.simulate`, torch-free) needs two things a job learns as it
runs: the response-length distribution (refined with every batch's lengths) and the
instance costs (fitted to every decode step timed so far, and to the scoring of the last
``SCORING_WINDOW`` batches). They accumulate over iterations, so one noisy step moves them
little; the decode fit uses per-batch-size medians, and
the choice keeps the previous R_t while it is within ``STICKY`` of the best, so the chosen
R_t settles instead of wandering with timing noise. Rank 0 decides and broadcasts: every rank
must trigger on the same R_t. A sweep runs on the rollout's critical path, so sweeps come
rarer while they keep the same choice, and never cost more than ``SWEEP_BUDGET`` of the
rollout time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .planning.lengths import LengthDistribution
from .planning.simulate import ClusterModel, plan_migration

# The sweep's curve is flat near its minimum, and timing noise must not move the choice along
# it: take the middle of the R_t values within TOLERANCE of the best simulated time (see
# SweepResult.choose), and keep the current R_t while it is within STICKY of the best.
TOLERANCE = 0.05
STICKY = 0.05
# Scoring is priced from the last few batches' scoring calls, not from every call since the
# start: the whole history's average priced the GRPO demo's later batches 23% below their
# measured scoring (session 47, the analysis). A forward's cost is mostly per call, so the fit
# has a cost per sample beside the cost per token: priced per token alone, a window whose
# completions were longer than the next batch's priced its scoring 14% low (the median of the
# demo's iterations 1-13, where its completions shorten fastest; session 54).
SCORING_WINDOW = 4
# R_t before any length has been seen: a quarter of the batch (RLHFuse's sweeps put the best
# R_t at 20-40 % of the batch for long-tailed lengths).
FIRST_FRACTION = 0.25
# No migration unless the simulator predicts at least this gain over the serial rollout: it
# does not model the stream's per-sample store traffic or the trigger polling, and a gain
# below this is within them (and within float noise when nothing is long-tailed).
MIN_GAIN = 0.01
# Weight of the newest batch when the length distribution is refined.
REFINE_WEIGHT = 0.5
# A sweep simulates about a hundred rollouts (20 ms for 64 samples on one CPU core), and it
# runs on the rollout's critical path: every rank waits for rank ``src``'s choice. While the
# sweep keeps choosing the R_t already in use, the iterations between sweeps double, up to
# this many; a sweep that moves R_t sets them back to one.
REPLAN_MAX = 8
# ... and however often it keeps choosing, a sweep runs at most once per this share of the
# rollout time it plans for: on a small batch of short completions (the GRPO demo on 2 CPU
# cores) a sweep of 128 samples took 80-110 ms against rollouts of 70-250 ms, and at every
# REPLAN_MAX-th iteration it cost `rt: auto` 13% of its rollout time (0.95x the serial rollout
# where R_t fixed at the sweep's own choice gave 1.10x; session 52, the analysis). Rank
# ``src`` times its sweep and sends the interval it implies with its choice, so every rank
# skips the same iterations.
SWEEP_BUDGET = 0.02
# A cap on that interval: a run whose lengths change still gets a sweep now and then.
SWEEP_INTERVAL_MAX = 64


class TimedBackend:
    """A GenerationBackend that records ``(running samples, seconds)`` of every decode step,
    and the thread CPU time the steps took (``cpu_s``): wall above CPU is time the step
    waited for a core.

    A step that starts with nothing running and admits new samples (a rollout's first)
    prefills them before it decodes: on the demo's CPU it took 13-20 ms against 2-3 ms for a
    decode step. Its index goes to ``prefill_steps`` and ``(samples admitted, seconds)`` to
    ``prefills``, so that the planner fits decode steps and prefills apart (a backend that
    does not say how many samples run, ``num_active``, records none)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.steps: list[tuple[int, float]] = []
        self.prefill_steps: set[int] = set()
        self.prefills: list[tuple[int, float]] = []
        self.cpu_s = 0.0

    def step(self) -> Any:
        active = getattr(self._inner, "num_active", None)
        # unfinished() sorts every sample id: only when nothing runs (or nothing says so)
        waiting = 0 if active else len(self._inner.unfinished())
        b = active or waiting
        c = time.thread_time()
        t = time.perf_counter()
        out = self._inner.step()
        s = time.perf_counter() - t
        if active == 0 and waiting > 0:
            admitted = waiting - (len(self._inner.unfinished()) - self._inner.num_active)
            if admitted > 0:
                self.prefill_steps.add(len(self.steps))
                self.prefills.append((admitted, s))
        self.steps.append((b, s))
        self.cpu_s += time.thread_time() - c
        return out

    def reset_timing(self) -> None:
        self.steps = []
        self.prefill_steps = set()
        self.prefills = []
        self.cpu_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


#: One scoring call: (samples, tokens = prompt + response over its samples, seconds).
ScoringCall = tuple[int, int, float]


def scoring_call(samples: Sequence[Any], seconds: float) -> ScoringCall:
    """The :data:`ScoringCall` of a call that scored ``samples`` (``SampleResult`` s)."""
    return (len(samples), sum(len(s.prompt_ids) + len(s.token_ids) for s in samples), seconds)


def fit_scoring(calls: Sequence[ScoringCall]) -> tuple[float, float] | None:
    """``(seconds per sample, seconds per token)``, both >= 0, the least-squares fit of
    ``seconds = per_sample * samples + per_token * tokens`` over ``calls``; None without a
    call. Calls whose tokens go with their samples alone (every sample equally long) cannot
    split the two: all goes to the cost per token, as the simulator's lengths then say."""
    n = [float(c[0]) for c in calls]
    k = [float(c[1]) for c in calls]
    y = [float(c[2]) for c in calls]
    snn, skk, snk = sum(a * a for a in n), sum(b * b for b in k), sum(a * b for a, b in zip(n, k))
    sny, sky = sum(a * c for a, c in zip(n, y)), sum(b * c for b, c in zip(k, y))
    if not skk:
        return (sny / snn, 0.0) if snn else None
    det = snn * skk - snk * snk
    if det > 1e-9 * snn * skk:
        per_sample = (sny * skk - sky * snk) / det
        per_token = (sky * snn - sny * snk) / det
        if per_sample >= 0 and per_token >= 0:
            return per_sample, per_token
        if per_token < 0:   # (the best fit with one term at zero)
            return sny / snn, 0.0
    return 0.0, max(sky / skk, 0.0)


def timed_scoring(score: Callable[[Sequence[Any]], Any], log: list[ScoringCall],
                  cpu: list[float] | None = None) -> Callable[[Sequence[Any]], Any]:
    """Wrap ``InferenceModels.score`` to log a :data:`ScoringCall` per call (and its thread
    CPU seconds to ``cpu``)."""

    def run(samples: Sequence[Any]) -> Any:
        c = time.thread_time()
        t = time.perf_counter()
        out = score(samples)
        log.append(scoring_call(samples, time.perf_counter() - t))
        if cpu is not None:
            cpu.append(time.thread_time() - c)
        return out

    return run


class RtPlanner:
    """R_t for a batch of ``batch`` samples on ``world`` generation instances of ``bs_max``;
    ``fixed`` (samples) short-cuts the simulation. ``src``: the rank that decides (a
    generation instance, whose decode steps the planner has timed)."""

    def __init__(self, batch: int, world: int, *, bs_max: int,
                 kv_capacity_tokens: int | None = None, fixed: int | None = None,
                 src: int = 0) -> None:
        self.world = world
        self.src = src
        self.batch = batch
        self.bs_max = bs_max
        self.kv_capacity_tokens = kv_capacity_tokens
        self.fixed = fixed
        self.dist: LengthDistribution | None = None
        self.by_batch: dict[int, list[float]] = defaultdict(list)
        # (samples admitted, seconds) of the steps that prefilled them (TimedBackend.prefills)
        self.prefills: list[tuple[int, float]] = []
        # the scoring calls of each observed batch, the last SCORING_WINDOW batches
        self.scoring: list[list[ScoringCall]] = []
        self.prompt_len = 0
        # the last observed rollout's seconds (generation + scoring), what a sweep's cost is
        # weighed against (SWEEP_BUDGET); None until a caller reports one
        self.rollout_s: float | None = None
        # seconds this rank spent in the last rt()'s sweep (0: no sweep here), the loop's
        # time/rt_sweep
        self.last_sweep_s = 0.0
        self.current: int | None = None
        self.history: list[int] = []
        self.sweeps = 0          # simulated decisions so far
        self._interval = 1       # iterations from one sweep to the next
        self._skip = 0           # iterations left before the next sweep

    def observe(self, lengths: Sequence[int], backend: TimedBackend,
                scoring: Sequence[ScoringCall] = (), prompt_len: float = 0.0,
                rollout_s: float | None = None) -> None:
        """One rollout's lengths, timed decode steps and scoring calls; ``rollout_s``: its
        seconds, which keep the sweeps within ``SWEEP_BUDGET`` of the rollout time."""
        if rollout_s is not None and rollout_s > 0:
            self.rollout_s = float(rollout_s)
        lengths = [max(1, int(x)) for x in lengths]
        if lengths:
            self.dist = (LengthDistribution(lengths) if self.dist is None
                         else self.dist.refine(lengths, REFINE_WEIGHT))
        skip = getattr(backend, "prefill_steps", ())
        for i, (b, s) in enumerate(backend.steps):
            if i not in skip:
                self.by_batch[b].append(s)
        self.prefills.extend(getattr(backend, "prefills", ()))
        if scoring:
            self.scoring.append([tuple(c) for c in scoring])  # type: ignore[misc]
            del self.scoring[:-SCORING_WINDOW]
        self.prompt_len = int(prompt_len)

    def cluster(self) -> ClusterModel:
        """Instance costs: decode fitted to the medians of the decode steps, per running-batch
        size; scoring to the last ``SCORING_WINDOW`` batches' calls (:func:`fit_scoring`)."""
        pts = [(b, statistics.median(v)) for b, v in sorted(self.by_batch.items()) if v]
        if len(pts) >= 2:
            mx = statistics.fmean(b for b, _ in pts)
            my = statistics.fmean(s for _, s in pts)
            var = sum((b - mx) ** 2 for b, _ in pts)
            slope = max(sum((b - mx) * (s - my) for b, s in pts) / var, 0.0) if var else 0.0
            base = max(my - slope * mx, 1e-6)
        else:
            slope, base = 0.0, pts[0][1] if pts else 1e-3
        calls = [c for batch in self.scoring for c in batch]
        fit = fit_scoring(calls)
        infer_sample, infer_token = fit if fit is not None else (0.0, base / 16)
        # A prefill step also decodes the samples it admits: what it costs above that decode
        # step, per admitted sample and prompt token (samples that share a prompt, a GRPO
        # group, share its prefill, and this measures it so). Before one is timed: a third of
        # a scored token's average cost, a forward over it without the logits' work.
        tokens = sum(c[1] for c in calls)
        prefill = (sum(c[2] for c in calls) / tokens if tokens else base / 16) / 3
        if self.prefills:
            per_admitted = statistics.median(
                max(s - (base + slope * n), 0.0) / n for n, s in self.prefills)
            prefill = per_admitted / max(self.prompt_len, 1)
        return ClusterModel(
            instances=self.world, bs_max=self.bs_max, step_base_s=base,
            step_per_sample_s=slope, step_per_kv_token_s=0.0,
            prefill_per_token_s=prefill, infer_per_token_s=infer_token,
            infer_per_sample_s=infer_sample, kv_capacity_tokens=self.kv_capacity_tokens,
            prompt_len=self.prompt_len)

    def _decide(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.dist is None:
            return max(1, round(FIRST_FRACTION * self.batch))
        self.sweeps += 1
        plan = plan_migration(self.dist, self.cluster(), self.batch, trials=4, seed=0,
                              tolerance=TOLERANCE, pick="middle")
        # No migration (R_t = 0, the serial rollout) whenever the simulator predicts no gain
        # (MIN_GAIN) from any R_t; coming back takes twice that, so noise cannot flap.
        top = plan.sweep.best
        need = 2 * MIN_GAIN if self.current == 0 else MIN_GAIN
        if top.fused_s > top.serial_s * (1 - need):
            return 0
        best = plan.rt
        if self.current is not None:
            now = next((p for p in plan.sweep.feasible if p.rt == self.current), None)
            if now is not None and now.fused_s <= plan.fused_s * (1 + STICKY):
                best = self.current
        return best

    def _budget_interval(self, sweep_s: float) -> int:
        """The iterations from this sweep to the next that keep the sweeps' time within
        ``SWEEP_BUDGET`` of the rollouts' (1 until a rollout time has been observed)."""
        if not self.rollout_s:
            return 1
        # (less a hair: a quotient of whole multiples must not round up past its value)
        return max(1, min(math.ceil(sweep_s / (SWEEP_BUDGET * self.rollout_s) - 1e-9),
                          SWEEP_INTERVAL_MAX))

    def rt(self) -> int:
        """R_t for the next rollout, 0 for no migration (the serial rollout); collective when
        distributed and simulated (rank ``src`` decides). Between sweeps (``REPLAN_MAX``, or
        more where a sweep would take over ``SWEEP_BUDGET`` of the rollout time) every rank
        keeps the R_t in use without a round trip: rank ``src`` sends the interval with its
        choice, so each counts the same iterations."""
        self.last_sweep_s = 0.0
        if self.fixed is None and self._skip > 0 and self.current is not None:
            self._skip -= 1
            self.history.append(self.current)
            return self.current
        swept = self.fixed is None and self.dist is not None
        box: list[Any] = [None, 1]
        if not dist.is_initialized() or dist.get_rank() == self.src or self.fixed is not None:
            t = time.perf_counter()
            box[0] = self._decide()
            if swept:
                self.last_sweep_s = time.perf_counter() - t
                box[1] = self._budget_interval(self.last_sweep_s)
        if dist.is_initialized() and self.fixed is None:
            # Only a simulated R_t needs rank src's decision (the others observed other
            # timings); a fixed one is the same config on every rank, so no round trip.
            dist.broadcast_object_list(box, src=self.src)
        value = int(box[0])
        if swept:
            same = value == self.current
            self._interval = max(min(2 * self._interval, REPLAN_MAX) if same else 1,
                                 int(box[1]))
            self._skip = self._interval - 1
        self.current = value
        self.history.append(self.current)
        return self.current
