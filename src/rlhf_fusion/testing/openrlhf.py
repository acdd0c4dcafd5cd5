"""CPU test support for the OpenRLHF integration: stub ``vllm``/``flash_attn``/``deepspeed``
modules (OpenRLHF imports them at module level; none installs without CUDA) whose engine is
the project's one fake vLLM engine (:class:`rlhf_fusion.testing.vllm.FakeAsyncLLM`, kept honest
by the vLLM contract tests), a stub tokenizer, and a setup hook that installs the stubs
before the real one (for Ray workers in tests).

The stubs carry exactly the names OpenRLHF 0.11.2 imports on the PPO path; anything else raises
an AttributeError naming the stub, so a new dependency shows up as a clear failure.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import time
import types
import uuid
from typing import Any

from .vllm import FakeAsyncLLM
from .vllm import FakeSamplingParams as SamplingParams

__all__ = ["HOOK_WITH_STUBS", "FakeAsyncLLM", "FakeModel", "StubTokenizer",
           "fake_model_actor_class", "install_cpu_stubs", "setup_worker_with_cpu_stubs"]

HOOK_WITH_STUBS = f"{__name__}.setup_worker_with_cpu_stubs"


def _missing_name(module: str):
    def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562 module __getattr__
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{module}.{name} is not in rlhf_fusion's CPU stub; add it to "
                             "testing/openrlhf.py if OpenRLHF now needs it")
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
    from ..integrations.openrlhf.hook import setup_worker

    setup_worker()


class StubTokenizer:
    """A toy Hugging Face-style tokenizer for OpenRLHF's calls (``tok(text=...)``,
    ``decode``): one id per character (ids 1..40, digits kept distinct), and ``decode`` spells
    the ids, so a decoded text names its tokens whatever the engine generated. Not the loop's
    :class:`~rlhf_fusion.loop.models.CharTokenizer`, whose alphabet drops digits; counts its
    pickles (``pickles``) so tests see how often it travels."""

    pad_token_id = 0  # OpenRLHF pads micro-batches with it (Experience.concat_experiences)
    pickles = 0  # times serialised in this process (tests: it travels once per engine)

    def __reduce__(self) -> tuple[Any, ...]:
        StubTokenizer.pickles += 1
        return (StubTokenizer, ())

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
