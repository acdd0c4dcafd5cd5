"""Critic-free RLHF algorithms as pure tensor functions: outcome advantages (GRPO, Dr.GRPO,
RLOO, REINFORCE++, REINFORCE++-baseline) and the clipped policy loss with verl's and TRL's
knobs. ``docs/algorithms.md`` maps the names onto verl's and TRL's."""

from .advantages import (
    GroupStats,
    discounted_returns,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_kl_penalized_scores,
)
from .groups import GroupDone, GroupTracker
from .kl_control import AdaptiveKLController, FixedKLController, kl_controller
from .policy_loss import (
    LOSS_AGG_MODES,
    TRL_LOSS_TYPES,
    agg_loss,
    clipped_policy_loss,
    kl_penalty,
)

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "GroupDone",
    "GroupTracker",
    "TRL_LOSS_TYPES",
    "GroupStats",
    "agg_loss",
    "clipped_policy_loss",
    "discounted_returns",
    "group_stats",
    "grpo_advantages",
    "kl_controller",
    "kl_penalty",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_kl_penalized_scores",
]
