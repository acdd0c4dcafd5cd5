"""``PPOConfig``: TRL's own where it still exists (trl 1.11-1.12), a field-for-field copy after.

TRL removed PPO after 1.12 (huggingface/trl#7020). On 1.13-1.16 this module defines a config
with the same fields, defaults and derived attributes, so a PPO script written for trl 1.12 runs
unchanged with :class:`~rlhf_fusion.integrations.trl.FusedPPOTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

try:  # trl 1.11-1.12
    from trl.experimental.ppo import PPOConfig as _TRLPPOConfig
except ImportError:  # trl >= 1.13: no PPO left in TRL
    _TRLPPOConfig = None

__all__ = ["PPOConfig", "TRL_HAS_PPO"]

TRL_HAS_PPO = _TRLPPOConfig is not None

if _TRLPPOConfig is not None:
    PPOConfig = _TRLPPOConfig
else:
    from trl.trainer.base_config import _BaseConfig

    @dataclass
    class PPOConfig(_BaseConfig):  # type: ignore[no-redef]
        """trl 1.12's ``PPOConfig`` (same fields and defaults; see TRL's PPO docs)."""

        learning_rate: float = 3e-6
        dataset_num_proc: int | None = None
        num_mini_batches: int = 1
        total_episodes: int | None = None
        local_rollout_forward_batch_size: int = 64
        num_sample_generations: int = 10
        response_length: int = 53
        stop_token: Literal["eos"] | None = None
        stop_token_id: int | None = None
        temperature: float = 0.7
        missing_eos_penalty: float | None = None
        sft_model_path: str = "EleutherAI/pythia-160m"
        world_size: int | None = None
        num_total_batches: int | None = None
        micro_batch_size: int | None = None
        local_batch_size: int | None = None
        batch_size: int | None = None
        local_mini_batch_size: int | None = None
        mini_batch_size: int | None = None
        push_to_hub: bool = False
        reward_model_path: str = "EleutherAI/pythia-160m"
        model_adapter_name: str | None = None
        ref_adapter_name: str | None = None
        num_ppo_epochs: int = 4
        whiten_rewards: bool = False
        kl_coef: float = 0.05
        kl_estimator: Literal["k1", "k3"] = "k1"
        cliprange: float = 0.2
        vf_coef: float = 0.1
        cliprange_value: float = 0.2
        gamma: float = 1.0
        lam: float = 0.95
        ds3_gather_for_generation: bool = True
