"""Lightning plugins: ``FusedPipelineStrategy`` and the PPO LightningModule contract.

Importing this package registers the strategy with Lightning as ``strategy="fused_pipeline"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .checkpoint import consolidate_checkpoint
from .fused_pipeline import FusedPipelineStrategy
from .launcher import FusedPipelineLauncher
from .module import FusedPPOModule, log_ppo_stats

if "fused_pipeline" not in StrategyRegistry:
    FusedPipelineStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "FusedPPOModule",
    "consolidate_checkpoint",
    "FusedPipelineLauncher",
    "FusedPipelineStrategy",
    "log_ppo_stats",
]
