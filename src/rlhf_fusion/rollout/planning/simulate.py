"""Simulate generation + inference of one RLHF iteration, serial and with inter-stage fusion.

Pure numpy. Cost model of one instance:

* decode step with ``b`` running samples holding ``K`` KV tokens:
  ``step_base_s + step_per_sample_s * b + step_per_kv_token_s * K`` (weights + KV reads);
* admitting a sample: ``prefill_per_token_s * prompt_len``;
* Ref + Reward + Critic forward of one finished sample:
  ``infer_per_sample_s + infer_per_token_s * (prompt + response)``.

Serial: every instance generates its shard (sample i on instance i mod n, continuous batching
up to BS_max), inference starts when the last sample ends, each instance scoring its own shard.

Fused with threshold R_t: when R_t samples remain, the m = max(ceil(R_t/BS_max), ceil(R_t·M/C))
instances with most samples left take every unfinished sample (KV transfer or re-prefill,
whichever is cheaper); the others start inference on finished samples right away and on the
long-tail samples as each ends, joined by each destination when its generation is over.
Early triggers consolidate more samples on fewer instances (slower steps, fewer freed
instances); late triggers leave the freed instances idle longer: hence a U-shaped curve.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from ..types import RolloutConfigError
from .lengths import LengthDistribution
from .planner import (
    MovingSample,
    assign_migration,
    choose_mechanism,
    migration_costs,
    required_instances,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True)
class ClusterModel:
    """Costs of one generation instance and the cluster around it (seconds, tokens, bytes)."""

    instances: int
    bs_max: int
    step_base_s: float
    step_per_sample_s: float
    step_per_kv_token_s: float
    prefill_per_token_s: float
    infer_per_token_s: float
    infer_per_sample_s: float = 0.0
    kv_capacity_tokens: float | None = None
    kv_bytes_per_token: float = 0.0
    bandwidth_bytes_s: float = math.inf
    latency_s: float = 0.0
    prompt_len: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1 or self.bs_max < 1:
            raise RolloutConfigError("ClusterModel: instances and bs_max must be >= 1")
        if min(self.step_base_s, self.step_per_sample_s, self.step_per_kv_token_s,
               self.prefill_per_token_s, self.infer_per_token_s, self.infer_per_sample_s) < 0:
            raise RolloutConfigError("ClusterModel: costs must be >= 0")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _S:
    sid: int
    length: int       # total response tokens
    generated: int    # tokens produced so far
    prompt: int
    running: bool     # holds a batch slot (and its KV) now


def _run_instance(
    samples: list[_S], start: float, c: ClusterModel, stop_at: float | None = None
) -> tuple[dict[int, float], float]:
    """Continuous batching on one instance; finish time per sample and the generation end.

    ``samples`` is in admission order; running ones decode at once (up to BS_max), the rest
    wait, and admitting one costs a prefill unless it already has tokens (a migrated sample
    whose KV arrived or was rebuilt during the migration). With ``stop_at``, stops after the
    last whole step ending by then, leaving ``generated`` / ``running`` as at that moment.

    Event-driven: between two finishes every running sample advances by the same number of
    steps, so each segment is one closed-form sum. The running samples sit in a heap keyed by
    the step count at which each finishes, and their KV total is kept as a sum that grows by
    the batch size per step: O(n log n) per call, where re-reading the batch at every finish
    was O(n^2) (R_t's planner runs this hundreds of times per decision, between rollouts).
    """
    finish: dict[int, float] = {}
    t = start
    running = [s for s in samples if s.running]
    queue = deque(running[c.bs_max:] + [s for s in samples if not s.running])
    for s in queue:
        s.running = False
    steps_done = 0   # decode steps this instance has run since ``start``
    # (step count at which the sample finishes, admission order, sample, steps_done when it
    # was admitted with ``generated`` tokens): generated = that + steps_done - admitted
    heap: list[tuple[int, int, _S, int]] = []
    kv0 = 0          # sum over the running of (prompt + generated - 1 - steps_done) at entry
    order = 0

    def enter(s: _S) -> None:
        nonlocal kv0, order
        heapq.heappush(heap, (steps_done + s.length - s.generated, order, s, steps_done))
        kv0 += s.prompt + s.generated - 1 - steps_done
        order += 1

    def settle() -> None:
        # Write back each running sample's tokens so far (callers read them after stop_at).
        for _, _, s, at in heap:
            s.generated += steps_done - at

    for s in running[: c.bs_max]:
        enter(s)

    def admit() -> bool:
        nonlocal t
        while queue and len(heap) < c.bs_max:
            s = queue[0]
            cost = c.prefill_per_token_s * s.prompt if s.generated == 0 else 0.0
            if stop_at is not None and t + cost > stop_at:
                return False
            queue.popleft()
            t += cost
            s.running = True
            s.generated = max(s.generated, 1)  # the prefill emits the first token
            if s.generated >= s.length:
                finish[s.sid] = t
            else:
                enter(s)
        return True

    if not admit():
        settle()
        return finish, t
    while heap:
        b = len(heap)
        kv = kv0 + b * steps_done
        steps = heap[0][0] - steps_done
        base = c.step_base_s + c.step_per_sample_s * b + c.step_per_kv_token_s * kv
        grow = c.step_per_kv_token_s * b
        dur = steps * base + grow * steps * (steps - 1) / 2
        if stop_at is not None and t + dur > stop_at:
            j = np.arange(1, steps + 1)
            cum = j * base + grow * j * (j - 1) / 2
            done = int(np.searchsorted(cum, stop_at - t, side="right"))
            steps_done += done
            t += float(cum[done - 1]) if done else 0.0
            settle()
            return finish, t
        t += dur
        steps_done += steps
        while heap and heap[0][0] == steps_done:
            _, _, s, at = heapq.heappop(heap)
            s.generated += steps_done - at
            kv0 -= s.prompt + s.generated - 1 - steps_done
            finish[s.sid] = t
            s.running = False
        if not admit():
            settle()
            return finish, t
    return finish, t


def _infer_time(c: ClusterModel, prompt: int, length: int) -> float:
    return c.infer_per_sample_s + c.infer_per_token_s * (prompt + length)


@dataclass
class IterationResult:
    serial_s: float
    fused_s: float
    serial_generation_s: float
    fused_generation_s: float
    trigger_s: float
    m: int
    mechanism: str
    migrated: int
    # when each sample's scoring ends (fused run); groups read it (planning/groups.py)
    scored_at: dict[int, float] = field(default_factory=dict)


def _shards(n_samples: int, instances: int) -> list[list[int]]:
    return [list(range(i, n_samples, instances)) for i in range(instances)]


def simulate_serial(lengths: np.ndarray, c: ClusterModel) -> tuple[float, float, dict[int, float]]:
    """(total, generation end, finish time per sample) of the unfused iteration."""
    finish: dict[int, float] = {}
    infer = []
    for shard in _shards(len(lengths), c.instances):
        samples = [_S(i, int(lengths[i]), 0, c.prompt_len, False) for i in shard]
        f, _ = _run_instance(samples, 0.0, c)
        finish.update(f)
        infer.append(sum(_infer_time(c, c.prompt_len, int(lengths[i])) for i in shard))
    gen_end = max(finish.values())
    return gen_end + max(infer), gen_end, finish


def serial_scored_at(lengths: np.ndarray, c: ClusterModel) -> dict[int, float]:
    """When each sample's scoring ends in the unfused iteration: every instance scores its own
    shard, in order, from the end of the whole generation."""
    _, gen_end, _ = simulate_serial(lengths, c)
    out: dict[int, float] = {}
    for shard in _shards(len(lengths), c.instances):
        t = gen_end
        for i in shard:
            t += _infer_time(c, c.prompt_len, int(lengths[i]))
            out[i] = t
    return out


def simulate_fused(lengths: np.ndarray, c: ClusterModel, rt: int,
                   serial: tuple[float, float, dict[int, float]] | None = None,
                   mechanism: str | None = None, *, micro_batch: int = 1) -> IterationResult:
    """One iteration with migration at R_t remaining samples (``rt``). ``serial``: what
    :func:`simulate_serial` returns for these ``lengths`` and ``c``, when the caller has it
    (a sweep over R_t simulates the serial run once).

    ``micro_batch``: the scoring is handed out in micro-batches of this many samples, in the
    order they become ready (each ready when its last sample is; the last may be partial),
    as a rollout that scores in micro-batches does; the default 1 schedules single samples,
    the finest split, which R_t's planner and the bound use. A coarser split usually ends
    later: the last micro-batches leave a rank idle while another scores (the serial run's
    sums are the same either way, each rank scoring its shard in one stretch).

    Returns inf for ``fused_s`` when the configuration is infeasible (m >= instances).
    """
    if micro_batch < 1:
        raise RolloutConfigError(f"micro_batch must be >= 1, got {micro_batch}")
    n = len(lengths)
    serial_total, serial_gen, finish = serial if serial is not None else simulate_serial(
        lengths, c)
    longest = c.prompt_len + int(max(lengths))
    m = required_instances(rt, c.bs_max, longest, c.kv_capacity_tokens)
    if m >= c.instances:
        return IterationResult(serial_total, math.inf, serial_gen, math.inf, math.nan, m, "-", 0)
    order = sorted(finish.values())
    trigger = order[n - rt - 1] if n - rt - 1 >= 0 else 0.0
    # State of every instance at the trigger.
    unfinished: dict[int, list[_S]] = {}
    for inst, shard in enumerate(_shards(n, c.instances)):
        samples = [_S(i, int(lengths[i]), 0, c.prompt_len, False) for i in shard]
        done, _ = _run_instance(samples, 0.0, c, stop_at=trigger)
        unfinished[inst] = [s for s in samples if s.sid not in done]
    reports = {inst: [MovingSample(s.sid, s.prompt + max(s.generated - 1, 0),
                                   s.prompt + s.length) for s in ss]
               for inst, ss in unfinished.items()}
    plan = assign_migration(reports, m, bs_max=c.bs_max, kv_capacity_tokens=c.kv_capacity_tokens)
    by_id = {s.sid: s for ss in unfinished.values() for s in ss}
    # Each destination pauses to take its incoming context in (KV transfer or re-prefill).
    tokens_in = {d: sum(by_id[i].prompt + max(by_id[i].generated - 1, 0)
                        for ids in plan.incoming(d).values() for i in ids)
                 for d in plan.destinations}
    if mechanism is None:
        mechanism, _ = choose_mechanism(
            max(tokens_in.values(), default=0), kv_bytes_per_token=c.kv_bytes_per_token,
            bandwidth_bytes_s=c.bandwidth_bytes_s, latency_s=c.latency_s,
            prefill_s_per_token=c.prefill_per_token_s)
    tail_finish: dict[int, float] = {}
    gen_end: dict[int, float] = {}
    for d in plan.destinations:
        cost = migration_costs(
            tokens_in[d], kv_bytes_per_token=c.kv_bytes_per_token,
            bandwidth_bytes_s=c.bandwidth_bytes_s, latency_s=c.latency_s,
            prefill_s_per_token=c.prefill_per_token_s)[mechanism]
        own = unfinished[d]
        moved = [by_id[i] for ids in plan.incoming(d).values() for i in ids]
        for s in moved:
            s.running = False
        # As in ReferenceBackend.import_samples: imported samples queue ahead of never-started
        # ones, behind the running ones.
        samples = ([s for s in own if s.running] + [s for s in moved if s.generated > 0]
                   + [s for s in moved if s.generated == 0] + [s for s in own if not s.running])
        f, end = _run_instance(samples, trigger + cost, c)
        tail_finish.update(f)
        gen_end[d] = end
    # Inference: list scheduling over freed instances (from the trigger) and destinations (from
    # their generation end); a sample is ready at the trigger, or when it finishes if later.
    jobs = sorted((tail_finish.get(i, trigger), i) for i in range(n))
    workers = [trigger] * len(plan.freed) + [gen_end[d] for d in plan.destinations]
    heapq.heapify(workers)
    end = 0.0
    scored_at: dict[int, float] = {}
    for k in range(0, n, micro_batch):
        batch = jobs[k: k + micro_batch]
        free = heapq.heappop(workers)
        done_at = max(free, batch[-1][0]) + sum(_infer_time(c, c.prompt_len, int(lengths[i]))
                                                for _, i in batch)
        for _, i in batch:
            scored_at[i] = done_at
        end = max(end, done_at)
        heapq.heappush(workers, done_at)
    fused_gen = max(gen_end.values(), default=trigger)
    return IterationResult(serial_total, max(end, fused_gen), serial_gen, fused_gen, trigger, m,
                           mechanism, len(plan.moved_ids), scored_at)


@dataclass
class SweepPoint:
    rt: int
    fraction: float
    m: int
    fused_s: float
    serial_s: float
    mechanism: str

    @property
    def speedup(self) -> float:
        return self.serial_s / self.fused_s if self.fused_s > 0 else math.inf


@dataclass
class SweepResult:
    batch_size: int
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def feasible(self) -> list[SweepPoint]:
        return [p for p in self.points if math.isfinite(p.fused_s)]

    @property
    def best(self) -> SweepPoint:
        return self.choose(0.0)

    def choose(self, tolerance: float = 0.01, pick: str = "smallest") -> SweepPoint:
        """An R_t whose expected time is within ``tolerance`` of the minimum.

        ``pick="smallest"``: on a flat stretch of the curve, migrate fewer samples (less to
        move, less to go wrong). ``pick="middle"``: the middle of that stretch; noise in the
        costs moves the stretch's ends, its middle moves half as far, and it stays away from
        the ends of the sweep, where the simulator is least accurate (``benchmarks/
        interstage.py`` measured 25% of the batch faster than both 16% and 84%).
        """
        if not self.feasible:
            raise RolloutConfigError(
                "no R_t between 5% and 95% of the batch is feasible: every one needs m >= the "
                "number of instances; add instances or raise BS_max / the KV capacity")
        if pick not in ("smallest", "middle"):
            raise RolloutConfigError(f"pick={pick!r}: use 'smallest' or 'middle'")
        low = min(p.fused_s for p in self.feasible)
        near = sorted((p for p in self.feasible if p.fused_s <= low * (1 + tolerance)),
                      key=lambda p: p.rt)
        return near[0] if pick == "smallest" else near[(len(near) - 1) // 2]


def rt_grid(batch_size: int, lo: float = 0.05, hi: float = 0.95, points: int = 19) -> list[int]:
    """Distinct R_t values covering lo..hi of the batch."""
    fr = np.linspace(lo, hi, points)
    return sorted({min(batch_size, max(1, int(round(f * batch_size)))) for f in fr})


class SweepOptions(TypedDict, total=False):
    """The keyword arguments of :func:`sweep_rt` that :func:`plan_migration` passes through."""

    grid: Sequence[int] | None
    trials: int
    seed: int
    progress: bool


def sweep_rt(
    dist: LengthDistribution,
    c: ClusterModel,
    batch_size: int,
    *,
    grid: Sequence[int] | None = None,
    trials: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> SweepResult:
    """Mean fused and serial time per R_t over ``trials`` batches drawn from ``dist``.

    The same batches are used for every R_t (common random numbers), so the curve's shape is
    the effect of R_t and not of sampling noise.
    """
    if batch_size < 2:
        raise RolloutConfigError("batch_size must be >= 2")
    rng = np.random.default_rng(seed)
    batches = [dist.sample(batch_size, rng) for _ in range(trials)]
    grid = list(grid) if grid is not None else rt_grid(batch_size)
    serial = [simulate_serial(b, c) for b in batches]
    it = grid
    if progress:
        from tqdm import tqdm

        it = tqdm(grid, desc="simulating R_t", unit="R_t")
    out = SweepResult(batch_size)
    for rt in it:
        res = [simulate_fused(b, c, rt, serial=s)
               for b, s in zip(batches, serial, strict=True)]
        fused = float(np.mean([r.fused_s for r in res]))
        mech = max({r.mechanism for r in res}, key=[r.mechanism for r in res].count)
        out.points.append(SweepPoint(rt, rt / batch_size, res[0].m, fused,
                                     float(np.mean([s[0] for s in serial])), mech))
    return out


@dataclass
class MigrationPlan:
    """The planner's choice: trigger at R_t remaining samples, m destinations, a mechanism."""

    rt: int
    fraction: float
    m: int
    mechanism: str
    mechanism_reason: str
    fused_s: float
    serial_s: float
    sweep: SweepResult

    @property
    def speedup(self) -> float:
        return self.serial_s / self.fused_s

    def to_dict(self) -> dict:
        return {
            "rt": self.rt, "fraction": self.fraction, "m": self.m, "mechanism": self.mechanism,
            "mechanism_reason": self.mechanism_reason, "fused_s": self.fused_s,
            "serial_s": self.serial_s, "speedup": self.speedup,
            "curve": [{"rt": p.rt, "fraction": p.fraction, "m": p.m, "fused_s": p.fused_s,
                       "serial_s": p.serial_s, "mechanism": p.mechanism}
                      for p in self.sweep.points],
        }


def plan_migration(
    dist: LengthDistribution,
    c: ClusterModel,
    batch_size: int,
    *,
    tolerance: float = 0.01,
    pick: str = "smallest",
    **sweep_options: Unpack[SweepOptions],
) -> MigrationPlan:
    """Simulate R_t over 5%-95% of the batch (``sweep_options`` go to :func:`sweep_rt`) and
    pick an R_t within ``tolerance`` of the fastest (``pick``: see :meth:`SweepResult.choose`);
    m and the mechanism follow."""
    if c.instances < 2:
        raise RolloutConfigError(
            f"instances={c.instances}: inter-stage fusion needs at least 2 generation instances")
    sweep = sweep_rt(dist, c, batch_size, **sweep_options)
    best = sweep.choose(tolerance, pick)
    # Context a destination takes in: its share of the tail, each about as long as the length
    # quantile the tail has reached at the trigger.
    per_dest = math.ceil(best.rt / best.m)
    ctx = c.prompt_len + dist.quantile(1 - best.rt / batch_size)
    _, why = choose_mechanism(
        per_dest * ctx, kv_bytes_per_token=c.kv_bytes_per_token,
        bandwidth_bytes_s=c.bandwidth_bytes_s, latency_s=c.latency_s,
        prefill_s_per_token=c.prefill_per_token_s)
    return MigrationPlan(best.rt, best.fraction, best.m, best.mechanism, why, best.fused_s,
                         best.serial_s, sweep)
