"""The GenerationBackend contract (docs/architecture.md), as a typing Protocol. Imports no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .types import (
    BackendCapabilities,
    MigrationMode,
    MigrationTicket,
    SampleProgress,
    SampleResult,
    SampleSpec,
)


@runtime_checkable
class GenerationBackend(Protocol):
    """One generation instance. One sample is one request.

    Exactly-once rule: every submitted or imported sample is, eventually, either emitted once by
    ``step``/``results``, or removed by ``abort``, or handed out by ``export_samples`` (after which
    this backend never emits it). A sample that became final before an export reached it is
    emitted here and gets no ticket.
    """

    capabilities: BackendCapabilities

    def submit(self, specs: Sequence[SampleSpec]) -> None:
        """Queue requests; a spec with ``generated_ids`` (and maybe ``kv``) is a continuation."""
        ...

    def step(self) -> list[SampleResult]:
        """Advance the engine by one iteration (or poll it) and return samples that became final."""
        ...

    def results(self) -> Iterator[SampleResult]:
        """Yield each finished sample as soon as it is final, until nothing is unfinished."""
        ...

    def unfinished(self) -> list[int]:
        """Ids of samples submitted here that are neither emitted, aborted nor exported."""
        ...

    def progress(self) -> list[SampleProgress]:
        """Progress of every unfinished sample, in a deterministic order."""
        ...

    def abort(self, ids: Iterable[int]) -> None:
        """Drop samples; they are never emitted."""
        ...

    def export_samples(
        self, ids: Iterable[int], mode: MigrationMode = "kv"
    ) -> list[MigrationTicket]:
        """Remove unfinished samples and return tickets that ``import_samples`` can resume."""
        ...

    def import_samples(self, tickets: Sequence[MigrationTicket]) -> None:
        """Resume exported samples; each is later emitted here exactly once."""
        ...

    def update_weights(self, weights: Any) -> None:
        """Load new actor weights (a state dict or an iterable of (name, tensor))."""
        ...

    def sleep(self) -> None:
        """Release generation memory (KV cache, and weights where the engine can)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep``."""
        ...
