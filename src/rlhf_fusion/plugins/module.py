"""The LightningModule contract of :class:`~rlhf_fusion.plugins.FusedPipelineStrategy`.

Subclass :class:`FusedPPOModule` (or follow the same contract; see ``docs/lightning.md``):

* ``self.actor``: a Hugging Face causal LM (Llama/Qwen2/Mistral or GPT-2 family);
* ``self.critic``: a :class:`~rlhf_fusion.runtime.CriticModel` (decoder backbone + value head);
* ``self.ppo_config``: a :class:`~rlhf_fusion.runtime.PPOConfig`;
* ``configure_optimizers`` returns two optimizers, the Actor's first, built from
  ``self.actor.parameters()`` / ``self.critic.parameters()`` (the strategy calls it after
  partitioning, so each rank's optimizers only see the parameters it holds);
* manual optimization (``automatic_optimization = False``);
* ``actor_loss(logits, micro_batch)`` / ``critic_loss(values, micro_batch)`` return
  ``(loss, stats)``; the strategy calls them at each model's last pipeline stage;
* ``training_step`` trains on one device without the strategy, with the same micro-batching,
  loss normalisation, clipping and logging, so a user can switch back and forth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..runtime.fused import ROLES, reference_step
from ..runtime.microbatch import split_micro_batches
from ..runtime.ppo import PPOConfig, actor_ppo_loss, critic_ppo_loss


def log_ppo_stats(
    module: pl.LightningModule,
    stats: Mapping[str, Mapping[str, float]],
    norms: Mapping[str, float] | None,
    batch_size: int,
) -> None:
    """The metrics both paths log: ``actor/loss``, ``critic/loss``, ``*/grad_norm``, ..."""
    values: dict[str, float] = {}
    for role, st in stats.items():
        for k, v in st.items():
            values[f"{role}/{k}"] = float(v)
    for role, n in (norms or {}).items():
        values[f"{role}/grad_norm"] = float(n)
    module.log_dict(values, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=False)


class FusedPPOModule(pl.LightningModule):
    """PPO Actor + Critic training step that runs unpipelined here and fused under the strategy."""

    def __init__(
        self,
        actor: nn.Module,
        critic: nn.Module,
        ppo_config: PPOConfig | None = None,
        *,
        actor_lr: float = 1e-5,
        critic_lr: float = 1e-5,
        weight_decay: float = 0.0,
    ):
        super().__init__()
        self.actor = actor
        self.critic = critic
        self.ppo_config = ppo_config or PPOConfig()
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.weight_decay = weight_decay
        self.automatic_optimization = False
        self._accumulated = 0

    # -- the hooks the strategy calls at the last stages -------------------------------------------
    def actor_loss(
        self, logits: Tensor, mb: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return actor_ppo_loss(logits, dict(mb), self.ppo_config)

    def critic_loss(
        self, values: Tensor, mb: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return critic_ppo_loss(values, dict(mb), self.ppo_config)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.AdamW(
                self.actor.parameters(), lr=self.actor_lr, weight_decay=self.weight_decay
            ),
            torch.optim.AdamW(
                self.critic.parameters(), lr=self.critic_lr, weight_decay=self.weight_decay
            ),
        ]

    # -- single-device reference path --------------------------------------------------------------
    def loss_fns(self) -> dict[str, Any]:
        """``{"actor": self.actor_loss, "critic": self.critic_loss}``."""
        return {"actor": self.actor_loss, "critic": self.critic_loss}

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        """One batch without the strategy: :func:`~rlhf_fusion.runtime.reference_step`, with
        Lightning's ``manual_backward`` and ``ppo_config.accumulate_batches``."""
        cfg = self.ppo_config
        mbs = split_micro_batches(batch, cfg.micro_batches)
        self._accumulated += 1
        boundary = self._accumulated == cfg.accumulate_batches
        if boundary:
            self._accumulated = 0
        out = reference_step(
            {role: getattr(self, role) for role in ROLES},
            mbs,
            self.optimizers(),
            self.loss_fns(),
            max_grad_norm=cfg.max_grad_norm,
            loss_denominator=float(len(mbs) * cfg.accumulate_batches),
            backward=self.manual_backward,
            step=boundary,
        )
        # Per batch, as if it were the whole step (the denominator covers all batches).
        stats = {
            role: {k: v * cfg.accumulate_batches for k, v in st.items()}
            for role, st in out["stats"].items()
        }
        log_ppo_stats(self, stats, out["grad_norm"], batch_size=int(batch["input_ids"].shape[0]))
        total = torch.zeros(())
        for role in ROLES:
            total = total + stats[role]["loss"]
        return total
