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

from ..runtime.engine import clip_grad_norm_, scale_loss
from ..runtime.fused import model_outputs
from ..runtime.microbatch import split_micro_batches
from ..runtime.ppo import PPOConfig, actor_ppo_loss, critic_ppo_loss

ROLES = ("actor", "critic")


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
    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        cfg = self.ppo_config
        mbs = split_micro_batches(batch, cfg.micro_batches)
        denom = float(len(mbs) * cfg.accumulate_batches)
        stats: dict[str, dict[str, float]] = {}
        total = torch.zeros(())
        for role in ROLES:
            model = getattr(self, role)
            loss_fn = self.actor_loss if role == "actor" else self.critic_loss
            acc: dict[str, Tensor] = {}
            for mb in mbs:
                loss, st = loss_fn(model_outputs(role, model, mb), mb)
                self.manual_backward(scale_loss(loss, denom))
                with torch.no_grad():
                    for k, v in {"loss": loss, **st}.items():
                        val = scale_loss(v.detach(), denom).double()
                        acc[k] = acc[k] + val if k in acc else val
            stats[role] = {k: float(v) * cfg.accumulate_batches for k, v in acc.items()}
            total = total + stats[role]["loss"]
        norms = None
        self._accumulated += 1
        if self._accumulated == cfg.accumulate_batches:
            self._accumulated = 0
            norms = {
                role: clip_grad_norm_(getattr(self, role).parameters(), cfg.max_grad_norm)
                for role in ROLES
            }
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad(set_to_none=True)
        log_ppo_stats(self, stats, norms, batch_size=int(batch["input_ids"].shape[0]))
        return total
