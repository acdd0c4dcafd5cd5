"""Long-tail migration for the fused GRPO/RLOO trainers with several accelerate processes.

Every process contributes its local prompts; :func:`run_rollout` then generates the whole
batch (process ``r`` first holds the samples with ``sample_id % world == r``), moves the long
tail to fewer processes once at most R_t samples are left, and lets the freed processes score
finished samples through the same :class:`StreamScorer` as a single process. Every process
gets the whole batch back and keeps its own slice, so TRL's code after generation sees what it
would have seen without migration.

Needs a default process group that can send CPU tensors point to point (gloo; the CPU
``accelerate`` launch). R_t: ``fusion.rt`` as a fraction, or with ``"auto"`` the R_t planner
the loop uses too (:class:`RtChooser`): the generation + inference simulator over the response
lengths and decode-step timings seen in earlier rollouts, refined after every rollout
(RLHFuse §4.2).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...rollout.config import RolloutConfig
from ...rollout.distributed import run_rollout
from ...rollout.reference import ReferenceBackend
from ...rollout.types import SampleResult
from .scoring import StreamBatch, StreamScorer

if TYPE_CHECKING:
    from .streaming import FusedRolloutMixin

__all__ = ["RtChooser", "migrated_rollout", "migrating_rollout"]


class RtChooser:
    """R_t (samples) for each rollout of a trainer: ``fusion.rt`` as a fraction of the batch,
    or ``"auto"``: :class:`~rlhf_fusion.rollout.rt_control.RtPlanner`, fed after every
    rollout. Collective under ``"auto"`` (rank 0 decides and broadcasts)."""

    def __init__(self, rt: float | str, bs_max: int, world: int) -> None:
        self.fixed = None if rt == "auto" else float(rt)
        self.bs_max = bs_max
        self.world = world
        self.planner: Any = None

    def rt(self, batch: int) -> int:
        if self.fixed is not None:
            return max(1, round(self.fixed * batch))
        if self.planner is None or self.planner.batch != batch:
            from ...rollout.rt_control import RtPlanner

            self.planner = RtPlanner(batch, self.world, bs_max=self.bs_max)
        return self.planner.rt()

    def observe(self, results: Any, backend: Any, scoring: Any = (),
                prompt_len: float = 0.0, rollout_s: float | None = None) -> None:
        """Lengths of this rollout and the decode steps ``backend`` (a TimedBackend) timed;
        ``rollout_s``: its seconds (the planner's sweeps stay within a share of them)."""
        if self.planner is not None:
            self.planner.observe([len(r.token_ids) for r in results], backend, scoring,
                                 prompt_len=prompt_len, rollout_s=rollout_s)


def migrating_rollout(chooser: RtChooser, backend: Any, scorer: Any, specs: list[Any],
                      fusion: Any, rt: int | None = None) -> tuple[Any, int]:
    """One :func:`run_rollout` with migration at the chooser's R_t (or ``rt``), every decode
    step timed and the outcome fed back to the chooser. Returns ``(RolloutOutput, R_t)``;
    R_t = 0 (the planner predicts no gain) is a rollout without migration."""
    from ...rollout.rt_control import TimedBackend

    timed = TimedBackend(backend)
    rt = chooser.rt(len(specs)) if rt is None else rt
    start = time.perf_counter()
    out = run_rollout(timed, scorer, specs,
                      RolloutConfig(fused=True, rt=rt, mechanism=fusion.mechanism,
                                    report_every=4),
                      bs_max=fusion.max_batch_size)
    chooser.observe(out.results, timed, getattr(scorer, "calls", ()),
                    prompt_len=sum(len(s.prompt_ids) for s in specs) / max(1, len(specs)),
                    rollout_s=time.perf_counter() - start)
    return out, rt


def migrated_rollout(trainer: FusedRolloutMixin, backend: ReferenceBackend,
                     prompt_ids: list[list[int]], batch: StreamBatch | None) -> list[SampleResult]:
    """This process's samples (ids ``rank * n ...``), generated and scored across processes."""
    from accelerate.utils import gather_object

    t: Any = trainer
    n = len(prompt_ids)
    rank = t.accelerator.process_index
    everyone = gather_object([list(p) for p in prompt_ids])
    specs = trainer._sample_specs(everyone, 0)
    scorer = None
    whole: StreamBatch | None = None
    if batch is not None:
        whole = StreamBatch(inputs=gather_object(list(batch.inputs)), offset=0)
        scorer = StreamScorer(trainer, whole, specs)
    fusion = trainer.fusion
    chooser = getattr(t, "_rt_chooser", None)
    if chooser is None:
        chooser = t._rt_chooser = RtChooser(fusion.rt, fusion.max_batch_size,
                                            t.accelerator.num_processes)
    # A sharded policy's forwards are collectives: no migration then (R_t = 0), so every
    # process scores its own samples after generation, the same micro-batches in step.
    out, _ = migrating_rollout(chooser, backend, scorer, specs, fusion,
                               rt=0 if trainer._sharded() else None)
    mine = range(rank * n, (rank + 1) * n)
    t.fusion_last_rollout = {"moved": list(out.assignment.moved_ids) if out.assignment else [],
                             "seconds": out.stats.get("seconds") if out.stats else None}
    if batch is not None and out.experiences is not None:
        batch.prompt_width = whole.prompt_width  # type: ignore[union-attr]
        for e in out.experiences:
            if e.sample_id in mine:
                batch.scored[e.sample_id] = e
    return [r for r in out.results if r.sample_id in mine]
