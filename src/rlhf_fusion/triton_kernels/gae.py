"""Generalized Advantage Estimation as a blocked matrix product.

The recursion every RLHF trainer runs backwards over the response,

    lastgaelam = delta_t + gamma * lam * lastgaelam,

is linear, so with w = gamma * lam it unrolls to ``A = delta @ U.T`` with the upper triangular
Toeplitz matrix ``U[t, k] = w**(k - t)`` (k >= t). Building U for the whole response would cost
T**2 memory and its far powers underflow into denormals, so the product is *blocked* over time:
each block of ``BLK`` steps is multiplied by the small ``BLK x BLK`` U, and blocks are chained by
a carry, the value at the first step of the next block scaled by ``w**(steps to the block end)``.
All powers stay within one block (or one level of the carry hierarchy) and are flushed to zero
below the smallest normal float, so nothing ever runs on denormals.

Two mask semantics are in use in the wild and both are provided:

``"zero"`` (TRL, OpenRLHF, NeMo)
    Rewards and values are multiplied by the mask and the recursion runs through padding.
``"skip"`` (verl)
    Masked positions are passed over: ``delta`` at a valid token bootstraps from the *next valid*
    token's value, and at a masked position the running advantage (and the next value) is carried
    through unchanged. The decay is then ``w`` per *valid* token, so U is the same Toeplitz matrix
    in valid-token time: ``U[t, k] = w**(number of valid tokens in [t, k))``.

This module holds, in the style of one file per op:

* :func:`gae_reference` -- the reverse Python loop exactly as TRL and verl write it (the definition
  the other implementations are tested against; also the benchmark baseline);
* :func:`gae_torch` -- the blocked formulation in plain torch, the CPU (and no-Triton) fallback;
* ``_gae_kernel`` + :func:`gae_triton` -- the Triton kernel and its launcher (one launch, fp32
  products with IEEE precision, any input float dtype, arbitrary strides, padded or packed);
* :func:`gae` / :func:`gae_packed` -- the public entry points, dispatching to the kernel for CUDA
  tensors when Triton is available and to :func:`gae_torch` otherwise.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Literal

import torch
import torch.nn.functional as F

from ._triton_utils import HAS_TRITON, check_launchable, jit, tl

__all__ = [
    "gae",
    "gae_packed",
    "gae_reference",
    "gae_packed_reference",
    "gae_torch",
    "gae_triton",
]

Semantics = Literal["zero", "skip"]
Backend = Literal["auto", "triton", "torch"]

# Block length of the torch path: a [.., 64] x [64, 64] GEMM per block is where the CPU matmul is
# efficient while the carry recursion stays two levels deep for T up to 4096.
TORCH_BLOCK = 64
_FLT_MIN = torch.finfo(torch.float32).tiny
# log2(0) is -inf and 0 * -inf is NaN; any finite value this negative flushes every power >= 1
# to zero while keeping w**0 == 1, so lam == 0 needs no special case inside the kernel.
_LOG2_ZERO = -1.0e4

# Triton tile shapes. "zero": a chunk is R x BLK steps of one sequence; the R sub-blocks are the
# rows of one tl.dot with the shared BLK x BLK matrix. "skip": U differs per sub-block, so the
# product is a batched mat-vec over an [R, BLK, BLK] tile; smaller tiles keep it in registers.
# 8 warps for "zero": with 4, ptxas spills on sm_80 (tests/test_kernel_compile.py).
_ZERO_R, _ZERO_BLK, _ZERO_WARPS = 16, 32, 8
_SKIP_R, _SKIP_BLK, _SKIP_WARPS = 8, 16, 4


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check_common(gamma: float, lam: float, semantics: str) -> tuple[float, float]:
    if semantics not in ("zero", "skip"):
        raise ValueError(
            f"semantics={semantics!r} is not supported; use 'zero' (TRL/OpenRLHF: rewards and "
            "values multiplied by the mask) or 'skip' (verl: masked positions are passed over)"
        )
    gamma_f, lam_f = float(gamma), float(lam)
    for name, val in (("gamma", gamma_f), ("lam", lam_f)):
        if not (0.0 <= val <= 1.0):
            raise ValueError(f"{name}={val} must lie in [0, 1]")
    return gamma_f, lam_f


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}; cast it first")


def _check_inputs(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    ndim: int,
) -> None:
    _check_float("rewards", rewards)
    _check_float("values", values)
    layout = "[batch, time]" if ndim == 2 else "[total_tokens] (packed)"
    if rewards.dim() != ndim:
        raise ValueError(f"rewards must have shape {layout}, got {tuple(rewards.shape)}")
    if values.shape != rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} must equal rewards shape {tuple(rewards.shape)}"
        )
    if values.device != rewards.device:
        raise ValueError(f"values is on {values.device} but rewards is on {rewards.device}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.shape != rewards.shape:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must equal rewards shape {tuple(rewards.shape)}"
            )
        if mask.device != rewards.device:
            raise ValueError(f"mask is on {mask.device} but rewards is on {rewards.device}")


def _bootstrap_tensor(
    bootstrap: torch.Tensor | float | None, n: int, device: torch.device
) -> torch.Tensor | None:
    """Per-sequence value after the last position, as an [n] float32 tensor (None: zero)."""
    if bootstrap is None:
        return None
    if isinstance(bootstrap, torch.Tensor):
        if bootstrap.dim() == 0:
            return bootstrap.to(device=device, dtype=torch.float32).expand(n).contiguous()
        if bootstrap.shape != (n,):
            raise ValueError(
                f"bootstrap must be a scalar or have shape ({n},) (one value per sequence), "
                f"got {tuple(bootstrap.shape)}"
            )
        if bootstrap.device != device:
            raise ValueError(f"bootstrap is on {bootstrap.device} but rewards is on {device}")
        return bootstrap.to(torch.float32)
    return torch.full((n,), float(bootstrap), dtype=torch.float32, device=device)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> None:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            "cu_seqlens must be a 1-D integer tensor [num_seqs + 1] of cumulative lengths "
            "starting at 0"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but rewards is on {device}")
    if not cu_seqlens.is_cuda:  # validating a device tensor would synchronise; CPU is free
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the number of tokens ({total}), got "
                f"{int(cu_seqlens[0])} .. {int(cu_seqlens[-1])}"
            )
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")


# --------------------------------------------------------------------------------------------
# reference: the reverse loop as the trainers write it
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by the reverse Python loop, computed in ``dtype`` (float64 by default).

    ``"zero"`` follows TRL's ``PPOTrainer`` / OpenRLHF's ``get_advantages_and_returns`` (values and
    rewards masked to zero first; ``bootstrap`` replaces the 0 that follows the last step);
    ``"skip"`` follows verl's ``compute_gae_advantage_return`` (without its whitening).
    Returns ``(advantages, returns)`` in ``dtype``.
    """
    gamma, lam = _check_common(gamma, lam, semantics)
    _check_inputs(rewards, values, mask, 2)
    bsz, steps = rewards.shape
    rewards = rewards.to(dtype)
    values = values.to(dtype)
    boot = _bootstrap_tensor(bootstrap, bsz, rewards.device)
    boot = torch.zeros(bsz, dtype=dtype, device=rewards.device) if boot is None else boot.to(dtype)
    m = torch.ones_like(rewards) if mask is None else (mask != 0).to(dtype)
    advantages_reversed = []
    if semantics == "zero":
        values = torch.where(m != 0, values, 0.0)
        rewards = torch.where(m != 0, rewards, 0.0)
        lastgaelam = 0
        for t in reversed(range(steps)):
            nextvalues = values[:, t + 1] if t < steps - 1 else boot
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
    else:
        nextvalues = boot
        lastgaelam = 0
        for t in reversed(range(steps)):
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
    if steps == 0:
        advantages = torch.zeros_like(rewards)
    else:
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages, returns


