"""VLLMBackend logic against the fake engine (vLLM's async semantics, kept honest by
tests/test_vllm_contract.py); the same backend over real vLLM engines is tests/test_vllm_real.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhf_fusion.rollout import (
    CapabilityError,
    GenerationBackend,
    RolloutError,
    SampleSpec,
)
from rlhf_fusion.rollout.local import LocalFusedRollout
from rlhf_fusion.rollout.sampling import derive_seed
from rlhf_fusion.rollout.vllm_backend import VLLMBackend
from rlhf_fusion.testing.vllm import FakeAsyncLLM, FakeSamplingParams, fake_vllm_module


def backend(instance_id=0, **kw):
    return VLLMBackend(FakeAsyncLLM(**kw), instance_id=instance_id,
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


def test_recompute_migration_is_exactly_once_and_keeps_the_budget():
    src, dst = backend(0, tick_s=0.002), backend(1)
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
        b.update_weights({"w": torch.ones(2)})
    with pytest.raises(RolloutError, match="unfinished"):
        b.sleep()
    assert [r.sample_id for r in b.results()] == [0]
    b.update_weights({"w": torch.ones(2)})
    assert b.engine.rpc[-1][0] == "rlhf_fusion_load_weights" and b.engine.loaded == ["w"]
    b.sleep()
    assert b.engine.asleep
    with pytest.raises(RolloutError, match="asleep"):
        b.submit(specs([3]))
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


# -- vLLM's abort semantics: an abort output is never a finished sample -------------------------


def test_export_mid_stream_migrates_the_sample_it_does_not_emit_it_cut():
    """vLLM answers an abort with a last output (finished, finish_reason "abort"): the export
    turns it into a ticket with every token and logprob so far; nothing is emitted here."""
    b = backend(tick_s=0.002)
    b.submit(specs([200]))
    while not b.progress()[0].generated:
        b.step()
    (ticket,) = b.export_samples([0])
    g = len(ticket.spec.generated_ids)
    assert 0 < g < 200 and len(ticket.spec.logprobs) == g
    rid, _, _ = b.engine.requests[0]
    assert ticket.spec.generated_ids == tuple(_tokens_of(b, rid)[:g])
    assert list(b.results()) == [] and b.unfinished() == []
    b.close()


def _tokens_of(b, rid):
    """The tokens the engine generated for ``rid`` (replayed: the fake is deterministic)."""
    import asyncio

    eng = FakeAsyncLLM(vocab=b.engine.vocab, tick_s=0)
    _, prompt, params = next(r for r in b.engine.requests if r[0] == rid)

    async def run():
        outs = [o async for o in eng.generate({"prompt_token_ids": prompt}, params, rid)]
        return list(outs[-1].outputs[0].token_ids)

    return asyncio.run(run())


def test_abort_drops_the_abort_output():
    b = backend(tick_s=0.002)
    b.submit(specs([200, 5]))
    b.abort([0])
    assert [r.sample_id for r in b.results()] == [1]
    assert b.unfinished() == []
    b.close()


def test_a_sample_finished_before_the_abort_landed_is_emitted_once():
    b = backend(tick_s=0.0)
    b.submit(specs([3, 4]))
    b.wait_idle()
    assert b.export_samples([0, 1]) == []
    got = b.step() + b.step()
    assert sorted(r.sample_id for r in got) == [0, 1]
    assert [len(r.token_ids) for r in sorted(got, key=lambda r: r.sample_id)] == [3, 4]
    assert b.step() == [] and b.unfinished() == []
    b.close()


def test_an_abort_we_did_not_ask_for_is_an_error_not_a_sample():
    import asyncio

    b = backend(tick_s=0.002)
    b.submit(specs([200]))
    while not b.progress()[0].generated:
        b.step()
    rid = b.engine.requests[0][0]
    asyncio.run_coroutine_threadsafe(b.engine.abort(rid), b._loop).result(5)
    with pytest.raises(RolloutError, match="finish_reason='abort'"):
        for _ in range(1000):
            assert b.step() == []
    b.close()


def test_migration_with_position_seeding_equals_no_migration():
    """Position seeding keys each draw on (seed, sample, position): a migrated sample (at
    temperature 1) draws the tokens it would have drawn unmoved."""
    batch = [SampleSpec(i, [1, 2, i], max_new_tokens=n, seed=4, temperature=1.0)
             for i, n in enumerate([3, 80, 2, 90, 1, 4, 2, 70])]
    one = backend(0)
    assert one.capabilities.exact_migration
    one.submit(batch)
    unmoved = {r.sample_id: r for r in one.results()}
    backends = [backend(i, tick_s=0.001) for i in range(3)]
    out = LocalFusedRollout(backends, rt=3, mechanism="tokens", bs_max=8).run(batch)
    assert any(r.migrated for r in out.results)
    for r in out.results:
        assert r.token_ids == unmoved[r.sample_id].token_ids
        assert r.logprobs == pytest.approx(unmoved[r.sample_id].logprobs)
    for b in [one, *backends]:
        b.close()


# -- sleep mode is a capability ------------------------------------------------------------------


@pytest.mark.parametrize("available", [True, False])
def test_sleep_mode_only_where_the_platform_has_it(monkeypatch, caplog, available):
    from rlhf_fusion.rollout import vllm_backend

    engine = FakeAsyncLLM(sleep_mode=available)
    module = fake_vllm_module(engine)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: module)
    with caplog.at_level("INFO", logger=vllm_backend.__name__):
        b = VLLMBackend(model="m", engine_kwargs={"seed": 1})
    (args,) = module.engine_args
    assert args["enable_sleep_mode"] is available
    said = [r for r in caplog.records if "keeps its KV cache pool" in r.getMessage()]
    assert len(said) == (0 if available else 1)
    b.sleep()
    assert engine.asleep is available  # without sleep mode the engine is not paused
    b.wake_up()
    assert not engine.asleep
    b.submit(specs([3]))
    assert [r.sample_id for r in b.results()] == [0]
    b.close()


def test_asking_for_sleep_mode_where_there_is_none_names_the_fix(monkeypatch):
    from rlhf_fusion.rollout import vllm_backend
    from rlhf_fusion.rollout.types import RolloutConfigError

    module = fake_vllm_module(FakeAsyncLLM(sleep_mode=False))
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: module)
    with pytest.raises(RolloutConfigError, match="drop it from the engine kwargs"):
        VLLMBackend(model="m", engine_kwargs={"enable_sleep_mode": True})
