"""``FusedGRPOTrainer``: TRL's ``GRPOTrainer`` with rlhf-fusion's generation and streaming.

    from rlhf_fusion.integrations.trl import FusedGRPOTrainer as GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          fusion=FusionConfig())  # optional; FusionConfig.off() = stock

Everything else (loss, advantages, logging, checkpoints) is TRL's own code; see
:mod:`rlhf_fusion.integrations.trl.streaming` for the seams this class overrides.
"""

from __future__ import annotations

from typing import Any

from trl import GRPOTrainer

from .compat import GRPO_SEAMS
from .streaming import FusedRolloutMixin

__all__ = ["FusedGRPOTrainer"]


class FusedGRPOTrainer(FusedRolloutMixin, GRPOTrainer):
    """``GRPOTrainer`` plus ``fusion=FusionConfig(...)`` (default: every plugin on).

    With ``fusion.stream`` the completions come from rlhf-fusion's continuous-batching backend
    and the Ref logprobs and reward functions run on each finished sample while the long tail
    decodes; with ``fusion.migrate`` and several processes the long tail moves to fewer of
    them. ``FusionConfig.off()`` runs the stock trainer step for step.
    """

    _stock = GRPOTrainer
    _seams = GRPO_SEAMS
    _returns_logprobs = True

    def _needs_old_logps(self) -> bool:
        t: Any = self
        every = t.args.steps_per_generation * t.num_iterations
        return t.args.gradient_accumulation_steps % every != 0
