"""Streamed scoring for the fused GRPO/RLOO trainers, shared by one process
(:mod:`.streaming`) and the migration across processes (:mod:`.migration`).

:class:`StreamScorer` scores finished samples of a :class:`StreamBatch` through TRL's own
functions while the rest of the batch is still generating; what it computes per sample is a
:class:`Scored`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...rollout.types import SampleResult, SampleSpec

if TYPE_CHECKING:
    from .streaming import FusedRolloutMixin

__all__ = ["Scored", "StreamBatch", "StreamScorer", "pass_is_full", "stock_module"]


@dataclass
class Scored:
    """What streaming computed for one sample (CPU tensors, so it pickles across ranks)."""

    sample_id: int
    rewards: torch.Tensor | None = None  # (num reward funcs,)
    ref: torch.Tensor | None = None      # (completion length,)
    old: torch.Tensor | None = None      # (completion length,)


@dataclass
class StreamBatch:
    """The generation batch being streamed: TRL's inputs and, once generated, the results."""

    inputs: list[dict[str, Any]]
    offset: int = 0                  # sample id of inputs[0]
    prompt_width: int = 0            # TRL's left-padded prompt width
    results: list[SampleResult] = field(default_factory=list)
    scored: dict[int, Scored] = field(default_factory=dict)
    completions: list[Any] | None = None
    decoded: dict[int, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    done: bool = False

    def rows(self, role: str) -> list[torch.Tensor | None]:
        return [getattr(self.scored.get(r.sample_id), role, None) for r in self.results]


def stock_module(stock: type) -> Any:
    """The module TRL's trainer class ``stock`` is defined in (whose imports TRL calls)."""
    return sys.modules[stock.__module__]


@contextlib.contextmanager
def _local_gather(stock: type) -> Iterator[None]:
    """TRL's ``_calculate_rewards`` ends in a cross-process ``gather``; a micro-batch scored by
    one process alone must not enter that collective, so it is the identity meanwhile."""
    module = stock_module(stock)
    real = module.gather
    module.gather = lambda t: t
    try:
        yield
    finally:
        module.gather = real


class StreamScorer:
    """Scores finished samples of one batch: Ref and old logprobs through TRL's own
    ``_get_per_token_logps_and_entropies``, rewards through TRL's ``_calculate_rewards``.

    Micro-batches follow TRL's layout (prompts left-padded to the batch's width, completions
    right-padded, ``mask_truncated_completions`` applied), so a sample's numbers match TRL's
    full-batch pass to float rounding. Also the scorer ``run_rollout`` drives across ranks.
    """

    def __init__(self, trainer: FusedRolloutMixin, batch: StreamBatch, specs: Sequence[SampleSpec],
                 ) -> None:
        t: Any = trainer
        self.trainer = trainer
        self.batch = batch
        self.specs = {s.sample_id: s for s in specs}
        per_device = max(1, int(t.args.per_device_train_batch_size))
        cap = trainer.stream_micro_batch
        self.micro_batch = max(1, min(per_device, int(cap or 8)))
        self.max_rows = max(1, min(per_device, int(cap or per_device)))
        self.min_tokens = int(trainer.stream_min_tokens)
        mult = getattr(t, "pad_to_multiple_of", None)
        width = max(len(s.prompt_ids) for s in specs)
        batch.prompt_width = -(-width // mult) * mult if mult else width

    def ready(self, pending: Sequence[SampleResult]) -> bool:
        """Whether the finished samples waiting to be scored fill one scoring pass."""
        return pass_is_full(pending, self.batch.prompt_width, max_rows=self.max_rows,
                            min_tokens=self.min_tokens)

    def score(self, samples: Sequence[SampleResult], rows: int | None = None) -> list[Scored]:
        """Score ``samples`` in passes of ``rows`` (default :attr:`micro_batch`) samples."""
        out: list[Scored] = []
        rows = rows or self.micro_batch
        for i in range(0, len(samples), rows):
            out.extend(self._score(samples[i: i + rows]))
        for s in out:
            self.batch.scored[s.sample_id] = s
        return out

    def _tensors(self, samples: Sequence[SampleResult]) -> tuple[torch.Tensor, torch.Tensor, int]:
        t: Any = self.trainer
        pad = t._tokenizer.pad_token_id
        width = max(len(s.token_ids) for s in samples)
        p = self.batch.prompt_width
        ids = torch.full((len(samples), p + width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        stops = set(getattr(t, "eos_token_ids", None) or [t._tokenizer.eos_token_id]) | {pad}
        for i, s in enumerate(samples):
            n = len(s.prompt_ids)
            ids[i, p - n: p] = torch.tensor(s.prompt_ids)
            mask[i, p - n: p] = 1
            ids[i, p: p + len(s.token_ids)] = torch.tensor(s.token_ids)
            truncated = s.token_ids[-1] not in stops
            if not (t.mask_truncated_completions and truncated):
                mask[i, p: p + len(s.token_ids)] = 1
        dev = t.accelerator.device
        return ids.to(dev), mask.to(dev), width

    def _score(self, samples: Sequence[SampleResult]) -> list[Scored]:
        if not samples:
            return []
        t: Any = self.trainer
        trainer = self.trainer
        scored = [Scored(s.sample_id) for s in samples]
        ids, mask, width = self._tensors(samples)
        logps: list[tuple[str, Any, Any]] = []
        ref = trainer._ref_pass()
        if ref is not None:
            logps.append(("ref", *ref))
        if trainer._needs_old_logps():
            logps.append(("old", t.model, contextlib.nullcontext()))
        for role, model, context in logps:
            with torch.no_grad(), _no_checkpointing(t), context:
                lp, _, _ = self.trainer._stock._get_per_token_logps_and_entropies(
                    trainer, model, ids, mask, width, batch_size=len(samples))
            for j, (sc, s) in enumerate(zip(scored, samples)):
                setattr(sc, role, lp[j, : len(s.token_ids)].detach().cpu())
        rows = [s.sample_id - self.batch.offset for s in samples]
        inputs = [self.batch.inputs[i] for i in rows]
        prompts = [x["prompt"] for x in inputs]
        completions = [trainer._decode_completion(self.batch, s) for s in samples]
        with _local_gather(trainer._stock):
            rewards = trainer._stock._calculate_rewards(
                trainer, inputs, prompts, completions, [list(s.token_ids) for s in samples])
        for j, sc in enumerate(scored):
            sc.rewards = rewards[j].detach().cpu()
        return scored


def pass_is_full(pending: Sequence[SampleResult], prompt_width: int, *, max_rows: int,
                 min_tokens: int) -> bool:
    """Whether finished samples waiting to be scored make one scoring pass: ``max_rows`` of
    them, or ``min_tokens`` padded tokens (rows x (``prompt_width`` + the longest completion)).

    A pass costs a fixed part (the forwards' per-layer overhead, TRL's reward machinery:
    about 5 ms on a 2-core CPU) plus its padded tokens (about 10 us each there), so passes of
    a few rows on short completions spend most of their time on the fixed part, while waiting
    long pads early finishers to a late width. Waiting for ~1k tokens keeps both small.
    """
    if not pending:
        return False
    width = prompt_width + max(len(s.token_ids) for s in pending)
    return len(pending) >= max_rows or len(pending) * width >= min_tokens


@contextlib.contextmanager
def _no_checkpointing(trainer: Any) -> Iterator[None]:
    """As TRL does around its no-grad passes (no use_reentrant warning)."""
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:  # pragma: no cover - present in every supported TRL
        yield
        return
    with disable_gradient_checkpointing(trainer.model,
                                        trainer.args.gradient_checkpointing_kwargs):
        yield
