"""The generation backends by name: the one place where the PPO loop (``generation.backend``)
and the TRL trainers (``FusionConfig.backend``) turn a name into a
:class:`~rlhf_fusion.rollout.backend.GenerationBackend`. A new backend (SGLang, verl's rollout
workers, ...) is one :func:`register_backend` call; the configs accept every registered name.

Imports no torch: each factory imports its backend when it builds one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .backend import GenerationBackend
from .types import RolloutConfigError

__all__ = ["BackendRequest", "backend_names", "make_backend", "register_backend"]


@dataclass(frozen=True)
class BackendRequest:
    """What a trainer knows when it builds its process's generation instance.

    ``copy_model`` makes this process's own copy of the Actor (called only by backends that
    generate in-process); ``checkpoint`` is where an engine running in its own processes loads
    the Actor from (None: the Actor was built from a config). ``dtype`` None is the backend's
    default; ``engine_kwargs`` go to an engine's own arguments.
    """

    copy_model: Callable[[], Any]
    instance_id: int
    max_batch_size: int
    seed: int
    checkpoint: str | None = None
    device: Any = None
    dtype: Any = None
    kv_capacity_tokens: int | None = None
    engine_kwargs: Mapping[str, Any] | None = None


BackendFactory = Callable[[BackendRequest], GenerationBackend]
_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` a generation backend: ``factory(request)`` builds one instance."""
    _FACTORIES[name] = factory


def backend_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def make_backend(name: str, request: BackendRequest) -> GenerationBackend:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise RolloutConfigError(f"generation backend {name!r} is not registered; use one of "
                                 f"{list(_FACTORIES)} or register_backend it")
    return factory(request)


def _reference(request: BackendRequest) -> GenerationBackend:
    from .reference import ReferenceBackend

    dtype = {} if request.dtype is None else {"dtype": request.dtype}
    return ReferenceBackend(request.copy_model(), instance_id=request.instance_id,
                            max_batch_size=request.max_batch_size,
                            kv_capacity_tokens=request.kv_capacity_tokens,
                            device=request.device, **dtype)


def _vllm(request: BackendRequest) -> GenerationBackend:
    from .vllm_backend import VLLMBackend

    if not request.checkpoint:
        raise RolloutConfigError(
            "backend 'vllm' builds its engine from the Actor's checkpoint, and this Actor has "
            "none (built from a config): save_pretrained it and load it from the directory, or "
            "use backend 'reference'")
    # Sleep mode where the platform has it: VLLMBackend decides (not on CPU).
    kwargs = {"seed": request.seed, "max_num_seqs": request.max_batch_size,
              # PPO's old logprobs are under the sampling temperature, as TRL's are.
              "logprobs_mode": "processed_logprobs", **dict(request.engine_kwargs or {})}
    return VLLMBackend(model=request.checkpoint, engine_kwargs=kwargs,
                       instance_id=request.instance_id, max_batch_size=request.max_batch_size)


register_backend("reference", _reference)
register_backend("vllm", _vllm)
