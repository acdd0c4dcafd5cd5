"""The RLHF loop end to end: one PPO iteration composing every plugin (RLHFuse Figure 4).

Weight sync (parameter reallocation, training -> generation layout), generation with
long-tail migration and sample-level streaming into Ref/Reward/Critic scoring, advantages
(KL, ``gae``, whitening), and PPO epochs on the fused Actor/Critic pipeline. ``train`` runs it
on local processes; ``PPOWorker`` is one rank's share, for code that owns its processes, under
the run's ``LoopPlacement`` (every call on every rank unless a preset or a plan says otherwise).
"""

from .config import (
    FusionLoopConfig,
    GenerationConfig,
    LoopConfigError,
    ModelsConfig,
    PlacementSection,
    PPOLoopConfig,
    RLHFConfig,
)
from .iteration import IterationResult, PPOWorker
from .models import Models, build_models, vowel_fraction
from .placement import LoopPlacement
from .run import load_prompts, train
from .tokenizers import CharTokenizer

__all__ = [
    "CharTokenizer",
    "FusionLoopConfig",
    "GenerationConfig",
    "IterationResult",
    "LoopConfigError",
    "LoopPlacement",
    "Models",
    "ModelsConfig",
    "PPOLoopConfig",
    "PPOWorker",
    "PlacementSection",
    "RLHFConfig",
    "build_models",
    "load_prompts",
    "train",
    "vowel_fraction",
]
