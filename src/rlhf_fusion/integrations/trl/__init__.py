"""rlhf-fusion for TRL (extra ``[trl]``): one changed import gives a trainer its plugins.

- :class:`FusedPPOTrainer` (with :class:`PPOConfig`): trl 1.12's PPO trainer contract, on trl
  1.12-1.16 (TRL itself dropped PPO after 1.12).
- :class:`FusionConfig`: which plugins run; ``FusionConfig.off()`` is the stock behaviour.
"""

from __future__ import annotations

from typing import Any

from .fusion import FusionConfig, FusionConfigError

__all__ = ["FusedPPOTrainer", "FusionConfig", "FusionConfigError", "PPOConfig"]


def __getattr__(name: str) -> Any:
    # TRL and transformers load only when a trainer is asked for.
    if name == "FusedPPOTrainer":
        from .ppo import FusedPPOTrainer

        return FusedPPOTrainer
    if name == "PPOConfig":
        from .ppo_config import PPOConfig

        return PPOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
