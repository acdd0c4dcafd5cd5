"""``FusedRLOOTrainer``: TRL's ``RLOOTrainer`` with rlhf-fusion's generation and streaming.

    from rlhf_fusion.integrations.trl import FusedRLOOTrainer as RLOOTrainer

RLOO scores the policy's own logprobs of every batch at generation time, so streaming
computes those too (besides the Ref logprobs and the reward functions).
"""

from __future__ import annotations

from trl import RLOOTrainer

from .compat import RLOO_SEAMS
from .streaming import FusedRolloutMixin

__all__ = ["FusedRLOOTrainer"]


class FusedRLOOTrainer(FusedRolloutMixin, RLOOTrainer):
    """``RLOOTrainer`` plus ``fusion=FusionConfig(...)``; see :class:`FusedGRPOTrainer`."""

    _stock = RLOOTrainer
    _seams = RLOO_SEAMS
    _returns_logprobs = False

    def _needs_old_logps(self) -> bool:
        return True
