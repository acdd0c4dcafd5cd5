"""A tiny PPO LightningModule and an experience dataset for the strategy's tests and examples.

Importable by module path so spawned workers can unpickle them. Importing this module imports
Lightning (through ``rlhf_fusion.plugins``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..plugins import FusedPPOModule
from ..runtime.ppo import PPOConfig
from .models import build_models
from .pipeline import make_experience


class ExperienceDataset(Dataset):
    """Rows of synthetic PPO experience (fixed padded length; micro-batches trim it)."""

    def __init__(self, rows: int, *, micro_batch_rows: int = 2, max_len: int = 24, seed: int = 0):
        self.data = make_experience(
            rows, micro_batch_rows=micro_batch_rows, max_len=max_len, seed=seed
        )
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.data.items()}


class TinyPPOModule(FusedPPOModule):
    """``FusedPPOModule`` over ``build_models(models, seed)`` (default: Llama 4 + 2 layers)."""

    def __init__(
        self,
        models: dict[str, tuple] | None = None,
        ppo: dict[str, Any] | None = None,
        lr: float = 1e-3,
        seed: int = 0,
    ):
        spec = models or {"actor": ("llama", 4), "critic": ("llama", 2)}
        built = build_models(spec, seed)
        super().__init__(
            built["actor"],
            built["critic"],
            PPOConfig(**(ppo or {})),
            actor_lr=lr,
            critic_lr=lr,
            weight_decay=0.01,
        )
        self.save_hyperparameters()


def full_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``module``'s state dict."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
