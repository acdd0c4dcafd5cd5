"""A fake vLLM async engine with vLLM's streaming semantics, for tests of our vLLM adapters.

vLLM needs CUDA; these fakes follow the contract ``VLLMBackend`` relies on (an async output
stream per request with cumulative outputs, abort ending the stream, a per-request seed,
``collective_rpc``, sleep and wake-up) so the adapter logic is tested on CPU.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..rollout.sampling import derive_seed

__all__ = ["FakeAsyncEngine", "FakeSamplingParams", "fake_vllm_module"]




@dataclass
class FakeSamplingParams:
    """The subset of vllm.SamplingParams the backend sets."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool


class FakeAsyncEngine:
    """Streams cumulative outputs, one token per tick; abort ends the stream (as vLLM does).

    Tokens depend on the request seed, so a resubmitted continuation (a new seed) diverges, as
    it does in vLLM.
    """

    def __init__(self, tick_s: float = 0.0005, cancel_on_abort: bool = False,
                 vocab: int = 97) -> None:
        self.tick_s = tick_s
        self.vocab = vocab
        self.cancel_on_abort = cancel_on_abort
        self.aborted: set[str] = set()
        self.requests: list[tuple[str, list[int], FakeSamplingParams]] = []
        self.rpc: list[tuple[str, tuple]] = []
        self.asleep = False

    async def generate(self, prompt, params, request_id):
        self.requests.append((request_id, list(prompt["prompt_token_ids"]), params))
        ids: list[int] = []
        lps: list[dict[int, FakeLogprob]] = []
        for pos in range(params.max_tokens):
            await asyncio.sleep(self.tick_s)
            if request_id in self.aborted:
                if self.cancel_on_abort:
                    raise asyncio.CancelledError
                return
            tok = derive_seed(params.seed or 0, len(prompt["prompt_token_ids"]), pos) % self.vocab
            ids.append(tok)
            lps.append({tok: FakeLogprob(-0.01 * tok)})
            stop = tok in params.stop_token_ids
            finished = stop or len(ids) == params.max_tokens
            yield FakeRequestOutput(request_id, [FakeCompletion(
                list(ids), list(lps), "stop" if stop else ("length" if finished else None))],
                finished)
            if finished:
                return

    async def abort(self, request_id):
        self.aborted.add(request_id)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc.append((method, args))
        return [None]

    async def sleep(self, level=1):
        self.asleep = True

    async def wake_up(self, tags=None):
        self.asleep = False


def fake_vllm_module(engine: FakeAsyncEngine) -> Any:
    """A stand-in for the ``vllm`` module whose engine factory returns ``engine`` and records
    the engine arguments it was given (``module.engine_args``)."""
    module = SimpleNamespace(SamplingParams=FakeSamplingParams, engine_args=[])

    def engine_args(**kwargs: Any) -> dict[str, Any]:
        module.engine_args.append(kwargs)
        return kwargs

    module.AsyncEngineArgs = engine_args
    module.AsyncLLMEngine = SimpleNamespace(from_engine_args=lambda args: engine)
    return module
