"""rlhf-fusion for TRL (extra ``[trl]``): one changed import gives a trainer its plugins.

- :class:`FusedPPOTrainer` (with :class:`PPOConfig`): trl 1.12's PPO trainer contract, on trl
  1.12-1.16 (TRL itself dropped PPO after 1.12).
- :class:`FusedGRPOTrainer`, :class:`FusedRLOOTrainer`: TRL's GRPO and RLOO trainers with
  generation through our backend, streamed scoring and long-tail migration (trl 1.12-1.16).
- :class:`FusionConfig`: which plugins run; ``FusionConfig.off()`` is the stock behaviour.

See ``docs/trl.md``.
"""

from __future__ import annotations

from typing import Any

from .fusion import FusionConfig, FusionConfigError

__all__ = ["FusedGRPOTrainer", "FusedPPOTrainer", "FusedRLOOTrainer", "FusionConfig",
           "FusionConfigError", "PPOConfig"]

# Name -> submodule: TRL and transformers load only when a trainer is asked for.
_LAZY = {"FusedPPOTrainer": "ppo", "PPOConfig": "ppo_config", "FusedGRPOTrainer": "grpo",
         "FusedRLOOTrainer": "rloo"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
