"""Paged KV cache and the attention function the reference backend plugs into `transformers`.

Each sample owns a run of consecutive fixed-size blocks in a per-layer pool of shape
(num_blocks, block_size, num_kv_heads, head_dim), so exporting, importing, admitting and
retiring one sample costs O(its own tokens) and never touches the others. The block table is
what the (vLLM-layout) Triton kernel reads; the run being consecutive lets the CPU path read a
sample's context as one slice instead of gathering it. The attention function
is registered with ``transformers.AttentionInterface`` (by ``triton_kernels``'
``register_transformers_attention``, the package's one registration); the model then calls it with the usual
(query, key, value) and our ``paged_kv`` context rides along in the forward kwargs. With no
context it is plain SDPA, so the model stays usable outside the backend.

Decode attention uses ``rlhf_fusion.triton_kernels.decode_attention`` on CUDA when that module
imports; otherwise a torch gather + SDPA that is also the CPU path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .types import KVCapacityError

ATTN_IMPL_NAME = "rlhf_fusion_rollout_paged"  # distinct from triton_kernels' own


@dataclass
class KVHandle:
    """The exported KV of one sample: (layers, 2, tokens, kv_heads, head_dim) on CPU; often
    a view of a block along dim 2 that the samples exported or sent with it share."""

    data: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.data.shape[2])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def joined_kv(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One tensor ``(layers, 2, tokens, kv_heads, head_dim)`` over the memory ``parts``
    already occupy, when they are, in order, consecutive slices along dim 2 of one contiguous
    such block (as ``torch.split`` cuts the gathered export, or ``unpack_tickets`` a message);
    None otherwise: then the caller concatenates them."""
    first = parts[0] if parts else None
    if first is None or first.dim() != 5:
        return None
    layers, two, _, heads, dim = first.shape
    tokens = sum(p.shape[2] for p in parts)
    stride = (two * tokens * heads * dim, tokens * heads * dim, heads * dim, dim, 1)
    ptr, dtype = first.untyped_storage().data_ptr(), first.dtype
    at = first.storage_offset()
    for p in parts:
        shape = p.shape
        if (p.storage_offset() != at or p.stride() != stride or shape[:2] != first.shape[:2]
                or shape[3:] != first.shape[3:] or p.dtype != dtype
                or p.untyped_storage().data_ptr() != ptr):
            return None
        at += shape[2] * heads * dim
    return first.as_strided((layers, two, tokens, heads, dim), stride, first.storage_offset())


