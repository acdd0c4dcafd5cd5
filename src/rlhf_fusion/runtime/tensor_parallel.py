"""Megatron tensor parallelism for Hugging Face decoders, on torch's own engine (DTensor).

:func:`apply_tensor_parallel` parallelizes an Actor (``*ForCausalLM``) or a Critic
(:class:`~rlhf_fusion.runtime.partition.CriticModel`) in place with
``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D device mesh of ``tp``
ranks: in every decoder layer the attention's query/key/value projections and the MLP's
first projections are column-parallel (each rank computes its own heads, its own slice of
the intermediate), the attention's output projection and the MLP's last projection are
row-parallel (partial sums all-reduced into the replicated hidden state). Two all-reduces a
layer forward, two backward: Megatron's plan (Shoeybi et al. 2019, §3), the same as
``transformers``' ``base_model_tp_plan``.

Everything outside the decoder layers (embeddings, norms, the LM or value head, a tied
embedding with its head) stays a plain, replicated tensor on every rank: the hidden state
entering and leaving each layer is replicated, so these parameters compute and receive the
same gradient on every rank (the column-parallel input's backward all-reduces the partial
input gradient). Tied weights therefore stay tied, as in one process.

Families:

* **Llama layout** (Llama, Qwen2, Mistral): ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/
  ``up_proj`` column-parallel, ``o_proj``/``down_proj`` row-parallel. The attention reshapes
  with ``-1`` heads, so a rank's module sees ``heads / tp`` query heads and
  ``kv_heads / tp`` key/value heads and the grouped-query ratio is unchanged.
* **GPT-2**: its ``Conv1D`` stores the transposed weight ``[in, out]`` (``x @ W + b``), so a
  column-parallel ``Conv1D`` shards the weight on dim 1 and a row-parallel one on dim 0
  (:class:`Conv1DColwise`, :class:`Conv1DRowwise`). The attention's fused ``c_attn`` holds
  ``[q | k | v]`` along its output columns; a contiguous column shard would give rank 0 all of
  ``q`` and half of ``k``. Before sharding, its columns are permuted so that shard ``r`` is
  ``[q_r | k_r | v_r]`` (the rank's own heads of each), and the attention's ``split_size``
  becomes ``hidden / tp``. Adam is elementwise, so training a permuted weight is training the
  weight; :func:`rlhf_fusion.runtime.sharded_state.full_state_dict` undoes the permutation.

Requirements, checked by :func:`check_tensor_parallel` with the fix named: ``tp`` divides the
attention heads, the key/value heads and the MLP's intermediate size.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ..errors import RLHFFusionError
from .partition import _layers, _layout

__all__ = [
    "Conv1DColwise",
    "Conv1DRowwise",
    "TensorParallelError",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "family_and_layers",
    "tp_plan",
]

# The attribute on a GPT-2 ``c_attn`` holding the column permutation applied before sharding.
PERMUTATION_ATTR = "_rlhf_tp_column_order"


class TensorParallelError(RLHFFusionError, ValueError):
    """A model or mesh tensor parallelism cannot run on; the message names the fix."""


def family_and_layers(model: nn.Module, role: str) -> tuple[str, str, nn.ModuleList]:
    """``(family, base attribute, decoder layers)`` of an Actor or a Critic (the layers the
    tp plan and ZeRO-3's units are applied to)."""
    from .errors import PartitionError

    try:
        lay = _layout(model, role)
    except PartitionError as exc:
        raise TensorParallelError(f"tensor parallelism: {exc}") from None
    base = getattr(model, lay.base_attr)
    return lay.family, lay.base_attr, _layers(base, lay.family)


def check_tensor_parallel(config: Any, tp: int, what: str = "model") -> None:
    """Raise :class:`TensorParallelError` unless ``tp`` splits ``config``'s heads, key/value
    heads and MLP intermediate size evenly (names the sizes and the fix)."""
    if tp < 1:
        raise TensorParallelError(f"{what}: tp must be >= 1, got {tp}")
    heads = int(getattr(config, "num_attention_heads", getattr(config, "n_head", 0)))
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(config, "hidden_size", getattr(config, "n_embd", 0)))
    inter = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                or 4 * hidden)
    for name, n in (("attention heads", heads), ("key/value heads", kv),
                    ("intermediate size", inter)):
        if n % tp:
            raise TensorParallelError(
                f"{what}: tp={tp} does not divide its {name} ({n}); tensor parallelism "
                f"gives every rank 1/tp of them: plan with a tp that divides {n}")


def _distribute_conv1d(module: nn.Module, mesh: Any, placements: dict[str, Any]) -> None:
    for pname, placement in placements.items():
        param = getattr(module, pname)
        # Every rank holds the same whole weight: each keeps its own piece, nothing is sent.
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=None),
            requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """Column parallelism for ``transformers``' ``Conv1D`` (weight ``[in, out]``, so the
    weight is sharded on dim 1, the bias on dim 0); ``nn.Linear`` as ``ColwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute_conv1d(mod, mesh,
                                                     {"weight": Shard(1), "bias": Shard(0)}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """Row parallelism for ``Conv1D``: weight sharded on dim 0, bias replicated (added once,
    to the all-reduced partial products)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute_conv1d(mod, mesh,
                                                     {"weight": Shard(0), "bias": Replicate()}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def tp_plan(family: str) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one decoder layer of ``family``."""
    if family == "llama":
        return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
    if family == "gpt2":
        return {"attn.c_attn": Conv1DColwise(), "attn.c_proj": Conv1DRowwise(),
                "mlp.c_fc": Conv1DColwise(), "mlp.c_proj": Conv1DRowwise()}
    raise TensorParallelError(f"tensor parallelism: no plan for family {family!r}; "
                              "supported: Llama, Qwen2, Mistral, GPT-2")


def fused_qkv_order(hidden: int, tp: int) -> Tensor:
    """Column order of a GPT-2 ``c_attn`` (``[q | k | v]``, ``hidden`` each) such that the
    ``r``-th of ``tp`` contiguous shards is ``[q_r | k_r | v_r]``."""
    per = hidden // tp
    return torch.cat([torch.arange(p * hidden + r * per, p * hidden + (r + 1) * per)
                      for r in range(tp) for p in range(3)])


def apply_tensor_parallel(model: nn.Module, role: str, mesh: Any) -> nn.Module:
    """Parallelize ``model`` (an Actor or a Critic, whole, every rank of ``mesh`` holding
    the same weights) over the 1-D DeviceMesh ``mesh``, in place; returns it.

    Afterwards the layers' projections hold DTensor shards; forward takes and returns plain
    tensors as before (replicated on every rank of the mesh).
    """
    if mesh.ndim != 1:
        raise TensorParallelError(f"tensor parallelism: a 1-D mesh, got {mesh.ndim} dims")
    tp = mesh.size()
    family, _, layers = family_and_layers(model, role)
    check_tensor_parallel(model.config, tp, role)
    for layer in layers:
        if family == "gpt2":
            attn = layer.attn
            if getattr(attn, "is_cross_attention", False):
                raise TensorParallelError("tensor parallelism: GPT-2 cross-attention is not "
                                          "supported (a decoder-only model has none)")
            hidden = attn.embed_dim
            order = fused_qkv_order(hidden, tp)
            with torch.no_grad():
                attn.c_attn.weight.copy_(attn.c_attn.weight[:, order])
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
            setattr(attn.c_attn, PERMUTATION_ATTR, order)
            attn.split_size = hidden // tp
        parallelize_module(layer, mesh, tp_plan(family))
    return model
