"""Inter-stage fusion over several backends in one process, and the rules shared with the
distributed coordinator (sharding, trigger, reports, assembly).

``LocalFusedRollout`` runs the same decisions as ``distributed.run_rollout`` (same plan, same
wire encoding of tickets), with instances stepped round-robin instead of on separate ranks. It is
what the property tests drive and what a single-process trainer can use with several engines.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import types as rollout_types
from .backend import GenerationBackend
from .inference import Experience, InferenceModels
from .planning.planner import MigrationAssignment, MovingSample, assign_migration, validate_fusion
from .types import RolloutConfigError, SampleResult, SampleSpec
from .wire import pack_tickets, unpack_tickets


def shard_of(sample_id: int, instances: int) -> int:
    """Instance that generates a sample first (round-robin by id, as in the simulator)."""
    return sample_id % instances


def should_trigger(total_unfinished: int, rt: int) -> bool:
    """Migrate when at most R_t samples of the batch are still generating."""
    return total_unfinished <= rt


def moving(progress: Iterable[rollout_types.SampleProgress]) -> list[MovingSample]:
    return [MovingSample(p.sample_id, p.kv_tokens, p.reserved_tokens) for p in progress]


def check_specs(specs: Sequence[SampleSpec]) -> None:
    ids = [s.sample_id for s in specs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise RolloutConfigError(f"sample ids {dup[:5]} appear more than once; ids must be unique")
    if any(s.is_continuation or s.kv is not None for s in specs):
        raise RolloutConfigError("a rollout batch takes fresh prompts; continuations are "
                                 "for import_samples")


def assemble(items: Iterable[Any], expected: Iterable[int], what: str) -> list[Any]:
    """Sort by sample id and enforce exactly once: no sample lost, none twice."""
    seen: dict[int, Any] = {}
    dup = []
    for it in items:
        if it.sample_id in seen:
            dup.append(it.sample_id)
        seen[it.sample_id] = it
    want = set(expected)
    missing = sorted(want - seen.keys())
    extra = sorted(seen.keys() - want)
    if dup or missing or extra:
        raise rollout_types.RolloutError(f"{what}: exactly-once violated: duplicated {sorted(dup)[:10]}, "
                           f"missing {missing[:10]}, unexpected {extra[:10]}")
    return [seen[i] for i in sorted(seen)]


def resolve_mode(mode: str, backends_kv: bool) -> rollout_types.MigrationMode:
    resolved = rollout_types.check_migration_mode(mode, "mechanism")
    if resolved == "kv" and not backends_kv:
        raise rollout_types.CapabilityError("mechanism='kv' but the backend cannot export/import KV; "
                              "use mechanism='tokens'")
    return resolved


@dataclass
class RolloutOutput:
    """The experience batch (sorted by sample id) or, without inference models, the results."""

    results: list[SampleResult]
    experiences: list[Experience] | None
    assignment: MigrationAssignment | None = None
    trigger_round: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class LocalFusedRollout:
    """Several generation instances in one process, with migration at R_t remaining samples."""

    def __init__(
        self,
        backends: Sequence[GenerationBackend],
        inference: InferenceModels | None = None,
        *,
        rt: int | None = None,
        m: int | None = None,
        mechanism: str = "kv",
        report_every: int = 1,
        bs_max: int | None = None,
        kv_capacity_tokens: float | None = None,
    ) -> None:
        if report_every < 1:
            raise RolloutConfigError("report_every must be >= 1")
        self.backends = list(backends)
        self.inference = inference
        self.rt = rt
        self.m = m
        self.mechanism = resolve_mode(
            mechanism, all(b.capabilities.kv_export and b.capabilities.kv_import
                           for b in self.backends)) if rt else mechanism
        self.report_every = report_every
        self.bs_max = bs_max if bs_max is not None else getattr(
            self.backends[0], "max_batch_size", 1 << 30)
        self.kv_capacity_tokens = kv_capacity_tokens if kv_capacity_tokens is not None else (
            getattr(self.backends[0], "kv_capacity_tokens", None))

    def run(self, specs: Sequence[SampleSpec]) -> RolloutOutput:
        """Serial when ``rt`` is None or 0 (no migration): generate everything, then score
        everything."""
        check_specs(specs)
        n = len(self.backends)
        t0 = time.perf_counter()
        m = None
        if self.rt:
            m = validate_fusion(
                batch_size=len(specs), instances=n, rt=self.rt, bs_max=self.bs_max,
                longest_kv_tokens=max(len(s.prompt_ids) + s.max_new_tokens for s in specs),
                kv_capacity_tokens=self.kv_capacity_tokens, m=self.m)
        for i, b in enumerate(self.backends):
            b.submit([s for s in specs if shard_of(s.sample_id, n) == i])
        finished: list[list[SampleResult]] = [[] for _ in range(n)]
        rounds = 0
        assignment = None
        while True:
            for i, b in enumerate(self.backends):
                for _ in range(self.report_every):
                    if not b.unfinished():
                        break
                    finished[i].extend(b.step())
            rounds += 1
            total = sum(len(b.unfinished()) for b in self.backends)
            if total == 0 or (m is not None and should_trigger(total, self.rt or 0)):
                break
        results: list[SampleResult] = [r for f in finished for r in f]
        scored: list[Experience] = []
        if m is not None and any(b.unfinished() for b in self.backends):
            assignment = assign_migration(
                {i: moving(b.progress()) for i, b in enumerate(self.backends)}, m,
                bs_max=self.bs_max, kv_capacity_tokens=self.kv_capacity_tokens)
            for src, per in sorted(assignment.moves.items()):
                for dst, ids in sorted(per.items()):
                    tickets = self.backends[src].export_samples(ids, mode=self.mechanism)
                    # Through the wire format, as across ranks.
                    ints, floats = pack_tickets(tickets)
                    self.backends[dst].import_samples(unpack_tickets(len(tickets), ints, floats))
            # Freed instances score what has finished while the destinations generate on.
            if self.inference is not None:
                scored.extend(self.inference.score(results))
            pending: list[SampleResult] = []
            while any(self.backends[d].unfinished() for d in assignment.destinations):
                for d in assignment.destinations:
                    if self.backends[d].unfinished():
                        pending.extend(self.backends[d].step())
                if self.inference is not None and pending:
                    scored.extend(self.inference.score(pending))
                results.extend(pending)
                pending = []
        else:
            for b in self.backends:
                results.extend(b.results())
            if self.inference is not None:
                scored = self.inference.score(results)
        ids = [s.sample_id for s in specs]
        ordered = assemble(results, ids, "results")
        exps = assemble(scored, ids, "experience batch") if self.inference is not None else None
        return RolloutOutput(ordered, exps, assignment, rounds if assignment else None,
                             {"seconds": time.perf_counter() - t0, "m": m})
