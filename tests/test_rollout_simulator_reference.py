"""The simulator's instance model (``_run_instance``: a heap of finish steps, a running KV sum)
against the direct one it replaced (every running sample re-read at every finish), kept here as
the reference: the same finish times, bit for bit, the same end, the same state left behind
at ``stop_at``; and a sweep over R_t that equals one simulating the serial run per point."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from rlhf_fusion.rollout.planning import ClusterModel, LengthDistribution, sweep_rt
from rlhf_fusion.rollout.planning import simulate as sim


def reference_run_instance(samples, start, c, stop_at=None):
    """The direct model, as it was before the heap (commit 5fb08e9)."""
    finish = {}
    t = start
    running = [s for s in samples if s.running]
    active = running[: c.bs_max]
    queue = running[c.bs_max:] + [s for s in samples if not s.running]
    for s in queue:
        s.running = False

    def admit():
        nonlocal t
        while queue and len(active) < c.bs_max:
            s = queue[0]
            cost = c.prefill_per_token_s * s.prompt if s.generated == 0 else 0.0
            if stop_at is not None and t + cost > stop_at:
                return False
            queue.pop(0)
            t += cost
            s.running = True
            s.generated = max(s.generated, 1)
            if s.generated >= s.length:
                finish[s.sid] = t
            else:
                active.append(s)
        return True

    if not admit():
        return finish, t
    while active:
        b = len(active)
        kv = sum(s.prompt + s.generated - 1 for s in active)
        steps = min(s.length - s.generated for s in active)
        base = c.step_base_s + c.step_per_sample_s * b + c.step_per_kv_token_s * kv
        grow = c.step_per_kv_token_s * b
        dur = steps * base + grow * steps * (steps - 1) / 2
        if stop_at is not None and t + dur > stop_at:
            j = np.arange(1, steps + 1)
            cum = j * base + grow * j * (j - 1) / 2
            done = int(np.searchsorted(cum, stop_at - t, side="right"))
            for s in active:
                s.generated += done
            t += float(cum[done - 1]) if done else 0.0
            return finish, t
        t += dur
        for s in active:
            s.generated += steps
        for s in [s for s in active if s.generated >= s.length]:
            finish[s.sid] = t
            s.running = False
        active = [s for s in active if s.generated < s.length]
        if not admit():
            return finish, t
    return finish, t


def _case(rng: random.Random):
    n = rng.randint(1, 40)
    c = ClusterModel(instances=1, bs_max=rng.choice([1, 3, 8, 64]),
                     step_base_s=rng.uniform(1e-3, 2e-2), step_per_sample_s=rng.uniform(0, 1e-3),
                     step_per_kv_token_s=rng.choice([0.0, rng.uniform(0, 1e-5)]),
                     prefill_per_token_s=rng.uniform(0, 1e-4), infer_per_token_s=1e-4,
                     prompt_len=rng.randint(1, 30))
    samples = []
    for i in range(n):
        length = rng.randint(1, 200)
        generated = rng.choice([0, 0, rng.randint(0, length)])
        samples.append(sim._S(i, length, generated, rng.randint(1, 30),
                              running=generated > 0 and rng.random() < 0.7))
    stop_at = rng.choice([None, rng.uniform(0.0, 0.5)])
    return samples, rng.uniform(0, 0.1), c, stop_at


@pytest.mark.parametrize("seed", range(300))
def test_instance_model_equals_the_direct_one(seed):
    samples, start, c, stop_at = _case(random.Random(seed))
    a = [dataclasses.replace(s) for s in samples]
    b = [dataclasses.replace(s) for s in samples]
    got = sim._run_instance(a, start, c, stop_at)
    want = reference_run_instance(b, start, c, stop_at)
    assert got[1] == want[1]
    assert list(got[0].items()) == list(want[0].items())   # times exact, in the same order
    assert a == b   # generated / running as the reference leaves them


def test_a_sweep_equals_simulating_the_serial_run_at_every_point():
    c = ClusterModel(instances=4, bs_max=16, step_base_s=0.01, step_per_sample_s=1e-4,
                     step_per_kv_token_s=1e-7, prefill_per_token_s=1e-5,
                     infer_per_token_s=2e-4, prompt_len=64)
    dist = LengthDistribution.lognormal(120, 0.8, max_len=1024)
    sweep = sweep_rt(dist, c, 64, trials=3, seed=1)
    rng = np.random.default_rng(1)
    batches = [dist.sample(64, rng) for _ in range(3)]
    for p in sweep.points:
        direct = [sim.simulate_fused(b, c, p.rt) for b in batches]
        assert p.fused_s == float(np.mean([r.fused_s for r in direct]))
