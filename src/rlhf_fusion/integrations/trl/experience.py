"""TRL PPO's experience and losses as small pure tensor functions.

The same arithmetic as trl 1.12's ``PPOTrainer.train`` (so ``FusionConfig.off()`` matches it
bit for bit), split into steps the fused trainer composes. ``B`` samples, ``R`` the longest
response. TRL's conventions are kept on purpose: the score lands one token *after* the last
response token when there is room, and the Critic is trained on one position past the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...runtime.masked import masked_mean, whiten
from ...triton_kernels import gae as gae_kernel
from ...triton_kernels import gae_reference
from .rollout import first_true_indices, truncate_at_stop

INVALID_LOGPROB = 1.0


@dataclass
class PPOExperience:
    """Everything the PPO epochs read, ``[B, R]`` unless noted."""

    responses: Tensor
    logprobs: Tensor
    values: Tensor
    advantages: Tensor
    returns: Tensor
    padding_mask: Tensor      # True past each response's last token
    padding_mask_p1: Tensor   # True past the last token + 1 (the Critic's positions)
    sequence_lengths: Tensor  # [B] index of the last response token
    kl: Tensor
    non_score_reward: Tensor
    scores: Tensor            # [B], after the missing-EOS penalty


def kernel_gae(rewards: Tensor, values: Tensor, gamma: float, lam: float
               ) -> tuple[Tensor, Tensor]:
    """GAE by the blocked-matrix kernel over every column (TRL runs its loop over all ``R``
    columns and relies on zeroed rewards and values past the end, so the mask is all ones)."""
    ones = torch.ones_like(rewards, dtype=torch.bool)
    adv, ret = gae_kernel(rewards, values, ones, gamma=gamma, lam=lam)
    return adv.to(rewards.dtype), ret.to(rewards.dtype)


def make_experience(*, responses: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                    values: Tensor, scores: Tensor, pad_id: int, eos_id: int | None,
                    stop_id: int | None, kl_coef: float, kl_estimator: str,
                    missing_eos_penalty: float | None, whiten_rewards: bool, gamma: float,
                    lam: float, use_kernel: bool) -> PPOExperience:
    """Masks, KL-penalised rewards, GAE and whitened advantages of one batch."""
    post = truncate_at_stop(responses, stop_id, pad_id)
    sequence_lengths = first_true_indices(post == pad_id) - 1
    scores = scores.clone()
    if missing_eos_penalty is not None:
        scores[~torch.any(post == eos_id, dim=-1)] -= missing_eos_penalty
    idx = torch.arange(responses.shape[1], device=responses.device).repeat(responses.shape[0], 1)
    padding_mask = idx > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = idx > lengths_p1.unsqueeze(1)
    values = torch.masked_fill(values, padding_mask_p1, 0)

    logr = ref_logprobs - logprobs
    kl = -logr if kl_estimator == "k1" else (logr.exp() - 1) - logr
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    end = torch.where(lengths_p1 < rewards.size(1), lengths_p1, sequence_lengths)
    rewards[rows, end] += scores
    if whiten_rewards:
        rewards = whiten(rewards, ~padding_mask_p1, shift_mean=False, trl_exact=True)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    if use_kernel:
        advantages, returns = kernel_gae(rewards, values, gamma, lam)
    else:  # the reverse loop, TRL's arithmetic op for op
        advantages, returns = gae_reference(rewards, values, gamma=gamma, lam=lam,
                                            dtype=rewards.dtype)
    advantages = whiten(advantages, ~padding_mask, trl_exact=True)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return PPOExperience(responses, logprobs, values, advantages, returns, padding_mask,
                         padding_mask_p1, sequence_lengths, kl, non_score_reward, scores)


@dataclass
class PolicyTerms:
    """The Actor's side of one micro-batch: clipped policy loss and what TRL logs of it."""

    pg_loss: Tensor
    pg_clipfrac: Tensor
    logprobs_diff: Tensor
    ratio: Tensor
    logits: Tensor  # tempered, [b, R', V]


@dataclass
class ValueTerms:
    """The Critic's side of one micro-batch: clipped value loss (before ``vf_coef``)."""

    vf_loss: Tensor
    vf_clipfrac: Tensor


def policy_terms(*, logits: Tensor, responses: Tensor, old_logprobs: Tensor,
                 advantages: Tensor, padding_mask: Tensor, temperature: float,
                 cliprange: float) -> PolicyTerms:
    """``logits`` ``[b, R', V]`` at the response positions (untempered)."""
    from trl.trainer.utils import selective_log_softmax

    logits = logits / (temperature + 1e-7)
    new_logprobs = selective_log_softmax(logits, responses)
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, INVALID_LOGPROB)
    logprobs_diff = new_logprobs - old_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), ~padding_mask, trl_exact=True)
    with torch.no_grad():
        pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask,
                                  trl_exact=True)
    return PolicyTerms(pg_loss, pg_clipfrac, logprobs_diff, ratio, logits)


@torch.no_grad()
def policy_stats(pol: PolicyTerms, width_scale: float = 1.0) -> dict[str, Tensor]:
    """What TRL logs of the Actor's micro-batch: ``pg_loss``, ``pg_clipfrac``, ``approxkl``,
    ``entropy``, ``ratio``. ``width_scale`` is the kept fraction of the response columns:
    trimmed columns hold diff 0 and ratio 1 exactly, so the means are rescaled to the full
    width and match stock TRL's."""
    lg = pol.logits
    entropy = torch.logsumexp(lg, dim=-1) - torch.sum(torch.softmax(lg, dim=-1) * lg, dim=-1)
    ratio = pol.ratio.mean()
    return {"pg_loss": pol.pg_loss, "pg_clipfrac": pol.pg_clipfrac,
            "approxkl": 0.5 * (pol.logprobs_diff ** 2).mean() * width_scale,
            "entropy": entropy.mean(),
            "ratio": ratio * width_scale + (1 - width_scale) if width_scale < 1 else ratio}


def value_terms(*, vpred: Tensor, old_values: Tensor, returns: Tensor, padding_mask_p1: Tensor,
                cliprange_value: float) -> ValueTerms:
    """``vpred`` ``[b, R']``: the Critic at the response positions."""
    vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), ~padding_mask_p1,
                                trl_exact=True)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1,
                              trl_exact=True)
    return ValueTerms(vf_loss, vf_clipfrac)
