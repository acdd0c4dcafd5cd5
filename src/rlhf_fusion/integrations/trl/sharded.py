"""Full weights of a policy that DeepSpeed ZeRO-3 or FSDP2 shards, for the generation copy.

Under ZeRO-3 every parameter holds its partition only (the rest is fetched by DeepSpeed's
module hooks around each forward); under FSDP2 every parameter is a DTensor shard. A
``deepcopy`` of such a model keeps the hooks (or FSDP's class swap) but not the machinery
behind them, so the copy fails at its first forward. The generation copy is instead built
from the model's config and loaded with the gathered full weights, as TRL's own
``unwrap_model_for_generation`` gathers them for its ``generate``; the trainer pushes freshly
gathered weights into it before every rollout, so it follows every optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["full_state_dict", "peft_plain_copy", "plain_copy", "sharding"]


def sharding(model: Any) -> str | None:
    """``"zero3"``, ``"fsdp2"`` or None (every parameter whole on this process)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return "zero3"
        if isinstance(p, DTensor):
            return "fsdp2"
    return None


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s state dict (buffers and every tied name included, as ``plain_copy``'s
    strict ``load_state_dict`` needs) with whole tensors; collective (every process calls it)
    when the model is sharded.

    FSDP2's parameters are DTensors like the runtime's own tp / ZeRO-3 layouts, so they are
    gathered by :func:`rlhf_fusion.runtime.sharded_state.full_state_dict` (whole parameters,
    tied ones once) and spread over the state dict's names by
    :func:`rlhf_fusion.runtime.weight_sync.full_state`. DeepSpeed ZeRO-3's are plain tensors
    holding a partition, which only DeepSpeed can gather: that branch is this module's own."""
    kind = sharding(model)
    if kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "fsdp2":
        from ...runtime.sharded_state import full_state_dict as whole_parameters
        from ...runtime.weight_sync import full_state

        return full_state(model, whole_parameters(model))
    return model.state_dict()


@contextlib.contextmanager
def _without_zero3_init() -> Iterator[None]:
    """transformers builds models inside ``deepspeed.zero.Init`` (partitioned at birth) while a
    ZeRO-3 config is registered; the generation copy must be whole, so it is unregistered
    meanwhile. The copy's random initialisation (overwritten by the gathered weights) draws
    from a forked RNG: the trainer's torch RNG is checkpointed, and a resumed run builds the
    copy at a later step than the uninterrupted one, so drawing from it would make the two
    runs diverge (seen under ZeRO-3: resumed weights differed from the uninterrupted run's)."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover - transformers is a TRL dependency
        with torch.random.fork_rng(devices=[]):
            yield
        return
    ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def _unsharded_class(model: Any) -> type:
    """FSDP2 swaps a sharded module's class for ``FSDP<Name>(FSDPModule, <Name>)``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def plain_copy(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """A new, unsharded instance of ``model``'s class holding ``state`` (its full weights)."""
    cls = _unsharded_class(model)
    config = getattr(model, "config", None)
    build = getattr(cls, "_from_config", None)
    if config is None or build is None:
        raise TypeError(
            f"rlhf-fusion builds the generation copy of a sharded (ZeRO-3 / FSDP2) policy from "
            f"its config, and {cls.__name__} is not a transformers PreTrainedModel; run with "
            "ZeRO-0/1/2 or DDP, or pass fusion=FusionConfig(stream=False, migrate=False)")
    with _without_zero3_init():
        clone = build(config)
    clone.load_state_dict(state, strict=True)
    return clone.eval()


def peft_plain_copy(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """:func:`plain_copy` of a PEFT model (``FusedPPOTrainer`` with ``peft_config`` under
    ZeRO-3): its base model rebuilt whole from the config, the same adapters on top, then
    ``state`` (the PEFT model's full weights, adapters included) loaded into it."""
    from peft import get_peft_model

    base = model.get_base_model()
    cls = _unsharded_class(base)
    with _without_zero3_init():
        clone_base = cls._from_config(base.config)
    names = list(model.peft_config)
    clone = get_peft_model(clone_base, model.peft_config[names[0]], adapter_name=names[0])
    for name in names[1:]:
        clone.add_adapter(name, model.peft_config[name])
    clone.set_adapter(model.active_adapter)
    clone.load_state_dict(state, strict=True)
    return clone.eval()
