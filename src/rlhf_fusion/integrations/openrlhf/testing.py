"""CPU test support for the OpenRLHF integration: stub ``vllm``/``flash_attn``/``deepspeed``
modules (OpenRLHF imports them at module level; none installs without CUDA), a fake vLLM async
engine with ``AsyncLLM``'s semantics, a toy tokenizer, and a setup hook that installs the stubs
before the real one (for Ray workers in tests).

The stubs carry exactly the names OpenRLHF 0.11.2 imports on the PPO path; anything else raises
an AttributeError naming the stub, so a new dependency shows up as a clear failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.machinery
import importlib.util
import sys
import time
import types
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["CharTokenizer", "FakeAsyncLLM", "FakeModel", "fake_model_actor_class",
           "install_cpu_stubs", "setup_worker_with_cpu_stubs"]

HOOK_WITH_STUBS = f"{__name__}.setup_worker_with_cpu_stubs"


def _missing_name(module: str):
    def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562 module __getattr__
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{module}.{name} is not in rlhf_fusion's CPU stub; add it to "
                             "integrations/openrlhf/testing.py if OpenRLHF now needs it")
    return __getattr__


def _module(name: str, **attrs: Any) -> types.ModuleType:
    # a plain ModuleType (cloudpickle pickles exactly that type by reference, for Ray workers)
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs, __getattr__=_missing_name(name))
    mod.__path__ = []  # a package, so submodules resolve
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = mod
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)
    return mod


@dataclass
class SamplingParams:
    """The fields of vllm.SamplingParams that OpenRLHF and the integration set."""

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


def _engine_args(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


def _from_engine_args(args: dict[str, Any]) -> FakeAsyncLLM:
    return FakeAsyncLLM.from_model_name(str(args.get("model", "fake")), seed=args.get("seed"))


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this is rlhf_fusion's CPU stub: the real package needs CUDA")


def install_cpu_stubs() -> list[str]:
    """Put the stubs in ``sys.modules`` for the packages that are not importable here; returns
    the module names added (for :func:`remove_cpu_stubs`)."""
    def missing(name: str) -> bool:
        return name not in sys.modules and importlib.util.find_spec(name) is None

    before = set(sys.modules)

    if missing("vllm"):
        _module("vllm", __version__="0.29.0", SamplingParams=SamplingParams,
                AsyncEngineArgs=_engine_args,
                AsyncLLMEngine=types.SimpleNamespace(from_engine_args=_from_engine_args))
        _module("vllm.inputs", TokensPrompt=dict)
        _module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
    if missing("flash_attn"):
        _module("flash_attn", __version__="2.8.3")
        _module("flash_attn.bert_padding", index_first_axis=_unavailable, pad_input=_unavailable,
                rearrange=_unavailable, unpad_input=_unavailable)
        _module("flash_attn.utils")
        _module("flash_attn.utils.distributed", all_gather=_unavailable)
    if missing("deepspeed"):
        _module("deepspeed", __version__="0.19.6", initialize=_unavailable)
        _module("deepspeed.runtime")
        _module("deepspeed.runtime.zero")
        _module("deepspeed.runtime.zero.partition_parameters",
                ZeroParamStatus=types.SimpleNamespace(NOT_AVAILABLE="NOT_AVAILABLE"))
    return sorted(set(sys.modules) - before)


def remove_cpu_stubs(names: list[str]) -> None:
    """Take the stubs out again, so later tests in the same process see vLLM as missing."""
    for name in names:
        sys.modules.pop(name, None)


def setup_worker_with_cpu_stubs() -> None:
    """The integration's setup hook, after the stubs (Ray workers in CPU tests)."""
    install_cpu_stubs()
    from .hook import setup_worker

    setup_worker()


# -- a fake engine with vLLM AsyncLLM's semantics -------------------------------------------------


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, _Logprob]] | None
    finish_reason: str | None
    cumulative_logprob: float | None = None


@dataclass
class _RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[_Completion]
    finished: bool


