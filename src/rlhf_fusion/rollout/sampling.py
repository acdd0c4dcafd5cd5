"""Sampling whose randomness is keyed on (seed, sample_id, position).

The token drawn at response position ``p`` of sample ``i`` is ``argmax(logits/T + g)`` where
``g`` is Gumbel noise computed by a counter-based hash of ``(seed, i, p, vocab index)``. It is
a pure function of the logits and the key: batching, the instance a sample runs on, and
migration cannot change it (Gumbel-max is an exact sample from softmax(logits/T)).

The hash runs in numpy uint64, whose wrap-around multiplication is defined behaviour, and is
identical on every platform. Logits on an accelerator are not brought to the host for it: there
the same hash runs in torch int64 on the logits' device (:func:`keyed_uniform_torch`, the same
bits: two's-complement multiplication wraps as uint64's does, and right shifts are made logical
by masking). A vocabulary of 150k tokens makes the host path cost about a second per decode step
of 64 samples (a device-to-host copy of the logits plus 10M hashes in numpy), more than the
model's forward on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    # Negative seeds are folded into uint64 two's complement so any Python int is a valid key.
    return np.asarray([int(v) & 0xFFFFFFFFFFFFFFFF for v in values], dtype=np.uint64)


def keyed_uniform(
    seeds: Sequence[int], sample_ids: Sequence[int], positions: Sequence[int], vocab_size: int
) -> np.ndarray:
    """Uniform (0, 1) float64 noise of shape (len(seeds), vocab_size), one row per key."""
    with np.errstate(over="ignore"):
        h = _splitmix64(_u64(seeds))
        h = _splitmix64(h ^ _u64(sample_ids))
        h = _splitmix64(h ^ _u64(positions))
        cols = np.arange(vocab_size, dtype=np.uint64)
        z = _splitmix64(h[:, None] ^ (cols[None, :] * _GOLDEN))
    # 53 random bits -> a double strictly inside (0, 1), so log(-log(u)) is finite.
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def _signed(v: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


_T_GOLDEN, _T_M1, _T_M2 = (_signed(int(c)) for c in (_GOLDEN, _M1, _M2))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    x = x + _T_GOLDEN
    x = (x ^ _shr(x, 30)) * _T_M1
    x = (x ^ _shr(x, 27)) * _T_M2
    return x ^ _shr(x, 31)


def keyed_uniform_torch(seeds: Sequence[int], sample_ids: Sequence[int],
                        positions: Sequence[int], vocab_size: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`keyed_uniform` computed by torch on ``device``: the same float64 values, bit for
    bit (int64 arithmetic on the uint64 bit patterns)."""
    def key(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor([_signed(int(v) & 0xFFFFFFFFFFFFFFFF) for v in values],
                            dtype=torch.int64, device=device)

    h = _splitmix64_torch(key(seeds))
    h = _splitmix64_torch(h ^ key(sample_ids))
    h = _splitmix64_torch(h ^ key(positions))
    cols = torch.arange(vocab_size, dtype=torch.int64, device=device) * _T_GOLDEN
    z = _splitmix64_torch(h[:, None] ^ cols[None, :])
    return (_shr(z, 11).to(torch.float64) + 0.5) * (1.0 / 9007199254740992.0)


def derive_seed(seed: int, sample_id: int, position: int) -> int:
    """A 63-bit seed for engines that only take a per-request seed (the vLLM recompute path)."""
    with np.errstate(over="ignore"):
        h = _splitmix64(_u64([seed]))
        h = _splitmix64(h ^ _u64([sample_id]))
        h = _splitmix64(h ^ _u64([position]))
    return int(h[0] >> np.uint64(1))


def keyed_sample(
    logits: torch.Tensor,
    seeds: Sequence[int],
    sample_ids: Sequence[int],
    positions: Sequence[int],
    temperatures: Sequence[float],
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` (B, V); return tokens and their logprobs.

    Temperature 0 is greedy. Logprobs are under softmax(logits / T) (plain softmax when greedy),
    computed in float64, on the logits' device (the noise is the same bits on every device; the
    float64 ``log`` of a GPU may differ from the CPU's in the last bit).
    """
    dev = logits.device
    logits = logits.detach().to(dtype=torch.float64)
    batch, vocab = logits.shape
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float64, device=dev)
    scale = torch.where(temps > 0, temps, torch.ones_like(temps))
    scaled = logits / scale[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if dev.type == "cpu":
        u = torch.from_numpy(keyed_uniform(seeds, sample_ids, positions, vocab))
    else:
        u = keyed_uniform_torch(seeds, sample_ids, positions, vocab, dev)
    gumbel = -torch.log(-torch.log(u))
    noisy = torch.where((temps > 0)[:, None], scaled + gumbel, scaled)
    tokens = torch.argmax(noisy, dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    # One device-to-host copy for both.
    both = torch.stack([tokens.to(torch.float64), chosen]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()
