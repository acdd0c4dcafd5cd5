"""How finished samples reach inference calls placed on other ranks than generation.

Under a placement whose inference calls do not all share the generation ranks, every sample
a generation rank finishes is pushed, as it finishes, into one c10d-store queue per inference
call (:class:`Publishing` wraps the backend, :class:`CallQueues` holds the queues); the
call's ranks pop and score what arrives while generation goes on.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .placement import INFERENCE_CALLS


class NoGeneration:
    """Stands in for the backend on ranks outside the generation mesh."""

    steps: list[tuple[int, float]] = []
    model = None

    def wake_up(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def reset_timing(self) -> None:
        pass


class Publishing:
    """A generation backend that hands every sample it finishes to ``publish`` (a migrated
    sample finishes, and is published, once: on the rank that decoded its last token)."""

    def __init__(self, inner: Any, publish: Any) -> None:
        self._inner = inner
        self._publish = publish

    def step(self) -> Any:
        finished = self._inner.step()
        if finished:
            self._publish(finished)
        return finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CallQueues:
    """One c10d-store queue per inference call for one iteration, and a count of the
    generation ranks that are done."""

    def __init__(self, iteration: int, timeout_s: float,
                 calls: Sequence[str] = INFERENCE_CALLS) -> None:
        self.calls = tuple(calls)   # the run's inference calls (no critic_inf: no Critic)
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"rlhf_fusion/placed/{iteration}/"
        self.timeout_s = timeout_s
        self.progressed()

    def key(self, name: str) -> str:
        return self.prefix + name

    def push(self, samples: Sequence[Any]) -> None:
        for x in samples:
            blob = pickle.dumps(x)
            for call in self.calls:
                self.store.queue_push(self.key(call), blob)

    def pop(self, call: str, most: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < most:
            try:
                out.append(pickle.loads(self.store.queue_pop(self.key(call), False)))
            except dist.QueueEmptyError:
                break
        return out

    def generation_done(self) -> None:
        self.store.add(self.key("generation_done"), 1)

    def finished(self, generators: int, calls: Sequence[str]) -> bool:
        if int(self.store.add(self.key("generation_done"), 0)) < generators:
            return False
        return all(self.store.queue_len(self.key(c)) == 0 for c in calls)

    def progressed(self) -> None:
        self.deadline = time.perf_counter() + self.timeout_s

    def check_deadline(self, rank: int) -> None:
        if time.perf_counter() > self.deadline:
            raise TimeoutError(
                f"rank {rank}: no generated sample to score for {self.timeout_s:g}s "
                "(fusion.timeout_s) and generation not done; a generation rank died or hung")

    def clear(self) -> None:
        for name in (*self.calls, "generation_done"):
            try:
                self.store.delete_key(self.key(name))
            except Exception:
                pass  # best effort: keys are namespaced per iteration
