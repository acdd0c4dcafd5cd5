"""Sampling whose randomness is keyed on (seed, sample_id, position).

The token drawn at response position ``p`` of sample ``i`` is ``argmax(logits/T + g)`` where
``g`` is Gumbel noise computed by a counter-based hash of ``(seed, i, p, vocab index)``. It is
a pure function of the logits and the key: batching, the instance a sample runs on, and
migration cannot change it (Gumbel-max is an exact sample from softmax(logits/T)).

The hash is splitmix64, run in torch int64 on the logits' device, so a GPU never ships (B, V)
float64 logits and noise to the host per decode step (with a 150k vocabulary that was most of a
decode step). torch's int64 multiply wraps in two's complement on CPU and CUDA, which is the
uint64 product's bit pattern; right shifts are masked to make them logical.
``tests/test_rollout_reference.py`` pins the bits to an independent numpy uint64 splitmix64 and to
splitmix64's published outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


_T_GOLDEN, _T_M1, _T_M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # int64 >> is arithmetic; masking off the sign-extended bits makes it uint64's logical shift.
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    x = x + _T_GOLDEN
    x = (x ^ _shr(x, 30)) * _T_M1
    x = (x ^ _shr(x, 27)) * _T_M2
    return x ^ _shr(x, 31)


def _key_hash(seeds: Sequence[int], sample_ids: Sequence[int], positions: Sequence[int],
              device: torch.device | str) -> torch.Tensor:
    def key(values: Sequence[int]) -> torch.Tensor:
        # Any Python int is a key: it is folded into 64 bits, two's complement.
        return torch.tensor([_signed(int(v)) for v in values], dtype=torch.int64, device=device)

    h = _splitmix64_torch(key(seeds))
    h = _splitmix64_torch(h ^ key(sample_ids))
    return _splitmix64_torch(h ^ key(positions))


def keyed_uniform_torch(
    seeds: Sequence[int], sample_ids: Sequence[int], positions: Sequence[int], vocab_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Uniform (0, 1) float64 noise of shape ``(len(seeds), vocab_size)`` on ``device``, one
    row per key."""
    h = _key_hash(seeds, sample_ids, positions, device)
    cols = torch.arange(vocab_size, dtype=torch.int64, device=device) * _T_GOLDEN
    z = _splitmix64_torch(h[:, None] ^ cols[None, :])
    # 53 random bits -> a double strictly inside (0, 1), so log(-log(u)) is finite.
    return (_shr(z, 11).to(torch.float64) + 0.5) * (1.0 / 9007199254740992.0)


def keyed_uniform(
    seeds: Sequence[int], sample_ids: Sequence[int], positions: Sequence[int], vocab_size: int
) -> np.ndarray:
    """:func:`keyed_uniform_torch` on the CPU, as a numpy array (the vLLM fakes' draws)."""
    return keyed_uniform_torch(seeds, sample_ids, positions, vocab_size).numpy()


def derive_seed(seed: int, sample_id: int, position: int) -> int:
    """A 63-bit seed for engines that only take a per-request seed (the vLLM recompute path)."""
    return int(_shr(_key_hash([seed], [sample_id], [position], "cpu"), 1)[0])


def keyed_sample(
    logits: torch.Tensor,
    seeds: Sequence[int],
    sample_ids: Sequence[int],
    positions: Sequence[int],
    temperatures: Sequence[float],
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` (B, V); return tokens and their logprobs.

    Temperature 0 is greedy. Logprobs are under softmax(logits / T) (plain softmax when greedy),
    computed in float64 on the logits' device; only the B tokens and logprobs reach the host.
    """
    logits = logits.detach().to(dtype=torch.float64)
    dev = logits.device
    batch, vocab = logits.shape
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float64, device=dev)
    scale = torch.where(temps > 0, temps, torch.ones_like(temps))
    scaled = logits / scale[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    u = keyed_uniform_torch(seeds, sample_ids, positions, vocab, dev)
    gumbel = -torch.log(-torch.log(u))
    noisy = torch.where((temps > 0)[:, None], scaled + gumbel, scaled)
    tokens = torch.argmax(noisy, dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