def gae_packed_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reverse loop run on each packed sequence separately (for tests)."""
    _check_inputs(rewards, values, mask, 1)
    cu = cu_seqlens.tolist()
    boot = _bootstrap_tensor(bootstrap, len(cu) - 1, rewards.device)
    adv = torch.zeros(rewards.shape, dtype=dtype, device=rewards.device)
    ret = torch.zeros_like(adv)
    for i in range(len(cu) - 1):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        a, r = gae_reference(
            rewards[None, lo:hi],
            values[None, lo:hi],
            None if mask is None else mask[None, lo:hi],
            gamma=gamma,
            lam=lam,
            semantics=semantics,
            bootstrap=None if boot is None else boot[i : i + 1],
            dtype=dtype,
        )
        adv[lo:hi], ret[lo:hi] = a[0], r[0]
    return adv, ret


# --------------------------------------------------------------------------------------------
# torch: the blocked formulation (CPU fallback)
# --------------------------------------------------------------------------------------------


def _flushed_pow(w: float, exponents: torch.Tensor) -> torch.Tensor:
    """w ** exponents in float64, with results below the smallest normal float32 set to 0."""
    p = torch.pow(torch.tensor(w, dtype=torch.float64), exponents.to(torch.float64))
    return torch.where(p < _FLT_MIN, torch.zeros_like(p), p)


@functools.lru_cache(maxsize=64)
def _block_mats(w: float, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ut, tail): Ut[k, t] = w**(k - t) for k >= t (so x @ Ut is the in-block discounted suffix
    sum) and tail[t] = w**(n - t), the weight of the carry entering the block at its end."""
    idx = torch.arange(n)
    d = idx[:, None] - idx[None, :]  # k - t
    ut = torch.where(d >= 0, _flushed_pow(w, d.clamp(min=0)), torch.zeros((), dtype=torch.float64))
    tail = _flushed_pow(w, n - idx)
    return ut.to(torch.float32).to(device), tail.to(torch.float32).to(device)


