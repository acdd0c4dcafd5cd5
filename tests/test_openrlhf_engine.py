"""The OpenRLHF engine path (``engine.FusionRolloutMixin``) over the fake engine with vLLM's
abort semantics (an aborted request's stream ends with a finished output whose finish_reason is
"abort", carrying every token so far), in process: OpenRLHF's own SingleTurnAgentExecutor runs
each sample, as on a RolloutRayActor."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openrlhf")
pytest.importorskip("torch")

from rlhf_fusion.testing.openrlhf import (  # noqa: E402
    FakeAsyncLLM,
    SamplingParams,
    StubTokenizer,
    install_cpu_stubs,
    remove_cpu_stubs,
)


@pytest.fixture(scope="module", autouse=True)
def _stubs():
    added = install_cpu_stubs()
    yield
    remove_cpu_stubs(added)


def _engine(tick_s=0.001, pad_ids=None):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    from rlhf_fusion.integrations.openrlhf.engine import FusionRolloutMixin

    class Engine(FusionRolloutMixin):
        def __init__(self):
            self.llm = FakeAsyncLLM(vocab=12, eos=0, tick_s=tick_s)
            self.executor = SingleTurnAgentExecutor()
            self._mm_pad_token_ids = pad_ids

    e = Engine()
    e.fusion_set_tokenizer(StubTokenizer())
    return e


def _params(max_tokens=200, temperature=0.0, seed=None):
    # ignore_eos: a long sample, so an export lands mid-stream
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=1, seed=seed)


async def _one(engine, run, key, params, resume=None, prompt="a prompt"):
    await engine.fusion_submit(run, [(key, prompt, "label", None, resume)], params, 400)
    return await asyncio.wait_for(engine.fusion_poll(run), 30)


async def _until_generated(engine, run, tokens):
    for _ in range(3000):
        prog = engine.fusion_progress(run)
        if prog and prog[0][2] >= tokens:
            return prog[0][2]
        await asyncio.sleep(0.002)
    raise AssertionError("the sample never got going")


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1234)])
def test_export_mid_stream_is_a_migration_ticket_and_resumes_to_the_unmoved_sample(
        temperature, seed):
    async def scenario():
        params = _params(temperature=temperature, seed=seed)
        src, dst, ref = _engine(), _engine(), _engine()
        await src.fusion_submit("r", [(0, "a prompt", "label", None, None)], params, 400)
        seen = await _until_generated(src, "r", 20)
        assert await src.fusion_export("r", [0]) == [0]
        [(key, out)] = await asyncio.wait_for(src.fusion_poll("r"), 30)
        assert key == 0 and set(out) == {"fusion_migrated"}, out  # never a finished sample
        ticket = out["fusion_migrated"]
        assert seen <= len(ticket["ids"]) < 200  # every token so far, the abort output's too
        assert len(ticket["lps"]) == len(ticket["ids"])
        [(_, moved)] = await _one(dst, "r", 0, params, resume=ticket)
        [(_, unmoved)] = await _one(ref, "r", 0, params)
        return ticket, moved, unmoved

    ticket, moved, unmoved = asyncio.run(scenario())
    prompt_len = len(StubTokenizer()("a prompt")["input_ids"])
    assert unmoved["observation_tokens"][prompt_len:][:len(ticket["ids"])] == ticket["ids"]
    if temperature == 0.0:  # greedy: the moved sample is the unmoved one, token for token
        assert moved["observation_tokens"] == unmoved["observation_tokens"]
        assert moved["rollout_log_probs"] == unmoved["rollout_log_probs"]
    assert len(moved["observation_tokens"]) == prompt_len + 200  # full length, not cut
    assert len(moved["rollout_log_probs"]) == len(moved["observation_tokens"])
    assert moved["truncated"]  # it ran to max_tokens ("length"), as unmoved


def test_an_abort_we_did_not_ask_for_is_an_error_not_a_sample():
    async def scenario():
        engine = _engine()
        await engine.fusion_submit("r", [(0, "a prompt", "l", None, None)], _params(), 400)
        await _until_generated(engine, "r", 5)
        live = engine._fusion_live("r")[0]
        await engine.llm.abort(live.request_id)  # someone else (vLLM itself, an admin)
        return await asyncio.wait_for(engine.fusion_poll("r"), 30)

    [(key, out)] = asyncio.run(scenario())
    assert set(out) == {"fusion_error"} and "aborted" in out["fusion_error"]


def test_a_sample_finished_before_the_export_is_emitted_once():
    async def scenario():
        engine = _engine()
        params = _params(max_tokens=5)
        await engine.fusion_submit("r", [(0, "p", "l", None, None), (1, "q", "l", None, None)],
                                   params, 400)
        got = []
        while len(got) < 2:
            got += await asyncio.wait_for(engine.fusion_poll("r"), 30)
        asked = await engine.fusion_export("r", [0, 1])
        more = [r for r in engine._fusion_runs().get("r", type("R", (), {"done": []})).done]
        return got, asked, more

    got, asked, more = asyncio.run(scenario())
    assert sorted(k for k, _ in got) == [0, 1]
    assert all("observation_tokens" in out for _, out in got)
    assert asked == [] and more == []


def test_abort_of_a_finished_or_unknown_request_changes_nothing():
    async def scenario():
        llm = FakeAsyncLLM(vocab=12, eos=0, tick_s=0.001)
        outs = [o async for o in llm.generate({"prompt_token_ids": [1, 2]}, _params(5), "x")]
        await llm.abort("x")
        await llm.abort("never-submitted")
        again = [o async for o in llm.generate({"prompt_token_ids": [1, 2]}, _params(5), "y")]
        return outs, again

    outs, again = asyncio.run(scenario())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert again[-1].outputs[0].token_ids == outs[-1].outputs[0].token_ids


def test_media_tokens_are_deduplicated_as_stock_generate_does():
    from openrlhf.utils.vlm_utils import dedup_media_tokens

    from rlhf_fusion.integrations.openrlhf import engine as engine_mod

    async def scenario():
        engine = _engine(pad_ids={7})
        live = engine_mod._Live(key=0, prefix_ids=[], prefix_lps=None)
        token = engine_mod._CURRENT.set((live, StubTokenizer()))
        try:
            await engine.generate([1, 7, 7, 7, 2, 7, 7, 3], _params(max_tokens=3),
                                  multi_modal_data={"image": ["img"]})
        finally:
            engine_mod._CURRENT.reset(token)
        return engine.llm.submitted[-1][1]

    sent = asyncio.run(scenario())
    assert sent == dedup_media_tokens([1, 7, 7, 7, 2, 7, 7, 3], {7}) == [1, 7, 2, 7, 3]
