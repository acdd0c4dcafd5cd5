"""Outcome advantages of the critic-free algorithms: GRPO (and Dr.GRPO), RLOO, REINFORCE++.

Small pure tensor functions, shapes in their docstrings. ``B`` samples, ``R`` the longest
response. A sample's group is given by ``index`` (``[B]`` integers, any values: samples with
equal ids are the ``n`` completions of one prompt, in any order). Each function returns
``(advantages, returns)`` ``[B, R]`` in the dtype of its input, zero where ``mask`` is 0, as
verl 0.9.1's ``compute_*_outcome_advantage`` do (for GRPO and RLOO verl returns the advantages
twice; so do these). Statistics are computed in float64 whatever the input dtype.

Conventions follow verl where verl and TRL differ (a group of one sample, the epsilon under
the std); the TRL behaviour is one argument away and named in each docstring. The mapping of
names to verl's and TRL's is in ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..runtime.masked import whiten

__all__ = [
    "GroupStats",
    "discounted_returns",
    "group_stats",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_kl_penalized_scores",
]

ScaleRewards = Literal["group", "batch", "none"]


class GroupStats:
    """Per-sample statistics of each sample's group, float64 ``[B]``: ``count``, ``mean`` and
    the unbiased ``std`` (0 for a group of one)."""

    def __init__(self, count: Tensor, mean: Tensor, std: Tensor) -> None:
        self.count, self.mean, self.std = count, mean, std


def group_stats(scores: Tensor, index: Tensor) -> GroupStats:
    """Count, mean and unbiased std of the scores of each sample's group (``[B]`` each)."""
    if scores.dim() != 1 or index.shape != scores.shape:
        raise ValueError(f"group_stats: scores and index must both be [B], got "
                         f"{tuple(scores.shape)} and {tuple(index.shape)}")
    s = scores.to(torch.float64)
    _, inv = torch.unique(index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(
        0, inv, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, inv, s)
    mean = (total / count)[inv]
    sq = torch.zeros_like(count).index_add_(0, inv, (s - mean).square())
    var = sq / (count - 1).clamp(min=1.0)
    return GroupStats(count[inv], mean, var.sqrt()[inv])


def _per_token(adv: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    return (adv[:, None] * mask.to(torch.float64)).to(dtype)


def grpo_advantages(scores: Tensor, index: Tensor, mask: Tensor, *,
                    scale_rewards: ScaleRewards = "group", epsilon: float = 1e-6,
                    singleton: Literal["verl", "zero"] = "verl") -> tuple[Tensor, Tensor]:
    """GRPO: ``(score - group mean) / (std + epsilon)`` on every response token.

    Args:
        scores: ``[B]`` one outcome score per sample (with the KL in the reward, the sum of the
            per-token rewards, as verl's ``token_level_rewards.sum(-1)``).
        index: ``[B]`` group ids.
        mask: ``[B, R]`` response mask.
        scale_rewards: TRL's names. ``"group"`` divides by the group's unbiased std (verl's
            ``norm_adv_by_std_in_grpo=True``); ``"none"`` does not (Dr.GRPO, verl's ``False``);
            ``"batch"`` divides by the std of all ``B`` scores (TRL only).
        epsilon: under the std: verl's ``1e-6``; TRL uses ``1e-4``.
        singleton: a group of one sample. ``"verl"``: mean 0 and std 1, so the advantage is
            ``score / (1 + epsilon)`` (``score`` unscaled), as verl; ``"zero"``: its own mean,
            so 0, as TRL.

    Returns:
        ``(advantages, returns)``, both the same ``[B, R]`` tensor.
    """
    st = group_stats(scores, index)
    s = scores.to(torch.float64)
    mean, std = st.mean, st.std
    if singleton == "verl":
        one = st.count == 1
        mean = torch.where(one, torch.zeros_like(mean), mean)
        std = torch.where(one, torch.ones_like(std), std)
    elif singleton != "zero":
        raise ValueError(f"grpo_advantages: singleton must be 'verl' or 'zero', got {singleton!r}")
    if scale_rewards == "batch":
        std = s.std().expand_as(s) if s.numel() > 1 else torch.zeros_like(s)
    adv = s - mean
    if scale_rewards in ("group", "batch"):
        adv = adv / (std + epsilon)
    elif scale_rewards != "none":
        raise ValueError(f"grpo_advantages: scale_rewards must be 'group', 'batch' or 'none', "
                         f"got {scale_rewards!r}")
    out = _per_token(adv, mask, scores.dtype)
    return out, out


def rloo_advantages(scores: Tensor, index: Tensor, mask: Tensor, *,
                    singleton: Literal["verl", "zero"] = "verl") -> tuple[Tensor, Tensor]:
    """RLOO: ``score - mean of the other n - 1 scores of its group`` on every response token
    (``= (score - group mean) * n / (n - 1)``, verl's form).

    ``singleton``: a group of one keeps its score as the advantage (``"verl"``) or gets 0
    (``"zero"``, TRL). TRL's optional ``normalize_advantages`` is a whitening of these over the
    batch: ``(a - mean) / (std + 1e-4)`` on the ``[B]`` values, not done here.

    Returns ``(advantages, returns)``, both the same ``[B, R]`` tensor.
    """
    st = group_stats(scores, index)
    s = scores.to(torch.float64)
    n = st.count
    loo = (s - st.mean) * n / (n - 1).clamp(min=1.0)
    if singleton == "verl":
        adv = torch.where(n > 1, loo, s)
    elif singleton == "zero":
        adv = torch.where(n > 1, loo, torch.zeros_like(s))
    else:
        raise ValueError(f"rloo_advantages: singleton must be 'verl' or 'zero', got {singleton!r}")
    out = _per_token(adv, mask, scores.dtype)
    return out, out


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """``[B, R]`` discounted reward-to-go over the valid tokens, float64; 0 where masked.

    Masked positions (padding, or observation tokens inside a multi-turn response) are passed
    over: their reward is ignored and the running return crosses them undiscounted, as verl's
    REINFORCE++ does.
    """
    # A float64 reverse loop, not the blocked GAE kernel (triton_kernels/gae.py, float32 with
    # "skip" semantics computes the same recursion): REINFORCE++ advantages are held to verl's
    # within 1e-6 in float64, and this runs once per batch on [B, R], not per token.
    r = token_rewards.to(torch.float64)
    m = mask.to(torch.float64)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        out[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])
    return out


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *,
                            gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted returns of the per-token rewards, whitened over every valid
    token of the batch (the batch-normalised baseline).

    Args:
        token_rewards: ``[B, R]``: the outcome score on each response's last token, minus the KL
            penalty on every token when the KL is in the reward
            (:func:`rlhf_fusion.runtime.ppo.kl_penalized_rewards`).
        mask: ``[B, R]`` response mask.
        gamma: discount (verl's ``algorithm.gamma``).

    Returns:
        ``(advantages, returns)`` ``[B, R]``: whitened returns (unbiased variance, ``1e-8`` in the
        root) and the raw returns, both 0 where masked.
    """
    ret = discounted_returns(token_rewards, mask, gamma=gamma)
    adv = whiten(ret, mask)
    return adv.to(token_rewards.dtype), ret.to(token_rewards.dtype)


def reinforce_pp_baseline_advantages(scores: Tensor, index: Tensor,
                                     mask: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: the group mean subtracted from each score (a group of one keeps its
    score), put on every response token, then whitened over all valid tokens of the batch.

    Returns ``(advantages, returns)``, both the same ``[B, R]`` tensor.
    """
    st = group_stats(scores, index)
    s = scores.to(torch.float64)
    adv = torch.where(st.count > 1, s - st.mean, s)
    out = whiten(_per_token(adv, mask, torch.float64), mask).to(scores.dtype)
    return out, out


def sequence_kl_penalized_scores(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                                 mask: Tensor, kl_coef: float) -> Tensor:
    """``[B]`` scores with the KL in the reward as TRL's ``RLOOTrainer`` puts it:
    ``score - kl_coef * sum over valid tokens of (logprobs - ref_logprobs)`` (k1, summed per
    sequence, before the baseline)."""
    k1 = ((logprobs - ref_logprobs) * mask.to(logprobs.dtype)).sum(-1)
    return scores - kl_coef * k1
