"""Groups in the generation + inference simulator: GRPO-style runs sample ``n`` completions
per prompt, and a group's advantages can be computed only once its last sample is scored.

The loop's batch order: prompt ``p``'s samples are positions ``p*n .. p*n + n - 1``
(:func:`group_index`). :func:`simulate_groups` runs :func:`~.simulate.simulate_serial` and
:func:`~.simulate.simulate_fused` on one batch and adds, on top of their per-sample scoring
times, when each group is ready (its slowest sample scored) and the group advantages computed
on one worker (``advantage_s`` per group) as groups become ready. Serial computes every group
after all scoring; fused computes each group as it completes, so only the groups held up by
the tail remain at the end. A group's tail is its longest sample: one long completion holds
its whole group back, however short the other ``n - 1`` are. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..types import RolloutConfigError
from .simulate import ClusterModel, serial_scored_at, simulate_fused

__all__ = ["GroupTiming", "group_index", "group_ready_times", "simulate_groups"]


def group_index(samples: int, n: int) -> list[int]:
    """Group id of each position: ``samples // n`` prompts of ``n`` consecutive samples."""
    if n < 1 or samples % n:
        raise RolloutConfigError(f"group size n={n} must be >= 1 and divide the batch of "
                                 f"{samples} samples")
    return [i // n for i in range(samples)]


def group_ready_times(scored_at: Mapping[int, float], index: Sequence[int]) -> dict[int, float]:
    """When each group's last sample is scored; every position must have a time."""
    out: dict[int, float] = {}
    for pos, g in enumerate(index):
        if pos not in scored_at:
            raise RolloutConfigError(f"sample {pos} (group {g}) has no scoring time")
        out[g] = max(out.get(g, -np.inf), scored_at[pos])
    return out


def _advantages_end(ready: Mapping[int, float], start: float, advantage_s: float) -> float:
    """One worker computes each group once it is ready (and not before ``start``), in ready
    order; when the last finishes."""
    t = start
    for r in sorted(ready.values()):
        t = max(t, r) + advantage_s
    return t


@dataclass
class GroupTiming:
    """One batch, serial and fused, with groups (seconds)."""

    serial_s: float
    fused_s: float
    serial_ready: dict[int, float]
    fused_ready: dict[int, float]
    fused_generation_s: float

    @property
    def speedup(self) -> float:
        return self.serial_s / self.fused_s

    @property
    def groups_ready_during_generation(self) -> int:
        """Fused: the groups whose advantages could be computed while the tail still decoded."""
        return sum(t <= self.fused_generation_s for t in self.fused_ready.values())


def simulate_groups(lengths: np.ndarray, c: ClusterModel, rt: int, n: int, *,
                    advantage_s: float = 0.0) -> GroupTiming:
    """Serial and fused times of one batch of ``len(lengths) // n`` groups of ``n``."""
    index = group_index(len(lengths), n)
    serial_at = serial_scored_at(lengths, c)
    serial_ready = group_ready_times(serial_at, index)
    serial_end = _advantages_end(serial_ready, max(serial_at.values()), advantage_s)
    res = simulate_fused(lengths, c, rt)
    if not np.isfinite(res.fused_s):
        return GroupTiming(serial_end, np.inf, serial_ready, {}, np.inf)
    fused_ready = group_ready_times(res.scored_at, index)
    fused_end = max(res.fused_s, _advantages_end(fused_ready, 0.0, advantage_s))
    return GroupTiming(serial_end, fused_end, serial_ready, fused_ready, res.fused_generation_s)
