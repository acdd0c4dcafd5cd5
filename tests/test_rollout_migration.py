"""Nothing lost, nothing twice: fused (migrated) rollouts equal the serial, unmigrated run.

In-process: several ReferenceBackend instances driven by LocalFusedRollout, which takes the
same decisions (plan, wire format) as the distributed coordinator.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_fusion.rollout import RolloutConfigError, SampleSpec
from rlhf_fusion.rollout.inference import InferenceModels
from rlhf_fusion.rollout.local import LocalFusedRollout
from rlhf_fusion.rollout.reference import ReferenceBackend
from rlhf_fusion.testing import build_causal_lm, build_value_model, tiny_config

VOCAB = 48
CFG = tiny_config(vocab_size=VOCAB, hidden_size=32, layers=2, heads=4, kv_heads=2)
ACTOR = build_causal_lm(CFG, seed=1)
INFER = InferenceModels(build_causal_lm(CFG, 2), build_value_model(CFG, 3),
                        build_value_model(CFG, 4), micro_batch=3)
TOL = 1e-5  # the bar: logprobs (and scores) within 1e-5 of the serial run


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    # Thousands of tiny forwards: with 2+ intra-op threads on a loaded 2-core machine each
    # matmul waits on a busy peer thread, which made this module ~100x slower (737 s loaded).
    # Serial and fused runs both use one thread, so what is compared does not change.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def backends(n, bs_max, block_size=4):
    return [ReferenceBackend(ACTOR, instance_id=i, max_batch_size=bs_max, block_size=block_size)
            for i in range(n)]


def assert_same(serial, fused):
    assert [r.sample_id for r in fused.results] == [r.sample_id for r in serial.results]
    for a, b in zip(serial.results, fused.results, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert len(b.logprobs) == len(b.token_ids)
        assert max([abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)] + [0]) < TOL
    assert [e.sample_id for e in fused.experiences] == [r.sample_id for r in serial.results]
    for a, b in zip(serial.experiences, fused.experiences, strict=True):
        assert a.response_ids == b.response_ids
        for field in ("logprobs", "ref_logprobs", "values"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.shape == y.shape
            if x.numel():
                assert torch.max(torch.abs(x - y)).item() < TOL
        assert abs(a.reward - b.reward) < TOL


@st.composite
def workloads(draw):
    n = draw(st.integers(2, 4))
    bs_max = draw(st.integers(2, 6))
    # Long-tailed on purpose: mostly short responses, a few long ones.
    lengths = draw(st.lists(st.one_of(st.integers(1, 6), st.integers(7, 40)),
                            min_size=n, max_size=14))
    prompts = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                            min_size=len(lengths), max_size=len(lengths)))
    stop = draw(st.sampled_from([(), (7,)]))
    temp = draw(st.sampled_from([1.0, 0.7, 0.0]))
    specs = [SampleSpec(i, p, max_new_tokens=m, seed=5, temperature=temp, stop_token_ids=stop)
             for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))]
    rt = draw(st.integers(1, min(len(specs), bs_max * (n - 1))))
    report_every = draw(st.integers(1, 3))
    return n, bs_max, specs, rt, report_every


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(["kv", "tokens"]))
def test_fused_equals_serial(workload, mechanism):
    n, bs_max, specs, rt, report_every = workload
    serial = LocalFusedRollout(backends(n, bs_max), INFER).run(specs)
    fused = LocalFusedRollout(backends(n, bs_max, block_size=3), INFER, rt=rt,
                              mechanism=mechanism, report_every=report_every).run(specs)
    assert_same(serial, fused)
    plan = fused.assignment
    if plan is not None:
        moved = set(plan.moved_ids)
        assert all(r.migrated == (r.sample_id in moved) for r in fused.results)
        assert len(plan.destinations) <= fused.stats["m"] and plan.freed


def test_migration_actually_moves_samples_in_both_mechanisms():
    """A fixed long-tailed case, so the property above is known to exercise real moves."""
    tail = {1: 40, 2: 36, 4: 30, 5: 38}
    specs = [SampleSpec(i, [i % VOCAB, 3], max_new_tokens=tail.get(i, 2 + i % 3), seed=9)
             for i in range(12)]
    serial = LocalFusedRollout(backends(3, 4), INFER).run(specs)
    for mech in ("kv", "tokens"):
        fused = LocalFusedRollout(backends(3, 4), INFER, rt=4, mechanism=mech).run(specs)
        assert fused.assignment is not None and len(fused.assignment.moved_ids) >= 2
        assert sum(r.migrated for r in fused.results) == len(fused.assignment.moved_ids)
        assert_same(serial, fused)


def test_bad_configurations_name_the_fix():
    specs = [SampleSpec(i, [1], max_new_tokens=5) for i in range(6)]
    with pytest.raises(RolloutConfigError, match="outside the batch"):
        LocalFusedRollout(backends(2, 4), rt=7).run(specs)
    with pytest.raises(RolloutConfigError, match="lower R_t"):
        LocalFusedRollout(backends(2, 2), rt=5).run(specs)  # needs m = 3 > 1
    with pytest.raises(RolloutConfigError, match="at least 2"):
        LocalFusedRollout(backends(1, 4), rt=2).run(specs)
    with pytest.raises(RolloutConfigError, match="set m >= 2"):
        LocalFusedRollout(backends(3, 2), rt=4, m=1).run(specs)
    with pytest.raises(RolloutConfigError, match="unique"):
        LocalFusedRollout(backends(2, 4)).run(specs + specs[:1])
