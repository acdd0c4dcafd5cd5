"""Whole weights and gradient norms of a model whose parameters are DTensor shards.

A model parallelized by :func:`~rlhf_fusion.runtime.tensor_parallel.apply_tensor_parallel`
(DTensor shards in its decoder layers, plain replicated tensors elsewhere) or sharded by
:func:`~rlhf_fusion.runtime.fsdp.apply_zero3` (every parameter a ``Shard(0)`` DTensor) holds
only pieces of its weights. What leaves the training layout (the weight sync to generation
copies, the canonical state, a checkpoint) is the whole model in its own names and layouts:
:func:`full_state_dict` gathers it (a collective over the model's mesh: every rank of the
mesh calls it, in the same order) and undoes GPT-2's fused-``c_attn`` column permutation.
:func:`load_full_state` is the inverse (every rank keeps its own piece; nothing is sent).

:func:`clip_grad_norm_` is the loop's clipping rule (torch's, norms summed in float64) over
such parameters: the squared norms of sharded gradients are summed over the mesh, the
replicated ones counted once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .engine import clip_grads_
from .tensor_parallel import PERMUTATION_ATTR

__all__ = ["clip_grad_norm_", "full_state_dict", "is_sharded", "load_full_state"]


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (tensor-parallel or ZeRO-3)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _permutations(model: nn.Module) -> dict[str, tuple[int, Tensor]]:
    """Parameter name -> (dim, column order) of every permuted GPT-2 ``c_attn``."""
    out = {}
    for prefix, mod in model.named_modules():
        order = getattr(mod, PERMUTATION_ATTR, None)
        if order is not None:
            out[f"{prefix}.weight"] = (1, order)
            out[f"{prefix}.bias"] = (0, order)
    return out


def full_state_dict(model: nn.Module, *, names: Iterable[str] | None = None
                    ) -> dict[str, Tensor]:
    """``{name: whole tensor}`` for ``model.named_parameters()`` (tied weights once, under
    their first name), detached copies; a collective over the model's mesh when it is
    sharded. ``names``: only these (every rank must ask for the same ones)."""
    perms = _permutations(model)
    wanted = None if names is None else set(names)
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        t = p.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t.clone()
        if name in perms:
            dim, order = perms[name]
            t = t.index_select(dim, torch.argsort(order))
        out[name] = t
    return out


def load_full_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy whole tensors ``state`` (as :func:`full_state_dict` returns them) into a sharded
    or plain ``model``: every rank keeps its own piece of each (no communication)."""
    perms = _permutations(model)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"load_full_state: no tensor for {missing[:3]} ({len(missing)} "
                       "parameters); give the state full_state_dict wrote")
    with torch.no_grad():
        for name, p in params.items():
            t = state[name].to(device=p.device, dtype=p.dtype)
            if name in perms:
                dim, order = perms[name]
                t = t.index_select(dim, order)
            if isinstance(p, DTensor):
                piece = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(piece.to_local())
            else:
                p.copy_(t)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """The total gradient norm of DTensor and plain parameters (a sharded gradient's squared
    norm summed over its mesh, a replicated one counted once), clipped to ``max_norm`` as
    :func:`rlhf_fusion.runtime.engine.clip_grad_norm_` does; returns the norm."""
    sharded = torch.zeros((), dtype=torch.float64)
    whole = torch.zeros((), dtype=torch.float64)
    groups = set()
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if isinstance(g, DTensor):
            sq = torch.linalg.vector_norm(g.to_local()).double().square()
            if any(pl.is_shard() for pl in g.placements):
                sharded += sq
                groups.add(g.device_mesh.get_group())
            else:
                whole += sq
        else:
            whole += torch.linalg.vector_norm(g).double().square()
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: gradients sharded over more than one mesh; clip "
                         "each model's parameters separately")
    if groups:
        dist.all_reduce(sharded, group=groups.pop())
    norm = float((sharded + whole).sqrt())
    if max_norm is not None:
        clip_grads_(grads, norm, max_norm)
    return norm
