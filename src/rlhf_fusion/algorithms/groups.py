"""Group advantages as the samples are scored: the streaming side of GRPO, RLOO and
REINFORCE++-baseline.

With inter-stage fusion a sample's Ref logprobs and reward are computed as soon as it
finishes, while the tail still decodes; :class:`GroupTracker` takes each scored sample, in any
order, and computes a group's advantages the moment its ``n``-th sample arrives. What a
group's advantage needs is only its own scores (GRPO with ``scale_rewards`` ``group`` or
``none``, RLOO), so those are final then. The batch-wide steps (GRPO's ``batch`` std,
REINFORCE++'s whitening, REINFORCE++-baseline's whitening after its group mean) wait for
:meth:`GroupTracker.finish`.

Exactness: each group's statistics are computed over its samples in batch order (sorted by
position), by the same functions the batch path calls, so the advantages equal the whole-batch
functions of :mod:`.advantages` bit for bit, whatever the arrival order
(``tests/test_group_tracker.py``). Every sample is taken exactly once: a repeat, a sample of no
group, or :meth:`finish` before every sample is scored raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .advantages import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

__all__ = ["GroupDone", "GroupTracker", "STREAMED"]

#: algorithm -> whether a group's advantages are final when the group is complete
STREAMED: dict[str, bool] = {"grpo": True, "rloo": True, "reinforce_pp_baseline": False,
                             "reinforce_pp": False}


@dataclass(frozen=True)
class GroupDone:
    """A complete group: its samples' positions in the batch (ascending) and, where they are
    final at this point, their sequence advantages (float64; ``None`` for the batch-wide
    algorithms, whose advantages come from :meth:`GroupTracker.finish`)."""

    group: int
    positions: tuple[int, ...]
    advantages: tuple[float, ...] | None


class GroupTracker:
    """Scores in, group advantages out, one sample at a time.

    Args:
        index: ``[B]`` group ids in batch order (the batch function's ``index``): position
            ``i`` of the batch belongs to group ``index[i]``.
        algorithm: ``grpo``, ``rloo``, ``reinforce_pp`` or ``reinforce_pp_baseline``.
        scale_rewards, epsilon: GRPO's (:func:`~.advantages.grpo_advantages`).
    """

    def __init__(self, index: Sequence[int], algorithm: str, *, scale_rewards: str = "group",
                 epsilon: float = 1e-6) -> None:
        if algorithm not in STREAMED:
            raise ValueError(f"GroupTracker: algorithm must be one of {', '.join(STREAMED)}, "
                             f"got {algorithm!r}")
        self.algorithm, self.scale_rewards, self.epsilon = algorithm, scale_rewards, epsilon
        self.index = [int(g) for g in index]
        self.members: dict[int, list[int]] = {}
        for pos, g in enumerate(self.index):
            self.members.setdefault(g, []).append(pos)
        self.scores: dict[int, float] = {}
        self._left = {g: len(m) for g, m in self.members.items()}
        self.group_advantages: dict[int, float] = {}
        self.completed: list[int] = []   # groups, in the order they completed

    @property
    def complete(self) -> bool:
        return len(self.scores) == len(self.index)

    def add(self, position: int, score: float) -> GroupDone | None:
        """Sample ``position`` scored ``score``; the group it completes, if it does."""
        if not 0 <= position < len(self.index):
            raise KeyError(f"GroupTracker: position {position} is not in the batch of "
                           f"{len(self.index)}")
        if position in self.scores:
            raise ValueError(f"GroupTracker: sample {position} was scored twice; each sample "
                             "is scored exactly once")
        self.scores[position] = float(score)
        g = self.index[position]
        self._left[g] -= 1
        if self._left[g]:
            return None
        self.completed.append(g)
        pos = tuple(self.members[g])
        if not STREAMED[self.algorithm] or (self.algorithm == "grpo"
                                            and self.scale_rewards == "batch"):
            return GroupDone(g, pos, None)
        adv = self._group(pos)
        for p, a in zip(pos, adv, strict=True):
            self.group_advantages[p] = a
        return GroupDone(g, pos, tuple(adv))

    def _group(self, pos: tuple[int, ...]) -> list[float]:
        s = torch.tensor([self.scores[p] for p in pos], dtype=torch.float64)
        idx = torch.zeros(len(pos), dtype=torch.long)
        one = torch.ones(len(pos), 1, dtype=torch.float64)
        if self.algorithm == "grpo":
            adv, _ = grpo_advantages(s, idx, one, scale_rewards=self.scale_rewards,  # type: ignore[arg-type]
                                     epsilon=self.epsilon)
        else:
            adv, _ = rloo_advantages(s, idx, one)
        return adv[:, 0].tolist()

    def finish(self, mask: Tensor, token_rewards: Tensor | None = None, *,
               gamma: float = 1.0) -> tuple[Tensor, Tensor]:
        """``(advantages, returns)`` ``[B, R]`` of the whole batch, float64, as the batch
        functions of :mod:`.advantages` return them; every sample must have been scored.
        ``token_rewards`` (``[B, R]``) only for ``reinforce_pp``, whose advantage is per token."""
        if not self.complete:
            missing = [p for p in range(len(self.index)) if p not in self.scores]
            raise ValueError(f"GroupTracker.finish: {len(missing)} samples not scored yet "
                             f"(first: {missing[0]})")
        scores = torch.tensor([self.scores[p] for p in range(len(self.index))],
                              dtype=torch.float64)
        index = torch.tensor(self.index, dtype=torch.long)
        if self.algorithm == "reinforce_pp":
            if token_rewards is None:
                raise ValueError("GroupTracker.finish: reinforce_pp needs token_rewards")
            return reinforce_pp_advantages(token_rewards, mask, gamma=gamma)
        if self.algorithm == "reinforce_pp_baseline":
            return reinforce_pp_baseline_advantages(scores, index, mask)
        if self.algorithm == "grpo" and self.scale_rewards == "batch":
            return grpo_advantages(scores, index, mask, scale_rewards="batch",
                                   epsilon=self.epsilon)
        adv = torch.tensor([self.group_advantages[p] for p in range(len(self.index))],
                           dtype=torch.float64)
        out = adv[:, None] * mask.to(torch.float64)
        return out, out


def index_of(groups: Mapping[int, Sequence[int]], batch: int) -> list[int]:
    """``[B]`` group ids from ``{group: positions}``; each position in exactly one group."""
    out: list[int | None] = [None] * batch
    for g, positions in groups.items():
        for p in positions:
            if out[p] is not None:
                raise ValueError(f"position {p} is in groups {out[p]} and {g}")
            out[p] = g
    if None in out:
        raise ValueError(f"position {out.index(None)} is in no group")
    return [int(g) for g in out]  # type: ignore[arg-type]
