"""One training call's layout on its ranks: data parallel, tensor parallel or ZeRO-3.

A training call runs on a mesh of ranks with a strategy ``(dp, tp, zero)`` (``pp = 1``):

* ``tp = 1``, no ZeRO: whole copies, gradients all-reduced over the mesh (data parallel);
* ``tp > 1``: the mesh is ``dp`` groups of ``tp`` consecutive ranks (the planner's order:
  the tp index runs fastest, :meth:`~rlhf_fusion.placement.layout.Layout.coords`); each group is one
  tensor-parallel model (:func:`~rlhf_fusion.runtime.tensor_parallel.apply_tensor_parallel`)
  and the ``dp`` groups' gradients are all-reduced among the ranks of equal tp index;
* ``zero = 3`` (``tp = 1``): FSDP2 over the mesh (:func:`~rlhf_fusion.runtime.fsdp.apply_zero3`),
  whose reduce-scatter sums the gradients.

:func:`layout_groups` names the process groups a layout needs (every rank creates every
group, in one order, since ``new_group`` is collective); :func:`shard_for_training` applies
the layout to a whole model; :func:`data_parallel_step` is one mini-batch on it: this rank's
share of the micro-batches, every loss divided by the mini-batch's micro-batch count, the
gradient sum, then one clipped optimizer step: the arithmetic of one device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..placement.layout import Layout
from .fused import reference_step
from .sharded_state import clip_grad_norm_

__all__ = ["data_parallel_step", "layout_groups", "shard_for_training"]


def layout_groups(layout: Layout) -> list[tuple[int, ...]]:
    """Every rank set ``layout`` communicates over: the mesh, its tp and dp groups."""
    return layout.groups()


def _mesh(group: dist.ProcessGroup, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def shard_for_training(model: nn.Module, role: str, layout: Layout, rank: int,
                       groups: Mapping[tuple[int, ...], dist.ProcessGroup],
                       device: torch.device) -> nn.Module:
    """Apply ``layout`` to ``model`` (whole, identical on every rank of the mesh) in place."""
    if layout.tp > 1:
        from .tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, role, _mesh(groups[layout.tp_ranks(rank)], device))
    elif layout.zero == 3:
        from .fsdp import apply_zero3

        apply_zero3(model, role, _mesh(groups[layout.ranks], device))
    return model


def data_parallel_step(model: nn.Module, role: str, layout: Layout, rank: int,
                       micro_batches: Sequence[Mapping[str, Tensor]],
                       loss_fns: Mapping[str, Callable], optimizer: torch.optim.Optimizer,
                       groups: Mapping[tuple[int, ...], dist.ProcessGroup],
                       max_grad_norm: float | None,
                       timings: dict[str, float] | None = None) -> dict[str, float]:
    """One mini-batch of ``micro_batches`` for ``role`` on ``layout``: this rank's share (its
    data-parallel index's consecutive run), gradients summed over the data-parallel ranks,
    one clipped optimizer step. Returns ``{role/stat: mini-batch sum}`` and ``role/grad_norm``.
    ``timings``, when given, gets ``passes_s``: the seconds of the forward and backward passes
    (what the step adds is the rest: the layout profiler's measurement).
    """
    per = len(micro_batches) // layout.dp
    i = layout.dp_index(rank)
    t0 = time.perf_counter()
    out = reference_step({role: model}, micro_batches[i * per: (i + 1) * per], None, loss_fns,
                         loss_denominator=len(micro_batches), step=False, roles=(role,))
    if timings is not None:
        timings["passes_s"] = time.perf_counter() - t0
    dp_group = groups[layout.dp_ranks(rank)] if layout.dp > 1 else None
    if dp_group is not None and layout.zero != 3:   # FSDP's reduce-scatter summed them
        grads = [_local(q.grad) for q in model.parameters() if q.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)
    stats = out["stats"][role]
    keys = sorted(stats)
    vals = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    if dp_group is not None:   # a tensor-parallel group computed the same statistics
        dist.all_reduce(vals, group=dp_group)
    norm = clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    res = {f"{role}/{k}": float(v) for k, v in zip(keys, vals)}
    res[f"{role}/grad_norm"] = float(norm)
    return res


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
