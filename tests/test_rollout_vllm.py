"""VLLMBackend logic against a fake engine with vLLM's async semantics; real engine on GPU only."""

from __future__ import annotations

import importlib.util

import pytest

from rlhf_fusion.rollout import (
    CapabilityError,
    GenerationBackend,
    RolloutError,
    SampleSpec,
)
from rlhf_fusion.rollout.local import LocalFusedRollout
from rlhf_fusion.rollout.sampling import derive_seed
from rlhf_fusion.rollout.vllm_backend import VLLMBackend
from rlhf_fusion.testing.vllm import FakeAsyncEngine, FakeSamplingParams


def backend(instance_id=0, **kw):
    return VLLMBackend(FakeAsyncEngine(**kw), instance_id=instance_id,
                       sampling_params_cls=FakeSamplingParams)


def specs(lengths, stop=()):
    return [SampleSpec(i, [1, 2, 3], max_new_tokens=n, seed=4, stop_token_ids=stop)
            for i, n in enumerate(lengths)]


def test_streams_each_sample_when_it_finishes():
    b = backend(tick_s=0.002)
    assert isinstance(b, GenerationBackend)
    b.submit(specs([40, 3, 12, 1]))
    got = list(b.results())
    assert [r.sample_id for r in got] == [3, 1, 2, 0]
    assert [len(r.token_ids) for r in got] == [1, 3, 12, 40]
    assert all(len(r.logprobs) == len(r.token_ids) for r in got)
    params = {rid: p for rid, _, p in b.engine.requests}
    assert all(p.ignore_eos and p.logprobs == 0 for p in params.values())
    assert sorted(p.seed for p in params.values()) == sorted(
        derive_seed(4, i, 0) for i in range(4))
    b.close()


def test_stop_tokens():
    b = backend()
    b.submit(specs([60] * 5, stop=(5, 6, 7, 8, 9, 10)))
    res = list(b.results())
    assert any(r.finish_reason == "stop" for r in res)
    for r in res:
        assert r.finish_reason == "length" or r.token_ids[-1] in range(5, 11)
    b.close()


@pytest.mark.parametrize("cancel", [False, True])
def test_recompute_migration_is_exactly_once_and_keeps_the_budget(cancel):
    src, dst = backend(0, tick_s=0.002, cancel_on_abort=cancel), backend(1)
    batch = specs([200, 150, 2, 1])
    src.submit(batch)
    first = []
    while len(first) < 2:
        first += src.step()
    with pytest.raises(CapabilityError, match="mode='tokens'"):
        src.export_samples([0], mode="kv")
    tickets = src.export_samples([0, 1, 2, 99], mode="tokens")
    assert {t.sample_id for t in tickets} == {0, 1}
    assert src.unfinished() == [] and list(src.results()) == []
    for t in tickets:
        assert 0 < len(t.spec.generated_ids) < t.spec.max_new_tokens and t.spec.kv is None
    dst.import_samples(tickets)
    moved = {r.sample_id: r for r in dst.results()}
    assert sorted(moved) == [0, 1] and all(r.migrated for r in moved.values())
    for t in tickets:
        r = moved[t.sample_id]
        g = len(t.spec.generated_ids)
        assert r.token_ids[:g] == t.spec.generated_ids and r.logprobs[:g] == t.spec.logprobs
        assert len(r.token_ids) == t.spec.max_new_tokens
    # The resubmission: prompt + generated ids, remaining budget, derived seed.
    for rid, prompt, p in dst.engine.requests:
        t = next(t for t in tickets if rid.split("-")[2] == str(t.sample_id))
        g = len(t.spec.generated_ids)
        assert prompt == [1, 2, 3] + list(t.spec.generated_ids)
        assert p.max_tokens == t.spec.max_new_tokens - g
        assert p.seed == derive_seed(4, t.sample_id, g)
    src.close()
    dst.close()


def test_finished_before_abort_stays_here():
    b = backend(tick_s=0.0)
    b.submit(specs([3]))
    b.wait_idle()
    assert b.export_samples([0]) == []
    assert [r.sample_id for r in b.step()] == [0]
    b.close()


def test_abort_kv_import_weights_sleep():
    b = backend(tick_s=0.002)
    b.submit(specs([100, 100]))
    b.abort([1])
    assert b.unfinished() == [0]
    with pytest.raises(RolloutError, match="unfinished"):
        b.update_weights({"w": 1})
    with pytest.raises(RolloutError, match="unfinished"):
        b.sleep()
    assert [r.sample_id for r in b.results()] == [0]
    b.update_weights({"w": 1})
    assert b.engine.rpc == [("rlhf_fusion_load_weights", ([("w", 1)],))]
    b.sleep()
    assert b.engine.asleep
    b.wake_up()
    assert not b.engine.asleep
    kv_spec = SampleSpec(5, [1], 4, generated_ids=(3,), logprobs=(-1.0,), kv=object())
    from rlhf_fusion.rollout import MigrationTicket

    with pytest.raises(CapabilityError, match="kv_transfer"):
        b.import_samples([MigrationTicket(kv_spec, "kv")])
    b.close()


def test_fused_rollout_over_vllm_backends_loses_nothing():
    batch = specs([3, 80, 2, 90, 1, 4, 2, 70])
    backends = [backend(i, tick_s=0.001) for i in range(3)]
    out = LocalFusedRollout(backends, rt=3, mechanism="tokens", bs_max=8).run(batch)
    assert [r.sample_id for r in out.results] == list(range(8))
    for r, s in zip(out.results, batch, strict=True):
        assert len(r.token_ids) == s.max_new_tokens
    with pytest.raises(CapabilityError, match="tokens"):
        LocalFusedRollout([backend(0), backend(1)], rt=2, mechanism="kv")
    for b in backends:
        b.close()


def test_missing_vllm_names_the_extra():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(ImportError, match=r'pip install "rlhf-fusion\[vllm\]"'):
        VLLMBackend(model="some/model")


@pytest.mark.gpu
def test_real_vllm_engine_streams_and_migrates(tmp_path):
    pytest.importorskip("vllm")
    from rlhf_fusion.testing import build_causal_lm, tiny_config

    model = build_causal_lm(tiny_config(vocab_size=512, hidden_size=64, layers=2), seed=0)
    model.save_pretrained(tmp_path / "tiny")
    kw = {"enforce_eager": True, "gpu_memory_utilization": 0.2, "skip_tokenizer_init": True,
          "dtype": "float32"}
    a = VLLMBackend(model=str(tmp_path / "tiny"), engine_kwargs=kw, instance_id=0)
    b = VLLMBackend(model=str(tmp_path / "tiny"), engine_kwargs=kw, instance_id=1)
    a.submit(specs([64, 2, 48]))
    done = []
    while len(done) < 1:
        done += a.step()
    b.import_samples(a.export_samples(a.unfinished(), mode="tokens"))
    done += list(a.results()) + list(b.results())
    assert sorted(r.sample_id for r in done) == [0, 1, 2]
    assert all(len(r.token_ids) == n for r, n in zip(sorted(done, key=lambda r: r.sample_id),
                                                      [64, 2, 48], strict=True))
