"""ZeRO-3 for Hugging Face decoders, on torch's own engine (FSDP2, ``fully_shard``).

:func:`apply_zero3` shards an Actor or a Critic over a 1-D device mesh of ``dp`` ranks: every
decoder layer is its own FSDP unit (its weights all-gathered just before its forward and
backward, freed after), the rest (embeddings, final norm, head, a tied embedding with its
head) is the root unit. Between passes a rank holds ``1/dp`` of every parameter (rows of dim
0, a ``Shard(0)`` DTensor), of its gradient and of its optimizer state: ZeRO stage 3
(Rajbhandari et al. 2020).

Gradients are **summed** over the mesh (FSDP's default divides by ``dp``): the loop divides
each micro-batch's loss by the mini-batch's micro-batch count itself, as its data-parallel
all-reduce does, so the step is the same arithmetic as one device's.

Every rank of the mesh must run the same number of forward and backward passes (each one
all-gathers); :func:`rlhf_fusion.runtime.sharded_state.full_state_dict` gathers whole weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from .tensor_parallel import TensorParallelError, family_and_layers

__all__ = ["apply_zero3"]


def apply_zero3(model: nn.Module, role: str, mesh: Any) -> nn.Module:
    """Shard ``model`` (whole and identical on every rank of ``mesh``) with ZeRO-3, in place;
    returns it. Forward and backward take and return plain tensors as before."""
    if mesh.ndim != 1:
        raise TensorParallelError(f"ZeRO-3: a 1-D mesh, got {mesh.ndim} dims")
    _, _, layers = family_and_layers(model, role)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has neither PREMUL_SUM nor AVG, which FSDP picks
            # for float32 otherwise; dividing by 1.0 afterwards is exact.
            mod.set_force_sum_reduction_for_comms(True)
    model.register_forward_hook(_reshard_without_autograd)
    return model


def _reshard_without_autograd(model: nn.Module, args: Any, output: Any) -> None:
    # The root unit keeps its weights gathered after forward until backward reshards them
    # (reshard_after_forward is off for the root). A forward without autograd (scoring,
    # no_grad) has no backward: the gathered copy would outlive the next optimizer step and
    # the next forward would compute with the old weights (torch 2.13). Free it here.
    if not torch.is_grad_enabled():
        model.reshard()
