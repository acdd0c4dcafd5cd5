"""Prompt batches that a Lightning run can resume in the middle of an epoch.

A plain ``DataLoader`` restarts from its first batch when Lightning resumes from a checkpoint
written mid-epoch, so the resumed run would see other prompts than the uninterrupted one.
:class:`PromptLoader` has Lightning's stateful-loader interface (``state_dict`` /
``load_state_dict``): the checkpoint records the epoch and how many batches of it were served,
and the resumed iterator starts at the next one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any


class PromptLoader:
    """Batches of ``batch_size`` prompt strings (the last partial batch dropped); with
    ``shuffle`` the order changes every epoch, reproducibly from ``seed``."""

    def __init__(self, prompts: Sequence[str], batch_size: int, *, shuffle: bool = False,
                 seed: int = 0) -> None:
        if batch_size < 1 or batch_size > len(prompts):
            raise ValueError(f"batch_size {batch_size}: use 1..{len(prompts)} (the number of "
                             "prompts); it must equal generation.prompts_per_iteration")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._served = 0      # batches of the current epoch handed out
        self._resume_at = 0   # where the next iterator starts (after load_state_dict)

    def __len__(self) -> int:
        return len(self.prompts) // self.batch_size

    def _order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[str]]:
        order, bs = self._order(), self.batch_size
        start, self._resume_at = self._resume_at, 0
        for b in range(start, len(self)):
            self._served = b + 1
            yield [self.prompts[i] for i in order[b * bs:(b + 1) * bs]]
        self.epoch += 1
        self._served = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "served": self._served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["served"])