def _h(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class _OutputProcessor:
    def __init__(self, engine: FakeAsyncLLM) -> None:
        self.engine = engine

    def get_num_unfinished_requests(self) -> int:
        return len(self.engine.running)


class FakeAsyncLLM:
    """One token per tick, an async stream of cumulative outputs per request; ``abort`` ends the
    stream with a final output (``finished``, ``finish_reason="abort"``, the tokens so far), as
    vLLM's AsyncLLM does; aborting a finished or unknown request does nothing. The next token is
    a function of the whole context (prompt + tokens so far) and, at temperature > 0, of the
    request's seed (or the engine's RNG when the request has none): greedy decoding continues a
    resubmitted prompt + generated ids exactly as the unmoved request, as a real model does.
    ``eos`` stops a request (lengths vary, there is a tail).
    """

    def __init__(self, vocab: int = 50, eos: int = 0, tick_s: float = 0.002,
                 seed: int | None = None) -> None:
        self.vocab, self.eos, self.tick_s = vocab, eos, tick_s
        self.seed = 0 if seed is None else int(seed)
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.submitted: list[tuple[str, list[int], int]] = []  # request id, prompt, max_tokens
        self.output_processor = _OutputProcessor(self)
        self._draws = 0

    @classmethod
    def from_model_name(cls, model: str, seed: int | None = None) -> FakeAsyncLLM:
        """``fake:vocab=50,eos=0,tick_s=0.002``: the engine's settings travel as the model name
        through OpenRLHF's own engine arguments."""
        _, _, spec = model.partition(":")
        kw = {k: (float(v) if k == "tick_s" else int(v))
              for k, v in (p.split("=") for p in spec.split(",") if p)}
        return cls(seed=seed, **kw)

    async def is_sleeping(self) -> bool:
        return False

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str):
        ctx = list(prompt["prompt_token_ids"])
        self.submitted.append((request_id, list(ctx), int(params.max_tokens)))
        self.running.add(request_id)
        rng = params.seed if params.seed is not None else None
        ids: list[int] = []
        lps: list[dict[int, _Logprob]] = []
        try:
            for _ in range(int(params.max_tokens)):
                await asyncio.sleep(self.tick_s)
                if request_id in self.aborted:
                    # vLLM (since PR #22283, so 0.29 and later): one last output, finished, with
                    # finish_reason "abort" and every token so far (cumulative)
                    yield _RequestOutput(request_id, list(prompt["prompt_token_ids"]), [_Completion(
                        0, list(ids), " ".join(map(str, ids)),
                        list(lps) if params.logprobs is not None else None, "abort")], True)
                    return
                if params.temperature == 0:
                    tok = _h(*ctx) % self.vocab
                else:
                    if rng is None:
                        self._draws += 1
                        salt = _h(self.seed, self._draws)
                    else:
                        salt = _h(int(rng), len(ids))
                    tok = _h(salt, *ctx) % self.vocab
                if len(ids) + 1 < int(getattr(params, "min_tokens", 0) or 0) and tok == self.eos:
                    tok = (tok + 1) % self.vocab
                ctx.append(tok)
                ids.append(tok)
                lps.append({tok: _Logprob(-0.01 * tok)})
                stop = tok == self.eos and not params.ignore_eos
                fin = stop or len(ids) == int(params.max_tokens)
                yield _RequestOutput(request_id, list(prompt["prompt_token_ids"]), [_Completion(
                    0, list(ids), " ".join(map(str, ids)),
                    list(lps) if params.logprobs is not None else None,
                    ("stop" if stop else "length") if fin else None)], fin)
                if fin:
                    return
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.aborted.add(request_id)

    async def sleep(self, level: int = 1) -> None:
        pass

    async def wake_up(self, tags: Any = None) -> None:
        pass


class CharTokenizer:
    """A toy Hugging Face-style tokenizer: one id per character (ids 1..), ``decode`` back."""

    pad_token_id = 0  # OpenRLHF pads micro-batches with it (Experience.concat_experiences)
    pickles = 0  # times serialised in this process (tests: it travels once per engine)

    def __reduce__(self) -> tuple[Any, ...]:
        CharTokenizer.pickles += 1
        return (CharTokenizer, ())

    def __call__(self, text: str, add_special_tokens: bool = False,
                 return_tensors: str | None = None) -> dict[str, Any]:
        ids = [1 + (ord(c) % 40) for c in text]
        if return_tensors == "pt":
            import torch

            return {"input_ids": torch.tensor([ids])}
        return {"input_ids": ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


# -- fake OpenRLHF model actors (Policy/Critic/Reference/Reward forwards need CUDA) ----------------


class FakeModel:
    """The ``forward`` of OpenRLHF's model actors, deterministic on CPU: mixed in front of
    OpenRLHF's ``BaseModelActor`` (:func:`fake_model_actor_class`), so ``execute_batch`` and the
    group batching are stock. The result also depends on the padded width of the micro-batch, so
    a sample scored in a different micro-batch than stock would show. Every call is recorded
    (start time, the unpadded token ids of each row) for ``report``."""

    def __init__(self, kind: str, world_size: int = 1, rank: int = 0,
                 compute_s: float = 0.02) -> None:
        super().__init__(world_size, rank, None, None)  # type: ignore[call-arg]
        self.kind, self.compute_s = kind, compute_s
        self.strategy = types.SimpleNamespace(is_rank_0=lambda: False)  # quiet execute_batch
        self.calls: list[tuple[float, list[tuple[int, ...]]]] = []
        self.empty_caches = 0

    def forward(self, sequences: Any, action_mask: Any = None, attention_mask: Any = None,
                pad_sequence: bool = False, packed_seq_lens: Any = None,
                mm_train_inputs_list: Any = None) -> Any:
        start = time.time()
        time.sleep(self.compute_s)
        rows = [tuple(s[m.bool()].tolist()) for s, m in zip(sequences, attention_mask)]
        self.calls.append((start, rows))
        width = sequences.shape[1]
        seq = (sequences * attention_mask).float()
        if self.kind == "reward":
            return seq.sum(-1) / 100 + width * 1e-3
        scale = {"actor": -0.01, "ref": -0.02, "critic": 0.03}[self.kind]
        acts = seq[:, 1:][:, -action_mask.shape[1]:]
        return (acts * scale + width * 1e-4) * action_mask

    def empty_cache(self) -> None:
        self.empty_caches += 1

    def report(self) -> list[tuple[float, list[tuple[int, ...]]]]:
        calls, self.calls = self.calls, []
        return calls


def fake_model_actor_class() -> Any:
    """``ray.remote`` of :class:`FakeModel` in front of OpenRLHF's ``BaseModelActor``."""
    import ray
    from openrlhf.trainer.ray.launcher import BaseModelActor

    return ray.remote(type("FakeModelActor", (FakeModel, BaseModelActor), {
        "__module__": __name__}))
