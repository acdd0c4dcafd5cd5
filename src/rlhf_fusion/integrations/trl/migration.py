"""Long-tail migration for the fused GRPO/RLOO trainers with several accelerate processes.

Every process contributes its local prompts; :func:`run_rollout` then generates the whole
batch (process ``r`` first holds the samples with ``sample_id % world == r``), moves the long
tail to fewer processes once at most R_t samples are left, and lets the freed processes score
finished samples through the same :class:`_StreamScorer` as a single process. Every process
gets the whole batch back and keeps its own slice, so TRL's code after generation sees what it
would have seen without migration.

Needs a default process group that can send CPU tensors point to point (gloo; the CPU
``accelerate`` launch). R_t: ``fusion.rt`` as a fraction, or :data:`AUTO_RT_FRACTION` for
``"auto"`` (the planner's calibration is not run inside TRL).
"""

from __future__ import annotations

from typing import Any

from ...rollout.config import RolloutConfig
from ...rollout.distributed import run_rollout
from ...rollout.reference import ReferenceBackend
from ...rollout.types import SampleResult
from .streaming import FusedRolloutMixin, _Batch, _StreamScorer

__all__ = ["AUTO_RT_FRACTION", "migrated_rollout"]

AUTO_RT_FRACTION = 0.25


def migrated_rollout(trainer: FusedRolloutMixin, backend: ReferenceBackend,
                     prompt_ids: list[list[int]], batch: _Batch | None) -> list[SampleResult]:
    """This process's samples (ids ``rank * n ...``), generated and scored across processes."""
    from accelerate.utils import gather_object

    t: Any = trainer
    n = len(prompt_ids)
    rank = t.accelerator.process_index
    everyone = gather_object([list(p) for p in prompt_ids])
    specs = trainer._sample_specs(everyone, 0)
    scorer = None
    whole: _Batch | None = None
    if batch is not None:
        whole = _Batch(inputs=gather_object(list(batch.inputs)), offset=0)
        scorer = _StreamScorer(trainer, whole, specs)
    fusion = trainer.fusion
    rt = AUTO_RT_FRACTION if fusion.rt == "auto" else float(fusion.rt)
    out = run_rollout(backend, scorer, specs,  # type: ignore[arg-type]
                      RolloutConfig(fused=True, rt_fraction=rt, mechanism=fusion.mechanism))
    mine = range(rank * n, (rank + 1) * n)
    t.fusion_last_rollout = {"moved": list(out.assignment.moved_ids) if out.assignment else [],
                             "seconds": out.stats.get("seconds") if out.stats else None}
    if batch is not None and out.experiences is not None:
        batch.prompt_width = whole.prompt_width  # type: ignore[union-attr]
        for e in out.experiences:
            if e.sample_id in mine:
                batch.scored[e.sample_id] = e
    return [r for r in out.results if r.sample_id in mine]