def _discounted_suffix_sum(
    x: torch.Tensor, w: float, block: int = TORCH_BLOCK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y[..., t] = sum_{k >= t} w**(k - t) x[..., k] along the last dim, blocked.

    Blocks of ``block`` steps are multiplied by the block's Toeplitz matrix (one GEMM for all of
    them); the values at the blocks' first steps obey the same recursion with decay ``w**block``
    over ``T / block`` steps, which is solved the same way, recursively. ``out`` (same shape
    as ``x``, contiguous, not aliasing it) receives the result when the blocks tile T exactly.
    """
    steps = x.shape[-1]
    if steps == 0:
        return x.clone()
    if steps <= block:
        ut, _ = _block_mats(w, steps, str(x.device))
        return x @ ut
    nb = -(-steps // block)
    if nb * block != steps:
        x = F.pad(x, (0, nb * block - steps))  # zeros after the end contribute nothing
        out = None
    ut, tail = _block_mats(w, block, str(x.device))
    blocks = x.reshape(*x.shape[:-1], nb, block)
    if out is not None:
        loc = torch.matmul(blocks, ut, out=out.view(blocks.shape))
    else:
        loc = blocks @ ut
    w_block = w**block
    w_block = 0.0 if w_block < _FLT_MIN else w_block
    heads = _discounted_suffix_sum(loc[..., 0], w_block, block)
    carry = F.pad(heads[..., 1:], (0, 1))  # value at the first step of the next block
    loc.addcmul_(carry.unsqueeze(-1), tail)
    out = loc.reshape(*x.shape[:-1], nb * block)
    return out if nb * block == steps else out[..., :steps]


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


@torch.no_grad()
def gae_torch(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked GAE in plain torch (any device); float32 ``(advantages, returns)``.

    ``"skip"`` is computed in valid-token time: the valid tokens of each row are compacted to the
    front (a scatter), the constant-decay blocked product runs on them, and each position reads
    back the advantage of the first valid token at or after it (a gather), which is exactly what
    carrying the running advantage through masked positions does.
    """
    gamma, lam = _check_common(gamma, lam, semantics)
    _check_inputs(rewards, values, mask, 2)
    bsz, steps = rewards.shape
    boot = _bootstrap_tensor(bootstrap, bsz, rewards.device)
    r = rewards.to(torch.float32)
    v = values.to(torch.float32)
    w = gamma * lam
    if mask is None:
        semantics = "zero"  # without masked positions the two semantics coincide
    # Large temporaries are few and reused in place: every fresh multi-MB allocation can cost
    # its page faults again (the allocator returns big blocks to the OS), which on the CPU is
    # as expensive as the arithmetic.
    if semantics == "zero":
        if mask is None:
            delta = r - v
            vm = v
        else:
            keep = _as_bool(mask)
            vm = torch.where(keep, v, 0.0)
            delta = torch.where(keep, r, 0.0)
            delta.sub_(vm)
        if steps:
            delta[:, :-1].add_(vm[:, 1:], alpha=gamma)
            if boot is not None:
                delta[:, -1].add_(boot, alpha=gamma)
        adv = _discounted_suffix_sum(delta, w)
        ret = vm.add_(adv) if mask is not None else adv + vm
        return adv, ret

    if steps == 0:
        z = torch.zeros(bsz, 0, dtype=torch.float32, device=r.device)
        return z, z.clone()
    m = _as_bool(mask)
    dev = r.device
    # excl[t]: valid tokens before t = index, in the compacted row, of the first valid token at
    # or after t. It is < T for every position whenever some token is masked.
    excl = _workspace("excl", (bsz, steps), torch.int64, dev)
    dest = _workspace("dest", (bsz, steps), torch.int64, dev)
    dest[:, 0] = 0
    dest[:, 1:] = m[:, :-1]
    torch.cumsum(dest, dim=1, out=excl)
    n_valid = excl[:, -1:] + m[:, -1:]
    # Compaction: valid tokens go to their slot, masked ones to a scratch column T.
    torch.where(m, excl, excl.new_full((), steps), out=dest)
    rc = _workspace("rc", (bsz, steps + 1), torch.float32, dev).zero_()
    vc = _workspace("vc", (bsz, steps + 1), torch.float32, dev).zero_()
    rc.scatter_(1, dest, r)
    vc.scatter_(1, dest, v)
    # zero beyond the last valid token
    delta_c = torch.sub(
        rc[:, :steps], vc[:, :steps], out=_workspace("dc", (bsz, steps), torch.float32, dev)
    )
    delta_c[:, :-1].add_(vc[:, 1:steps], alpha=gamma)
    if boot is not None:
        last = (n_valid - 1).clamp(min=0)
        delta_c.scatter_add_(1, last, gamma * boot[:, None] * (n_valid > 0))
    adv_c = _discounted_suffix_sum(
        delta_c, w, out=_workspace("adv_c", (bsz, steps), torch.float32, dev)
    )
    adv = torch.gather(adv_c, 1, excl)
    return adv, adv + v