class PagedKVPool:
    """Fixed-size KV blocks for all layers; grows by doubling unless ``max_tokens`` is set."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int = 16,
        max_tokens: int | None = None,
        initial_tokens: int = 4096,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_blocks = None if max_tokens is None else max_tokens // block_size
        start = math.ceil(initial_tokens / block_size)
        if self.max_blocks is not None:
            start = self.max_blocks
        self._alloc(start)

    def _alloc(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                  for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                  for _ in range(self.num_layers)]
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))  # sorted

    def _grow(self, need: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + need)
        shape = (new - old, self.block_size, self.num_kv_heads, self.head_dim)
        for pool in (self.k, self.v):
            for i, t in enumerate(pool):
                pool[i] = torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)])
        self.free.extend(range(old, new))
        self.num_blocks = new

    def _find_run(self, need: int) -> int | None:
        """Index in ``free`` where ``need`` consecutive block ids start (first fit), or None."""
        run = 0
        for i, b in enumerate(self.free):
            run = run + 1 if run and b == self.free[i - 1] + 1 else 1
            if run == need:
                return i - need + 1
        return None

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.max_blocks is None or self._find_run(self.blocks_for(tokens)) is not None

    def allocate(self, tokens: int) -> list[int]:
        need = max(self.blocks_for(tokens), 1)
        at = self._find_run(need)
        if at is None:
            if self.max_blocks is not None:
                raise KVCapacityError(
                    f"KV pool: {tokens} tokens need {need} consecutive blocks but only "
                    f"{len(self.free)} of {self.max_blocks} are free; raise kv_capacity_tokens "
                    "or admit fewer samples"
                )
            self._grow(need)
            at = self._find_run(need)
            assert at is not None
        blocks = self.free[at: at + need]
        del self.free[at: at + need]
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)
        self.free.sort()

    def slots(self, blocks: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Flat slot index (block * block_size + offset) of token positions [start, stop)."""
        pos = torch.arange(start, stop)
        table = torch.as_tensor(list(blocks), dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.device
        )

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_blocks * self.block_size
        return (self.k[layer].view(n, self.num_kv_heads, self.head_dim),
                self.v[layer].view(n, self.num_kv_heads, self.head_dim))

    def _slot_list(self, spans: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
        """Flat slots of the first ``tokens`` positions of each ``(blocks, tokens)``, one after
        the other (built in Python: a tensor op per sample cost more than the copy itself)."""
        bs = self.block_size
        idx: list[int] = []
        for blocks, n in spans:   # a range per block, not an element per token
            for j in range(-(-n // bs)):
                start = blocks[j] * bs
                idx += range(start, start + min(bs, n - j * bs))
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def export(self, spans: Sequence[tuple[Sequence[int], int]]) -> list[KVHandle]:
        """The KV of each ``(blocks, tokens)`` span, one gather per layer for all of them: a
        migration exports its samples at once, on the long tail's critical path (per sample,
        10 samples took 1.5 ms on the demo's CPU)."""
        if not spans:
            return []
        idx = self._slot_list(spans)
        # Gathered straight into the result (an index and two stacks were three copies of the
        # whole KV, on the freed rank's path to its scoring and the destination's to its tail).
        data = torch.empty((self.num_layers, 2, idx.numel(), self.num_kv_heads, self.head_dim),
                           dtype=self.dtype, device=self.device)
        for layer in range(self.num_layers):
            k, v = self.flat(layer)
            torch.index_select(k, 0, idx, out=data[layer, 0])
            torch.index_select(v, 0, idx, out=data[layer, 1])
        # Views of the one gathered block: the wire packs it whole (``joined_kv``), where a
        # copy per sample out of it had cost more than the gather.
        return [KVHandle(x) for x in torch.split(data.cpu(), [n for _, n in spans], dim=2)]

    def copy(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], tokens: int) -> None:
        """Copy the first ``tokens`` positions of each ``(source blocks, destination blocks)``
        pair, one gather and one scatter per layer for all of them."""
        if not pairs:
            return
        src = self._slot_list([(a, tokens) for a, _ in pairs])
        dst = self._slot_list([(b, tokens) for _, b in pairs])
        for layer in range(self.num_layers):
            k, v = self.flat(layer)
            k[dst] = k[src]
            v[dst] = v[src]

    def load(self, items: Sequence[tuple[Sequence[int], KVHandle]]) -> None:
        """Write each handle's KV into its blocks, one scatter per layer for all of them."""
        if not items:
            return
        for _, handle in items:
            data = handle.data
            expect = (self.num_layers, 2, data.shape[2], self.num_kv_heads, self.head_dim)
            if tuple(data.shape) != expect:
                raise ValueError(
                    f"KV handle has shape {tuple(data.shape)} but this model's layout is "
                    f"{expect} (layers, k/v, tokens, kv_heads, head_dim); migrate between "
                    "identical models"
                )
        idx = self._slot_list([(blocks, h.tokens) for blocks, h in items])
        parts = [h.data for _, h in items]
        data = joined_kv(parts)   # the tickets of one message, in order: their block as it is
        if data is None:
            data = torch.cat(parts, dim=2)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer in range(self.num_layers):
            k, v = self.flat(layer)
            k[idx] = data[layer, 0]
            v[idx] = data[layer, 1]


@dataclass
class PagedContext:
    """What one forward call needs to read and write the pool.

    ``write_slots`` (B, T) are where the call's new keys/values go. For decode (T == 1) sample
    i attends over the flat slots ``spans[i] = (start, length)`` (its consecutive blocks);
    prefill (B == 1) attends over its own fresh keys causally, since it always starts from an
    empty context.
    """

    pool: PagedKVPool
    write_slots: torch.Tensor
    decode: bool
    spans: list[tuple[int, int]] | None = None
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    triton_fn: Callable[..., torch.Tensor] | None = None
    #: What every layer of one decode step reads the same way (the padded gather index),
    #: built by the first layer.
    per_step: dict[str, Any] = field(default_factory=dict)


def _write(ctx: PagedContext, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    k, v = ctx.pool.flat(layer)
    # (B, H, T, D) -> (B*T, H, D), matching write_slots flattened row-major.
    b, h, t, d = key.shape
    slots = ctx.write_slots.reshape(-1)
    k.index_copy_(0, slots, key.transpose(1, 2).reshape(b * t, h, d).to(k.dtype))
    v.index_copy_(0, slots, value.transpose(1, 2).reshape(b * t, h, d).to(v.dtype))


# Below this context length one padded SDPA over the batch beats one SDPA per sample on CPU
# (measured: ~0.16 us per padded token vs ~11 us of per-call overhead).
PADDED_MAX_LEN = 64


def _decode_torch(
    ctx: PagedContext, layer: int, query: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Decode attention on CPU (and the GPU fallback).

    Short contexts: one padded SDPA over the batch. Long ones: one SDPA per sample over its own
    context slice, so a ragged long-tail batch costs its real tokens instead of B times the
    longest one.
    """
    k, v = ctx.pool.flat(layer)
    assert ctx.spans is not None
    gqa = query.shape[1] != k.shape[1]
    lmax = max(n for _, n in ctx.spans)
    if lmax <= PADDED_MAX_LEN:
        gather = ctx.per_step.get("padded")
        if gather is None:
            pos = torch.arange(lmax, device=k.device)
            starts = torch.tensor([a for a, _ in ctx.spans], device=k.device)
            lens = torch.tensor([n for _, n in ctx.spans], device=k.device)
            valid = pos[None, :] < lens[:, None]
            idx = torch.where(valid, starts[:, None] + pos[None, :], starts[:, None])
            gather = ctx.per_step["padded"] = (idx, valid[:, None, None])
        idx, mask = gather
        keys = k[idx].transpose(1, 2).to(query.dtype)
        vals = v[idx].transpose(1, 2).to(query.dtype)
        return F.scaled_dot_product_attention(query, keys, vals, attn_mask=mask,
                                              scale=scaling, enable_gqa=gqa)
    outs = []
    for i, (start, length) in enumerate(ctx.spans):
        keys = k[start: start + length].transpose(0, 1)[None].to(query.dtype)
        vals = v[start: start + length].transpose(0, 1)[None].to(query.dtype)
        outs.append(F.scaled_dot_product_attention(query[i: i + 1], keys, vals, scale=scaling,
                                                   enable_gqa=gqa))
    return torch.cat(outs)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_kv: PagedContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention interface: (B, H, T, D) inputs, (B, T, H, D) output."""
    if paged_kv is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling,
            is_causal=attention_mask is None and query.shape[2] > 1,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    layer = int(module.layer_idx)
    _write(paged_kv, layer, key, value)
    if not paged_kv.decode:
        out = F.scaled_dot_product_attention(
            query, key, value, scale=scaling, is_causal=query.shape[2] > 1,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    elif paged_kv.triton_fn is not None:
        out = paged_kv.triton_fn(
            query[:, :, 0, :].contiguous(), paged_kv.pool.k[layer], paged_kv.pool.v[layer],
            paged_kv.block_table, paged_kv.seq_lens,
            sm_scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        )[:, :, None, :]
    else:
        out = _decode_torch(paged_kv, layer, query, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register :func:`paged_attention_forward` with transformers (through the package's one
    registration function, idempotent) and return its ``attn_implementation`` name.

    No mask function is registered: the model passes no mask, and the paged context (or,
    without one, causal SDPA) says what each query attends to.
    """
    from ..triton_kernels.decode_attention import register_transformers_attention

    return register_transformers_attention(ATTN_IMPL_NAME, paged_attention_forward,
                                           sdpa_masks=False)


def load_triton_decode(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton decode kernel when it can run here, else None (the torch path is used)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        from rlhf_fusion.triton_kernels.decode_attention import decode_attention
    except Exception as exc:  # not landed yet, or triton missing: the torch path is correct
        warnings.warn(f"Triton decode kernel unavailable ({exc}); using torch attention",
                      stacklevel=2)
        return None
    return decode_attention
