"""Decode attention over a paged KV cache: one new query token per sequence.

Layout (the vLLM / FlashAttention paged layout):

* ``q``: ``[B, Hq, D]``, the new token's queries;
* ``k_cache``, ``v_cache``: ``[num_pages, page_size, Hkv, D]``; any strides;
* ``block_table``: ``[B, max_pages]`` int32/int64, page ids of each sequence in order;
* ``seq_lens``: ``[B]`` int, tokens in the cache per sequence (0 allowed: the output is 0).

The Triton kernel runs one program per (sequence, KV head, split): all ``Hq / Hkv`` query heads
that share a KV head are handled by the same program, so every K/V tile is read from memory once
(grouped-query attention). Each split covers a contiguous range of the sequence's tokens with an
online softmax; with more than one split, a second small kernel merges the partial results with
their log-sum-exp. Sequence lengths are read on the device and the number of splits is chosen
from shapes only, so a call never synchronises with the host and can be captured in a CUDA
graph. Page addresses are computed in int64.

:func:`register_transformers_attention` makes the kernel available to ``transformers`` models as
``attn_implementation="rlhf_fusion_paged"``: decode steps go to the kernel (on GPU), everything
else to SDPA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from ._triton_utils import HAS_TRITON, check_launchable, is_interpreted, jit, tl

__all__ = [
    "ATTENTION_NAME",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_torch",
    "decode_attention_triton",
    "register_transformers_attention",
    "transformers_attention_forward",
]

ATTENTION_NAME = "rlhf_fusion_paged"
Backend = Literal["auto", "triton", "torch"]
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [num_pages, page_size, kv_heads, head_dim], got {tuple(t.shape)}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match"
        )
    bsz, hq, dim = q.shape
    _, page_size, hkv, kdim = k_cache.shape
    if kdim != dim:
        raise ValueError(f"head_dim of q ({dim}) and of the cache ({kdim}) differ")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    if page_size < 1:
        raise ValueError("page_size (k_cache.shape[1]) must be at least 1")
    if block_table.dim() != 2 or block_table.shape[0] != bsz:
        raise ValueError(
            f"block_table must be [batch={bsz}, max_pages], got {tuple(block_table.shape)}"
        )
    if seq_lens.shape != (bsz,):
        raise ValueError(f"seq_lens must be [batch={bsz}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not q.is_floating_point() or k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"q must be floating point and k/v caches share a dtype; got q {q.dtype}, "
            f"k {k_cache.dtype}, v {v_cache.dtype}"
        )
    return bsz, hq, hkv, dim, page_size


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
) -> torch.Tensor:
    """Naive definition: gather each sequence's tokens page by page, run torch SDPA in float32.

    Python loops and host reads: for tests only.
    """
    bsz, hq, hkv, dim, page_size = _check(q, k_cache, v_cache, block_table, seq_lens)
    out = torch.zeros(bsz, hq, dim, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        n = int(seq_lens[b])
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        pages = block_table[b, tok // page_size].long()
        k = k_cache[pages, tok % page_size].float()  # [n, Hkv, D]
        v = v_cache[pages, tok % page_size].float()
        k = k.permute(1, 0, 2).repeat_interleave(hq // hkv, dim=0)  # [Hq, n, D]
        v = v.permute(1, 0, 2).repeat_interleave(hq // hkv, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b].float()[:, None, :], k, v, scale=sm_scale
        )
        out[b] = o[:, 0, :]
    return out.to(q.dtype)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
) -> torch.Tensor:
    """Vectorised torch implementation (the fallback): gather all pages, masked SDPA.

    Reads the whole block table (its capacity, not the true lengths), so it is no faster than
    it needs to be; it is there so that every device has an implementation.
    """
    bsz, hq, hkv, dim, page_size = _check(q, k_cache, v_cache, block_table, seq_lens)
    cap = block_table.shape[1] * page_size
    tok = torch.arange(cap, device=q.device)
    pages = block_table[:, tok // page_size].long().clamp(0, k_cache.shape[0] - 1)  # [B, cap]
    slots = (tok % page_size).expand(bsz, cap)
    k = k_cache[pages, slots].to(q.dtype).permute(0, 2, 1, 3)  # [B, Hkv, cap, D]
    v = v_cache[pages, slots].to(q.dtype).permute(0, 2, 1, 3)
    valid = tok[None, :] < seq_lens[:, None]  # [B, cap]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=sm_scale
    )[:, :, 0, :]
    # An empty sequence has no key to attend to: SDPA gives NaN, the contract says 0.
    return torch.where((seq_lens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype))


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _decode_split_kernel(
    Q, K, V, BT, SL, Out, PO, PL,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btp,
    stride_ob, stride_oh, stride_od,
    stride_pob, stride_poh, stride_pos, stride_pod,
    stride_plb, stride_plh, stride_pls,
    qk_scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    seq_len = tl.load(SL + b).to(tl.int32)
    # Splits of whole BLOCK_N tiles, sized from this sequence's own length (read on device).
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = (hk * GROUP + g).to(tl.int64)
    q = tl.load(
        Q + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head = K + hk64 * stride_kh
    v_head = V + hk64 * stride_vh
    bt_row = BT + b64 * stride_btb

    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(bt_row + (n // PAGE_SIZE) * stride_btp, mask=nmask, other=0).to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(
            k_head + (page * stride_kp + slot * stride_ks)[:, None] + d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        # every tile has at least one valid token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + (page * stride_vp + slot * stride_vs)[:, None] + d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # empty split or sequence: 0, not NaN
    out_mask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            Out + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        sp64 = sp.to(tl.int64)
        tl.store(
            PO
            + b64 * stride_pob
            + heads[:, None] * stride_poh
            + sp64 * stride_pos
            + d[None, :] * stride_pod,
            out,
            mask=out_mask,
        )
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(PL + b64 * stride_plb + heads * stride_plh + sp64 * stride_pls, lse, mask=gmask)


@jit
def _decode_merge_kernel(
    PO, PL, Out,
    stride_pob, stride_poh, stride_pos, stride_pod,
    stride_plb, stride_plh, stride_pls,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b64 = tl.program_id(0).to(tl.int64)
    h64 = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    dmask = d < HEAD_DIM
    lse = tl.load(
        PL + b64 * stride_plb + h64 * stride_plh + s * stride_pls, mask=smask, other=float("-inf")
    )
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # all splits empty: weights 0, output 0
    wts = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
    o = tl.load(
        PO
        + b64 * stride_pob
        + h64 * stride_poh
        + s[:, None] * stride_pos
        + d[None, :] * stride_pod,
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    tot = tl.sum(wts, axis=0)
    out = tl.sum(wts[:, None] * o, axis=0) / tl.where(tot > 0.0, tot, 1.0)
    tl.store(
        Out + b64 * stride_ob + h64 * stride_oh + d * stride_od,
        out.to(Out.dtype.element_ty),
        mask=dmask,
    )


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(q: torch.Tensor, bsz: int, hkv: int, capacity: int) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU twice; shape-only, so no sync."""
    sms = _sm_count(q.device.index or 0) if q.is_cuda else 16
    want = -(-2 * sms // max(1, bsz * hkv))
    # a split shorter than a few tiles costs more in merging than it saves
    return max(1, min(want, capacity // 256, _MAX_SPLITS))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernel (split-K, GQA-grouped); CUDA tensors, or CPU under TRITON_INTERPRET=1."""
    bsz, hq, hkv, dim, page_size = _check(q, k_cache, v_cache, block_table, seq_lens)
    interpreted = check_launchable(
        _decode_split_kernel, "decode_attention_triton", q, k_cache, v_cache, block_table, seq_lens
    )
    if num_splits is None:
        num_splits = _default_splits(q, bsz, hkv, block_table.shape[1] * page_size)
    num_splits = int(num_splits)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits={num_splits} must be in [1, 1024]")
    out = torch.empty(bsz, hq, dim, dtype=q.dtype, device=q.device)
    if bsz == 0 or hq == 0:
        return out
    group = hq // hkv
    block_g, block_d, block_n, num_warps = _tile_config(group, dim)
    native = (not interpreted) and q.dtype in (torch.float16, torch.bfloat16)
    native = native and k_cache.dtype == q.dtype
    if num_splits > 1:
        part_o = torch.empty(bsz, hq, num_splits, dim, dtype=torch.float32, device=q.device)
        part_l = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused: the split kernel writes the output directly
        part_o = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
        part_l = out.new_empty(1, 1, 1, dtype=torch.float32)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_l,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
        *part_o.stride(), *part_l.stride(),
        sm_scale * _LOG2E,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, NATIVE_DOT=native,
        num_warps=num_warps, enable_fp_fusion=True,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(bsz, hq)](
            part_o, part_l, out,
            *part_o.stride(), *part_l.stride(), *out.stride(),
            HEAD_DIM=dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=max(2, triton_next_pow2(num_splits)),
            num_warps=4, enable_fp_fusion=True,
        )  # fmt: skip
    return out


def triton_next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _tile_config(group: int, dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_G, BLOCK_D, BLOCK_N, num_warps) for a GQA group size and head dim.

    tl.dot needs at least 16 rows, so small groups are padded to 16. A K/V tile is gathered row
    by row through the block table, i.e. one 64-bit address per element: at 64 x 128 elements,
    4 warps spill registers (checked by tests/test_kernel_compile.py), 8 do not.
    """
    block_g = max(16, triton_next_pow2(group))
    block_d = max(16, triton_next_pow2(dim))
    block_n = 64 if block_d <= 128 else 32
    num_warps = 8 if block_n * block_d >= 8192 or block_g * block_d >= 8192 else 4
    return block_g, block_d, block_n, num_warps


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_splits: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of one new token per sequence over a paged KV cache; returns ``[B, Hq, D]``
    in ``q``'s dtype. See the module docstring for the layout.

    ``backend="auto"`` runs the Triton kernel on CUDA tensors when Triton is installed and the
    torch implementation otherwise. ``num_splits`` (Triton only) defaults to a shape-based
    choice that fills the GPU.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'triton' or 'torch'")
    if backend == "triton" or (backend == "auto" and HAS_TRITON and q.is_cuda):
        return decode_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, sm_scale=sm_scale, num_splits=num_splits
        )
    return decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, sm_scale=sm_scale)


# --------------------------------------------------------------------------------------------
# transformers integration
# --------------------------------------------------------------------------------------------


def _kernel_usable(query: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return query.is_cuda or is_interpreted(_decode_split_kernel)


def _paged_view(
    cache: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """View a ``[B, Hkv, S, D]`` cache as pages without copying it.

    No mask: one page per sequence holding all S tokens. With a mask (left padding, holes):
    one page per token slot, and each row of the block table lists that row's valid slots.
    """
    bsz, hkv, slen, dim = cache.shape
    sb, sh, ss, sd = cache.stride()
    device = cache.device
    if valid is None:
        pages = cache.permute(0, 2, 1, 3)  # [B, S, Hkv, D]
        table = torch.arange(bsz, device=device, dtype=torch.int32)[:, None]
        lens = torch.full((bsz,), slen, device=device, dtype=torch.int32)
        return pages, table, lens
    if ss == 0 or sb % ss != 0:
        return None
    per_row = sb // ss
    pages = cache.as_strided(((bsz - 1) * per_row + slen, 1, hkv, dim), (ss, ss, sh, sd))
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid slots first
    table = torch.arange(bsz, device=device, dtype=torch.int64)[:, None] * per_row + order
    lens = valid.sum(dim=1, dtype=torch.int32)
    return pages, table, lens


def transformers_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function: the decode kernel for single-token decode steps,
    SDPA for everything else (prefill, training, sinks, soft-capping, paged continuous
    batching caches, dropout)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    decode_step = (
        query.shape[2] == 1
        and dropout == 0.0
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and kwargs.get("sinks") is None
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions", False)
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and key.shape[2] > 0
        and _kernel_usable(query)
    )
    valid = None
    if decode_step and attention_mask is not None:
        mask = attention_mask[:, 0, -1, :] if attention_mask.dim() == 4 else None
        if mask is None or mask.shape != (key.shape[0], key.shape[2]):
            decode_step = False
        else:
            valid = mask if mask.dtype == torch.bool else mask == 0
    kv = None
    if decode_step:
        kv = (_paged_view(key, valid), _paged_view(value, valid))
        if kv[0] is None or kv[1] is None:
            decode_step = False
    if not decode_step or kv is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    (k_pages, table, lens), (v_pages, _, _) = kv  # type: ignore[misc]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = decode_attention_triton(query[:, :, 0, :], k_pages, v_pages, table, lens, sm_scale=scale)
    return out[:, None, :, :], None


def register_transformers_attention(
    name: str = ATTENTION_NAME,
    forward: Callable[..., tuple[torch.Tensor, None]] = transformers_attention_forward,
    *,
    sdpa_masks: bool = True,
) -> str:
    """Register an attention function with ``transformers`` and return the
    ``attn_implementation`` name; registering a name again replaces its function.

    The only place the package registers attention: by default the decode kernel above
    (:func:`transformers_attention_forward`); ``rollout.paged`` registers its paged attention
    through here too. With ``sdpa_masks`` the model builds masks for ``name`` like SDPA's (4-D
    boolean, or None when nothing is masked); without, it passes no mask at all.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, forward)
    if sdpa_masks:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name