_WORKSPACE = threading.local()
_WORKSPACE_MAX_BYTES = 8 * 2**20  # per buffer: at most 32 MiB kept per thread


def _workspace(name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
    """A scratch tensor reused across calls on this thread (CPU only, up to 8 MiB each).

    The skip path needs several batch-sized temporaries; allocated afresh, the allocator hands
    big blocks back to the OS after every call and the next call pays the page faults again,
    which costs as much as the arithmetic. Never returned to the caller.
    """
    numel = shape[0] * shape[1]
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes > _WORKSPACE_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    bufs = _WORKSPACE.__dict__.setdefault("bufs", {})
    buf = bufs.get(name)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        bufs[name] = buf
    return buf[:numel].view(shape)


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@jit
def _flushed_exp2(e):
    # 2**e for e <= 0, flushed to exactly 0 where the result would be denormal
    return tl.where(e >= -126.0, tl.exp2(tl.minimum(e, 0.0)), 0.0)


@jit
def _gae_load_chunk(
    R, V, M, r_base, v_base, m_base, stride_rt, stride_vt, stride_mt, pos, length,
    HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    # Raw loads only: converting here would make the caller wait for them right away.
    inr = pos >= 0
    r = tl.load(R + r_base + pos * stride_rt, mask=inr, other=0.0)
    v = tl.load(V + v_base + pos * stride_vt, mask=inr, other=0.0)
    if HAS_MASK:
        m = tl.load(M + m_base + pos * stride_mt, mask=inr, other=0)
    else:
        m = inr
    if SKIP:
        vn = v
        mn = m
    else:
        # "zero" needs the next step's (masked) value; mostly L1 hits
        nxt = pos + 1
        has_nxt = inr & (nxt < length)
        vn = tl.load(V + v_base + nxt * stride_vt, mask=has_nxt, other=0.0)
        if HAS_MASK:
            mn = tl.load(M + m_base + nxt * stride_mt, mask=has_nxt, other=0)
        else:
            mn = has_nxt
    return r, v, m, vn, mn


@jit
def _gae_kernel(
    R, V, M, BOOT, CU, ADV, RET,
    T,
    stride_rb, stride_rt, stride_vb, stride_vt, stride_mb, stride_mt,
    stride_ab, stride_at, stride_ob, stride_ot,
    gamma, log2w,
    HAS_MASK: tl.constexpr, HAS_BOOT: tl.constexpr, PACKED: tl.constexpr, SKIP: tl.constexpr,
    R_SUB: tl.constexpr, BLK: tl.constexpr,
):  # fmt: skip
    # One program per sequence, walking it backwards in chunks of R_SUB x BLK steps. A chunk is
    # laid out as an [R_SUB, BLK] tile whose rows are consecutive blocks of BLK steps.
    pid = tl.program_id(0)
    if PACKED:
        start = tl.load(CU + pid).to(tl.int64)
        length = tl.load(CU + pid + 1).to(tl.int64) - start
        r_base = start * stride_rt
        v_base = start * stride_vt
        m_base = start * stride_mt
        a_base = start * stride_at
        o_base = start * stride_ot
    else:
        row = pid.to(tl.int64)
        length = tl.cast(T, tl.int64)
        r_base = row * stride_rb
        v_base = row * stride_vb
        m_base = row * stride_mb
        a_base = row * stride_ab
        o_base = row * stride_ob
    if HAS_BOOT:
        boot = tl.load(BOOT + pid).to(tl.float32)
    else:
        boot = gamma * 0.0

    CHUNK: tl.constexpr = R_SUB * BLK
    ri = tl.arange(0, R_SUB)
    ti = tl.arange(0, BLK)
    tt = ti[None, :]
    local = ri[:, None] * BLK + tt
    n_chunks = tl.cdiv(length, CHUNK)
    carry_a = gamma * 0.0  # advantage at the first step after the chunk
    carry_v = boot  # skip: value of the first valid step after the chunk

    if not SKIP:
        # U is the same for every block and every chunk: build it once.
        dk = (ti[:, None] - ti[None, :]).to(tl.float32)  # k - t, rows k, columns t
        ek = dk * log2w
        ut = tl.where(dk >= 0, _flushed_exp2(ek), 0.0)
        et = (BLK - tt).to(tl.float32) * log2w
        tail = _flushed_exp2(et)  # [1, BLK]: w^(BLK - t)
        drr = (ri[None, :] - ri[:, None] - 1).to(tl.float32)  # r' - r - 1
        e2 = drr * (BLK * log2w)
        wblk = tl.where(drr >= 0, _flushed_exp2(e2), 0.0)  # [R, R']
        ec = (R_SUB - 1 - ri).to(tl.float32) * (BLK * log2w)
        wcarry = _flushed_exp2(ec)  # [R]: w^(BLK (R - 1 - r))

    # Loads for chunk c + 1 are issued before chunk c is computed (a register double buffer):
    # the addresses do not depend on the carry, so memory latency overlaps the arithmetic.
    pos = (length - CHUNK) + local
    nx = _gae_load_chunk(
        R, V, M, r_base, v_base, m_base, stride_rt, stride_vt, stride_mt, pos, length,
        HAS_MASK, SKIP,
    )  # fmt: skip
    for c in range(0, n_chunks):
        pos = (length - (c + 1) * CHUNK) + local
        r_raw, v_raw, m_raw, vn_raw, mn_raw = nx
        nx = _gae_load_chunk(
            R, V, M, r_base, v_base, m_base, stride_rt, stride_vt, stride_mt, pos - CHUNK, length,
            HAS_MASK, SKIP,
        )  # fmt: skip
        inr = pos >= 0
        r = r_raw.to(tl.float32)
        v = v_raw.to(tl.float32)
        if HAS_MASK:
            m = (m_raw != 0) & inr
        else:
            m = inr
        if not SKIP:
            vm = tl.where(m, v, 0.0)
            rm = tl.where(m, r, 0.0)
            vn = vn_raw.to(tl.float32)
            if HAS_MASK:
                vn = tl.where(mn_raw != 0, vn, 0.0)
            vn = tl.where(pos + 1 < length, vn, boot)
            delta = tl.where(inr, rm + gamma * vn - vm, 0.0)
            loc = tl.dot(delta, ut, input_precision="ieee")  # in-block discounted suffix sums
            head = tl.sum(tl.where(tt == 0, loc, 0.0), axis=1)  # [R]: block-local value at t=0
            # Advantage at the first step of the next block, for every block of the chunk.
            ynext = tl.sum(wblk * head[None, :], axis=1) + wcarry * carry_a
            a = loc + tail * ynext[:, None]
            ret = a + vm
        else:
            mi = m.to(tl.int32)
            s = tl.cumsum(mi, axis=1) - mi  # valid steps before t inside its block
            n = tl.sum(mi, axis=1)  # [R] valid steps per block
            s_k = s[:, None, :]
            s_t = s[:, :, None]
            kk = ti[None, None, :]
            tq = ti[None, :, None]
            # value of the first valid step after t inside the block
            sel = m[:, None, :] & (kk > tq) & (s_k == s_t + mi[:, :, None])
            nv_in = tl.sum(tl.where(sel, v[:, None, :], 0.0), axis=2)
            has_in = (s + mi) < n[:, None]
            # ... or after the block: first valid value of the next non-empty block, or carry
            fv = tl.sum(tl.where(m & (s == 0), v, 0.0), axis=1)  # [R]
            nonempty = n > 0
            ne = nonempty.to(tl.int32)
            kc = tl.cumsum(ne, axis=0)
            k_tot = tl.sum(ne, axis=0)
            later = ri[None, :] > ri[:, None]
            sel2 = later & nonempty[None, :] & (kc[None, :] == kc[:, None] + 1)
            after = tl.sum(tl.where(sel2, fv[None, :], 0.0), axis=1)
            after = tl.where(kc == k_tot, carry_v, after)
            nv = tl.where(has_in, nv_in, after[:, None])
            delta = tl.where(m, r + gamma * nv - v, 0.0)
            # per-block U in valid-token time: w^(valid steps in [t, k))
            e3 = (s_k - s_t).to(tl.float32) * log2w
            u3 = tl.where(kk >= tq, _flushed_exp2(e3), 0.0)
            loc = tl.sum(u3 * delta[:, None, :], axis=2)
            head = tl.sum(tl.where(tt == 0, loc, 0.0), axis=1)
            # carries between blocks: decay w per valid step, p[r] = valid steps in blocks >= r
            p = tl.cumsum(n, axis=0, reverse=True)
            pn = p - n
            e2 = (pn[:, None] - p[None, :]).to(tl.float32) * log2w
            wgt = tl.where(ri[None, :] > ri[:, None], _flushed_exp2(e2), 0.0)
            ec = pn.to(tl.float32) * log2w
            ynext = tl.sum(wgt * head[None, :], axis=1) + _flushed_exp2(ec) * carry_a
            ea = (n[:, None] - s).to(tl.float32) * log2w
            a = loc + _flushed_exp2(ea) * ynext[:, None]
            ret = a + v
            first_fv = tl.sum(tl.where(nonempty & (kc == 1), fv, 0.0), axis=0)
            carry_v = tl.where(k_tot > 0, first_fv, carry_v)
        carry_a = tl.sum(tl.sum(tl.where(local == 0, a, 0.0), axis=1), axis=0)
        tl.store(ADV + a_base + pos * stride_at, a, mask=inr)
        tl.store(RET + o_base + pos * stride_ot, ret, mask=inr)


def _log2w(gamma: float, lam: float) -> float:
    w = gamma * lam
    return _LOG2_ZERO if w <= 0.0 else max(math.log2(w), _LOG2_ZERO)


def _mask_arg(mask: torch.Tensor) -> torch.Tensor:
    # A uint8 view of a bool mask (same bytes, no copy) keeps the kernel's mask loads plain
    # byte loads compared with 0, like every other mask dtype.
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _launch(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    boot: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    gamma: float,
    lam: float,
    semantics: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(_gae_kernel, "gae_triton", rewards, values, mask, boot, cu_seqlens)
    adv = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    ret = torch.empty_like(adv)
    if rewards.numel() == 0 and cu_seqlens is None:
        return adv, ret
    skip = semantics == "skip" and mask is not None
    packed = cu_seqlens is not None
    if packed:
        n_seq = cu_seqlens.numel() - 1
        if n_seq == 0 or rewards.numel() == 0:
            return adv, ret
        strides = [(0, t.stride(0)) for t in (rewards, values)]
        m_strides = (0, mask.stride(0)) if mask is not None else (0, 0)
        o_strides = [(0, 1), (0, 1)]
        length = 0
    else:
        n_seq = rewards.shape[0]
        strides = [tuple(t.stride()) for t in (rewards, values)]
        m_strides = tuple(mask.stride()) if mask is not None else (0, 0)
        o_strides = [tuple(adv.stride()), tuple(ret.stride())]
        length = rewards.shape[1]
    r_sub, blk = (_SKIP_R, _SKIP_BLK) if skip else (_ZERO_R, _ZERO_BLK)
    m_arg = _mask_arg(mask) if mask is not None else rewards
    _gae_kernel[(n_seq,)](
        rewards, values, m_arg,
        boot if boot is not None else rewards,
        cu_seqlens if packed else rewards,
        adv, ret,
        length,
        *strides[0], *strides[1], *m_strides, *o_strides[0], *o_strides[1],
        gamma, _log2w(gamma, lam),
        HAS_MASK=mask is not None, HAS_BOOT=boot is not None, PACKED=packed, SKIP=skip,
        R_SUB=r_sub, BLK=blk,
        num_warps=_SKIP_WARPS if skip else _ZERO_WARPS, enable_fp_fusion=True,
    )  # fmt: skip
    return adv, ret


def gae_triton(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with the Triton kernel: one launch, no host synchronisation.

    CUDA tensors run the compiled kernel; CPU tensors (or ``TRITON_INTERPRET=1``) run the same
    kernel under the Triton interpreter, which is how CI checks it without a GPU.
    """
    gamma, lam = _check_common(gamma, lam, semantics)
    _check_inputs(rewards, values, mask, 2)
    boot = _bootstrap_tensor(bootstrap, rewards.shape[0], rewards.device)
    return _launch(rewards, values, mask, boot, None, gamma, lam, semantics)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def _pick_backend(backend: str, t: torch.Tensor) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'triton' or 'torch'")
    if backend == "auto":
        return "triton" if (HAS_TRITON and t.is_cuda) else "torch"
    return backend


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of ``[batch, time]`` rewards and values (float32).

    Args:
        rewards, values: ``[B, T]``, any float dtype, any strides.
        mask: ``[B, T]`` (bool, or any dtype where non-zero is valid) or None (all valid). Right
            padding, left padding and multi-turn masks with holes are all just masks.
        gamma, lam: discount and GAE lambda, in [0, 1].
        semantics: ``"zero"`` (TRL/OpenRLHF/NeMo) or ``"skip"`` (verl); see the module doc.
        bootstrap: value after the last position, per sequence (``[B]``) or scalar; default 0.
        backend: ``"auto"`` runs the Triton kernel for CUDA tensors when Triton is installed and
            the blocked torch implementation otherwise.

    Returns:
        ``(advantages, returns)``, float32 ``[B, T]``; ``returns = advantages + values`` (values
        masked to zero under ``"zero"``, as the trainers do). Advantages are not whitened.
    """
    if _pick_backend(backend, rewards) == "triton":
        return gae_triton(
            rewards, values, mask, gamma=gamma, lam=lam, semantics=semantics, bootstrap=bootstrap
        )
    return gae_torch(
        rewards, values, mask, gamma=gamma, lam=lam, semantics=semantics, bootstrap=bootstrap
    )


def _gae_packed_torch(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None,
    boot: torch.Tensor | None,
    gamma: float,
    lam: float,
    semantics: Semantics,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Left-pad every sequence to the longest one: padding then comes *before* each sequence,
    # where the backward recursion never reaches, and the bootstrap lands right after its end.
    device = rewards.device
    n_seq = cu_seqlens.numel() - 1
    total = rewards.shape[0]
    if n_seq == 0 or total == 0:
        z = torch.zeros(total, dtype=torch.float32, device=device)
        return z, z.clone()
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    width = int(lens.max())
    seq = torch.repeat_interleave(torch.arange(n_seq, device=device), lens, output_size=total)
    tok = torch.arange(total, device=device)
    col = tok - cu[seq] + (width - lens[seq])
    shape = (n_seq, width)
    r = torch.zeros(shape, dtype=torch.float32, device=device)
    r.index_put_((seq, col), rewards.float())
    v = torch.zeros_like(r)
    v.index_put_((seq, col), values.float())
    m = torch.zeros(shape, dtype=torch.bool, device=device)
    m.index_put_((seq, col), torch.ones_like(tok, dtype=torch.bool) if mask is None else mask != 0)
    adv, _ = gae_torch(r, v, m, gamma=gamma, lam=lam, semantics=semantics, bootstrap=boot)
    adv = adv[seq, col]
    vals = values.float()
    if semantics == "zero" and mask is not None:
        vals = torch.where(mask != 0, vals, 0.0)
    return adv, adv + vals


def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lam: float,
    semantics: Semantics = "zero",
    bootstrap: torch.Tensor | float | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over packed sequences: ``rewards``/``values``/``mask`` are ``[total_tokens]`` and
    sequence ``i`` is ``[cu_seqlens[i], cu_seqlens[i + 1])`` (empty sequences allowed).

    Each sequence is its own episode (``bootstrap[i]`` follows its last token); the Triton path
    reads the boundaries on the device, so there is no host synchronisation.
    """
    gamma, lam = _check_common(gamma, lam, semantics)
    _check_inputs(rewards, values, mask, 1)
    _check_cu_seqlens(cu_seqlens, rewards.shape[0], rewards.device)
    boot = _bootstrap_tensor(bootstrap, cu_seqlens.numel() - 1, rewards.device)
    if _pick_backend(backend, rewards) == "triton":
        return _launch(rewards, values, mask, boot, cu_seqlens, gamma, lam, semantics)
    return _gae_packed_torch(rewards, values, cu_seqlens, mask, boot, gamma, lam, semantics)
