"""The clipped policy loss of the critic-free algorithms, with verl's and TRL's knobs.

Per-token tensors are response-aligned, ``[B, R]`` (``B`` samples, ``R`` the longest response),
as :mod:`rlhf_fusion.algorithms.advantages` returns them. The pieces:

* :func:`agg_loss` -- the loss aggregation (verl's ``loss_agg_mode``);
* :func:`kl_penalty` -- the per-token KL estimators, by verl's ``kl_loss_type`` names;
* :func:`clipped_policy_loss` -- the PPO-clip surrogate with asymmetric clipping (DAPO's
  clip-higher), verl's dual clip, and the KL as a loss term (``use_kl_loss``).

TRL's ``GRPOTrainer`` ``loss_type`` names map onto ``loss_agg_mode`` (:data:`TRL_LOSS_TYPES`;
``docs/algorithms.md`` has the full table):

==============  =============================  ===============================================
TRL loss_type   loss_agg_mode                  normaliser (TRL, one process, no accumulation)
==============  =============================  ===============================================
``grpo``        ``seq-mean-token-mean``        token mean per sequence, mean over sequences
``bnpo``        ``token-mean``                 the micro-batch's valid tokens
``dr_grpo``     ``seq-mean-token-sum-norm``    ``B * max_completion_length`` (``horizon``)
``dapo``        ``token-mean``                 ``num_items_in_batch`` (``num_tokens``)
``luspo``       ``seq-mean-token-sum``         token sum per sequence, mean over sequences
==============  =============================  ===============================================

Where they part: TRL's ``grpo``/``dr_grpo`` count a sequence without valid tokens in the mean
over sequences, verl's sequence modes leave it out; TRL divides ``grpo``/``bnpo``/``dr_grpo``
by the gradient-accumulation steps inside the loss (the caller scales here). verl clamps the
log-ratio to [-20, 20] before ``exp``; this module does not (TRL does not either): the two
differ only where a token's probability moved by more than ``e^20``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..runtime.masked import masked_mean
from ..runtime.ppo import kl_estimate

__all__ = [
    "LOSS_AGG_MODES",
    "TRL_LOSS_TYPES",
    "agg_loss",
    "clipped_policy_loss",
    "kl_penalty",
]

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum",
                                   "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: TRL ``GRPOTrainer`` ``loss_type`` -> ``loss_agg_mode`` (see the module docstring for the
#: normaliser each needs: ``dr_grpo`` takes ``horizon=max_completion_length``, ``dapo``
#: ``num_tokens=num_items_in_batch``).
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "luspo": "seq-mean-token-sum",
}

_KL_NAMES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "abs": "abs",
             "low_var_kl": "low_var_kl"}


def agg_loss(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str = "token-mean", *,
             num_tokens: Tensor | float | None = None, num_seqs: Tensor | float | None = None,
             horizon: float | None = None) -> Tensor:
    """One scalar from a ``[B, R]`` per-token loss, as verl's ``agg_loss``.

    Args:
        loss_mat, mask: ``[B, R]``; masked entries never contribute (NaN included).
        loss_agg_mode: ``"token-mean"`` (sum over valid tokens / ``num_tokens``),
            ``"token-sum"``, ``"seq-mean-token-sum"`` (per-sequence token sums, summed /
            ``num_seqs``), ``"seq-mean-token-mean"`` (per-sequence token means, summed /
            ``num_seqs``), ``"seq-mean-token-sum-norm"`` (``seq-mean-token-sum / horizon``,
            Dr.GRPO).
        num_tokens: the token normaliser; default the valid tokens of ``mask``. Pass the global
            batch's count when a batch is split into micro-batches or over ranks (verl's
            ``batch_num_tokens``, TRL ``dapo``'s ``num_items_in_batch``).
        num_seqs: the sequence normaliser; default the rows of ``mask`` with a valid token
            (verl's ``global_batch_size``).
        horizon: ``seq-mean-token-sum-norm``'s divisor; default ``R`` (verl's
            ``loss_scale_factor``, TRL ``dr_grpo``'s ``max_completion_length``).
    """
    m = mask.bool()
    vals = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    mf = m.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mf.sum() if num_tokens is None else num_tokens
        return vals.sum() / denom
    if loss_agg_mode == "token-sum":
        return vals.sum()
    tokens_per_seq = mf.sum(-1)
    nonempty = tokens_per_seq > 0
    seqs = nonempty.to(loss_mat.dtype).sum() if num_seqs is None else num_seqs
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = vals.sum(-1).sum() / seqs
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mat.shape[-1] if horizon is None else horizon)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = vals.sum(-1) / tokens_per_seq.clamp(min=1.0)
        return per_seq.sum() / seqs
    raise ValueError(f"loss_agg_mode: must be one of {', '.join(LOSS_AGG_MODES)}, "
                     f"got {loss_agg_mode!r}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_loss_type: str = "low_var_kl") -> Tensor:
    """``[B, R]`` per-token estimate of KL(pi || ref) from samples of pi.

    ``kl_loss_type`` (verl's names and aliases): ``"k1"``/``"kl"`` the log-ratio;
    ``"k2"``/``"mse"`` half its square; ``"abs"`` its magnitude; ``"k3"`` Schulman's k3
    ``exp(ref - lp) - (ref - lp) - 1`` unclamped (TRL ``GRPOTrainer``'s ``beta`` term and
    :func:`rlhf_fusion.runtime.ppo.kl_estimate`); ``"low_var_kl"`` k3 with verl's clamps (the
    log-ratio to [-20, 20], the estimate to [-10, 10]). Note verl spells its clamped k3 both
    ``"low_var_kl"`` and ``"k3"``: a verl config's ``k3`` is this module's ``"low_var_kl"``.
    A trailing ``"+"`` (``"k3+"``, verl) keeps the value and takes k2's gradient.
    """
    straight_through = kl_loss_type.endswith("+")
    base = _KL_NAMES.get(kl_loss_type[:-1] if straight_through else kl_loss_type)
    if base is None:
        raise ValueError(f"kl_loss_type: must be one of {', '.join(sorted(_KL_NAMES))} "
                         f"(optionally with a trailing '+'), got {kl_loss_type!r}")
    if base in ("k1", "k2", "k3"):
        kl = kl_estimate(logprobs, ref_logprobs, base)  # type: ignore[arg-type]
    elif base == "abs":
        kl = (logprobs - ref_logprobs).abs()
    else:
        log_r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        kl = (torch.exp(log_r) - log_r - 1).clamp(-10.0, 10.0)
    if not straight_through or base == "k2":
        return kl
    k2 = 0.5 * (logprobs - ref_logprobs).square()
    return k2 - k2.detach() + kl.detach()


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    ref_logprobs: Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    kl_ratio_correction: bool = False,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    horizon: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy loss on ``[B, R]`` response tokens, plus the KL as a loss term.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and ``A`` the advantage:
    ``max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))`` (TRL's
    ``epsilon``/``epsilon_high``, verl's ``clip_ratio_low``/``clip_ratio_high``; DAPO's
    clip-higher is ``clip_ratio_high > clip_ratio_low``). With ``clip_ratio_c`` (verl's dual
    clip, its default 3.0; TRL has none: ``None``) the loss of a token with ``A < 0`` is at most
    ``-A * clip_ratio_c``. With ``kl_loss_coef != 0`` (verl's ``use_kl_loss``, TRL GRPO's
    ``beta``), ``kl_loss_coef * kl_penalty(logprobs, ref_logprobs, kl_loss_type)`` is added per
    token; with ``kl_ratio_correction`` (TRL's ``use_bias_correction_kl``, on by default in
    TRL 1.12 to 1.16; verl has none) that KL is multiplied by the differentiable ratio ``r``
    first (DeepSeek-V3.2's unbiased reverse-KL gradient). The sum is aggregated by :func:`agg_loss` (``loss_agg_mode``, ``num_tokens``,
    ``num_seqs``, ``horizon``); aggregation is linear, so this equals verl's policy loss plus
    ``kl_loss_coef`` times its separately aggregated KL loss.

    Returns ``(loss, stats)``: ``clip_frac`` (tokens where the clipped term is the larger
    loss, verl's ``pg_clipfrac``), ``clip_frac_lower`` (dual-clipped tokens), ``approx_kl``
    (mean ``old - new`` log-prob, verl's ``ppo_kl``) and ``kl`` when a KL term is on; token
    means over ``mask``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(loss1, loss2)
    stats: dict[str, Tensor] = {}
    with torch.no_grad():
        stats["clip_frac"] = masked_mean((loss2 > loss1).to(ratio.dtype), mask)
        stats["approx_kl"] = masked_mean(old_logprobs - logprobs, mask)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c: the dual-clip bound must be > 1.0, got {clip_ratio_c}")
        loss3 = -advantages * clip_ratio_c
        neg = advantages < 0
        with torch.no_grad():
            stats["clip_frac_lower"] = masked_mean(((per_token > loss3) & neg).to(ratio.dtype),
                                                   mask)
        per_token = torch.where(neg, torch.minimum(per_token, loss3), per_token)
    if kl_loss_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("clipped_policy_loss: kl_loss_coef != 0 (use_kl_loss) needs "
                             "ref_logprobs: pass the Ref model's logprobs of the same tokens")
        kl = kl_penalty(logprobs, ref_logprobs, kl_loss_type)
        weighted = kl * ratio if kl_ratio_correction else kl
        per_token = per_token + kl_loss_coef * weighted
        with torch.no_grad():
            stats["kl"] = masked_mean(kl, mask)
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    horizon=horizon)
    return loss, stats
