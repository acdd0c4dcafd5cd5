"""PPO losses computed at each model's last pipeline stage.

Per-token tensors are aligned with ``input_ids`` (shape ``[batch, seq]``): entry ``t`` refers to
token ``t`` as an action, predicted from the prefix ``< t``. Column 0 is never an action, so
``action_mask[:, 0]`` is 0. The same functions run in the single-device reference and in the
pipeline, which is what makes the two comparable bit for bit.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .masked import masked_mean

KLMode = Literal["reward", "loss"]
KLEstimator = Literal["k1", "k2", "k3"]


# Keyword names before the runtime's PPOConfig took the loop's (and TRL's): old -> new. The
# old ones still work for one release, with a DeprecationWarning.
RENAMED_FIELDS = {"clip_eps": "cliprange", "value_clip_eps": "cliprange_value"}


def _renamed(where: str, kw: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    for old, new in names.items():
        if old in kw:
            if new in kw:
                raise TypeError(f"{where}: give {new} only ({old} is its old name)")
            warnings.warn(f"{where}: {old} is deprecated; use {new}", DeprecationWarning,
                          stacklevel=3)
            kw[new] = kw.pop(old)
    return kw


def _old_keyword(where: str, kw: dict[str, Any], old: str, new: str) -> Any:
    """The value given under a function's old keyword ``old`` (a DeprecationWarning)."""
    unknown = sorted(set(kw) - {old})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
    warnings.warn(f"{where}: {old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
    return kw[old]


@dataclass
class PPOConfig:
    """Hyper-parameters of the PPO update shared by the pipelined and the single-device path.

    The names and defaults are the loop's (``loop/config.py:PPOLoopConfig``, TRL's names):
    ``cliprange``, ``cliprange_value``, ``kl_coef=0.05``, ``kl_estimator="k1"``; the old
    ``clip_eps``/``value_clip_eps`` keywords still work for one release (DeprecationWarning).
    ``micro_batches`` is the number of micro-batches one optimizer step's batch is split into
    (per data-parallel replica); ``accumulate_batches`` steps the optimizers every that many
    batches. ``kl_mode="reward"`` means the KL penalty was already folded into the rewards by
    the rollout side (see :func:`kl_penalized_rewards`; ``kl_coef`` is then unused here);
    ``"loss"`` adds ``kl_coef * KL(pi || ref)`` to the policy loss, which then needs
    ``ref_logprobs``.
    """

    micro_batches: int = 4
    cliprange: float = 0.2
    cliprange_value: float | None = 0.2
    kl_mode: KLMode = "reward"
    kl_coef: float = 0.05
    kl_estimator: KLEstimator = "k1"
    max_grad_norm: float | None = 1.0
    accumulate_batches: int = 1

    @property
    def clip_eps(self) -> float:
        """Deprecated: :attr:`cliprange`."""
        warnings.warn("PPOConfig.clip_eps is deprecated; use cliprange", DeprecationWarning,
                      stacklevel=2)
        return self.cliprange

    @property
    def value_clip_eps(self) -> float | None:
        """Deprecated: :attr:`cliprange_value`."""
        warnings.warn("PPOConfig.value_clip_eps is deprecated; use cliprange_value",
                      DeprecationWarning, stacklevel=2)
        return self.cliprange_value

    def __post_init__(self) -> None:
        if self.kl_mode not in ("reward", "loss"):
            raise ValueError(
                f"ppo_config.kl_mode: must be 'reward' or 'loss', got {self.kl_mode!r}"
            )
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(
                f"ppo_config.kl_estimator: must be 'k1', 'k2' or 'k3', got {self.kl_estimator!r}"
            )
        if self.micro_batches < 1:
            raise ValueError(f"ppo_config.micro_batches: must be >= 1, got {self.micro_batches}")
        if self.accumulate_batches < 1:
            raise ValueError(
                f"ppo_config.accumulate_batches: must be >= 1, got {self.accumulate_batches}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_dataclass_init = PPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: PPOConfig, *args: Any, **kw: Any) -> None:
    _dataclass_init(self, *args, **_renamed("PPOConfig", kw, RENAMED_FIELDS))


PPOConfig.__init__ = _init  # type: ignore[method-assign]


def logprobs_from_logits(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-probability of each token under the logits of the previous position; column 0 is 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    taken = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return F.pad(taken, (1, 0))


def values_from_head(values: Tensor) -> Tensor:
    """Align per-position value-head outputs with actions: V for token t is read at t-1."""
    return F.pad(values[:, :-1].float(), (1, 0))


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> Tensor:
    """Per-token rewards for ``kl_mode="reward"``: ``-kl_coef * KL`` on every action, plus the
    sequence score on each row's last action."""
    mask = action_mask.to(logprobs.dtype)
    rewards = -kl_coef * kl_estimate(logprobs, ref_logprobs, estimator) * mask
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & action_mask.bool()
    last = last & (last.long().cumsum(-1) == 1)
    return rewards + last.to(rewards.dtype) * scores.reshape(-1, 1).to(rewards.dtype)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    cliprange: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_mode: KLMode = "reward",
    kl_coef: float = 0.05,
    kl_estimator: KLEstimator = "k1",
    **deprecated: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate, token mean over the actions of the micro-batch (``clip_eps``:
    the old name of ``cliprange``, deprecated)."""
    if deprecated:
        cliprange = _old_keyword("policy_loss", deprecated, "clip_eps", "cliprange")
    ratio = torch.exp(logprobs - old_logprobs)
    surr = torch.minimum(
        ratio * advantages, ratio.clamp(1.0 - cliprange, 1.0 + cliprange) * advantages
    )
    per_token = -surr
    stats: dict[str, Tensor] = {}
    if kl_mode == "loss" and kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("policy_loss: kl_mode='loss' needs ref_logprobs in the experience")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * kl
        stats["kl"] = masked_mean(kl.detach(), action_mask)
    loss = masked_mean(per_token, action_mask)
    with torch.no_grad():
        stats["clip_frac"] = masked_mean(((ratio - 1.0).abs() > cliprange).float(),
                                         action_mask)
        stats["approx_kl"] = masked_mean(old_logprobs - logprobs, action_mask)
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    cliprange_value: float | None = 0.2,
    **deprecated: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``, token mean (``None``: no
    clipping; ``clip_eps``: the old name of ``cliprange_value``, deprecated)."""
    if deprecated:
        cliprange_value = _old_keyword("value_loss", deprecated, "clip_eps", "cliprange_value")
    err = (values - returns).square()
    clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    if cliprange_value is not None:
        clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        err_clipped = (clipped - returns).square()
        with torch.no_grad():  # TRL's val/clipfrac: where the clipped loss is the larger
            clip_frac = masked_mean((err_clipped > err).to(values.dtype), action_mask)
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * masked_mean(err, action_mask)
    with torch.no_grad():
        stats = {"value_mean": masked_mean(values, action_mask), "clip_frac": clip_frac}
    return loss, stats


def actor_ppo_loss(
    logits: Tensor, mb: dict[str, Tensor], cfg: PPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The Actor's loss on one micro-batch of experience (logits from the LM head)."""
    logprobs = logprobs_from_logits(logits, mb["input_ids"])
    return policy_loss(
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mb["action_mask"],
        cliprange=cfg.cliprange,
        ref_logprobs=mb.get("ref_logprobs"),
        kl_mode=cfg.kl_mode,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
    )


def critic_ppo_loss(
    values: Tensor, mb: dict[str, Tensor], cfg: PPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The Critic's loss on one micro-batch (per-position outputs of the value head)."""
    return value_loss(
        values_from_head(values),
        mb["old_values"],
        mb["returns"],
        mb["action_mask"],
        cliprange_value=cfg.cliprange_value,
    )
