"""Lightning plugins.

* ``RLHFModule`` + ``RLHFLoopStrategy``: the whole RLHF loop, one PPO iteration per
  ``training_step`` (``strategy="rlhf_loop"``);
* ``FusedPPOModule`` + ``FusedPipelineStrategy``: the PPO update alone on a given experience
  batch, through the fused Actor/Critic pipeline (``strategy="fused_pipeline"``).

Importing this package registers both strategy names with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .checkpoint import consolidate_checkpoint
from .fused_pipeline import FusedPipelineStrategy
from .launcher import FusedPipelineLauncher
from .module import FusedPPOModule, log_ppo_stats
from .prompt_loader import PromptLoader
from .rlhf_loop import RLHFLoopStrategy
from .rlhf_module import RLHFModule

if "fused_pipeline" not in StrategyRegistry:
    FusedPipelineStrategy.register_strategies(StrategyRegistry)
if "rlhf_loop" not in StrategyRegistry:
    RLHFLoopStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "FusedPPOModule",
    "FusedPipelineLauncher",
    "FusedPipelineStrategy",
    "PromptLoader",
    "RLHFLoopStrategy",
    "RLHFModule",
    "consolidate_checkpoint",
    "log_ppo_stats",
]
