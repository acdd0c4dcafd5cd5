"""From scored samples to the PPO training batch: KL, rewards, GAE, whitening, layout.

Small pure tensor functions, shapes in their docstrings. ``B`` samples, ``R`` the longest
response, ``T`` the longest prompt + response. Response-aligned tensors (``[B, R]``) hold one
entry per generated token; the training batch is aligned with ``input_ids`` (``[B, T]``) as
:mod:`rlhf_fusion.runtime.ppo` expects (entry ``t`` is token ``t`` as an action).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rollout.inference import Experience
from ..runtime.masked import whiten
from ..runtime.ppo import kl_estimate, kl_penalized_rewards
from ..triton_kernels import gae


@dataclass
class ResponseBatch:
    """Response-aligned experience, float64: ``logprobs``, ``ref_logprobs``, ``values``,
    ``mask`` ``[B, R]``; ``scores`` ``[B]``."""

    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor
    mask: Tensor
    scores: Tensor


def response_batch(exps: Sequence[Experience]) -> ResponseBatch:
    """Right-padded ``[B, R]`` tensors of the experience, in the given order."""
    b = len(exps)
    r = max(len(e.response_ids) for e in exps)
    out = {k: torch.zeros(b, r, dtype=torch.float64) for k in ("lp", "ref", "v")}
    mask = torch.zeros(b, r, dtype=torch.bool)
    for i, e in enumerate(exps):
        g = len(e.response_ids)
        out["lp"][i, :g] = e.logprobs
        out["ref"][i, :g] = e.ref_logprobs
        out["v"][i, :g] = e.values
        mask[i, :g] = True
    scores = torch.tensor([float(e.reward) for e in exps], dtype=torch.float64)
    return ResponseBatch(out["lp"], out["ref"], out["v"], mask, scores)


def token_rewards(rb: ResponseBatch, *, kl_coef: float, kl_mode: str, estimator: str) -> Tensor:
    """``[B, R]`` rewards: the score on each response's last token, minus ``kl_coef * KL`` on
    every token when the KL penalty goes into the reward (``kl_mode="reward"``)."""
    coef = kl_coef if kl_mode == "reward" else 0.0
    return kl_penalized_rewards(rb.scores, rb.logprobs, rb.ref_logprobs, rb.mask, coef,
                                estimator)  # type: ignore[arg-type]


def advantages_and_returns(rb: ResponseBatch, rewards: Tensor, *, gamma: float, lam: float,
                           whiten_advantages: bool) -> tuple[Tensor, Tensor]:
    """GAE (``gae``, "zero" semantics as TRL/OpenRLHF) on ``[B, R]``; advantages whitened over
    all response tokens when asked. Returns ``(advantages, returns)``, float32 ``[B, R]``."""
    adv, ret = gae(rewards, rb.values, rb.mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        adv = whiten(adv, rb.mask)
    return adv.float(), ret.float()


def training_batch(exps: Sequence[Experience], advantages: Tensor, returns: Tensor,
                   rb: ResponseBatch, *, pad_id: int) -> dict[str, Tensor]:
    """The ``[B, T]`` batch the PPO losses read: ``input_ids``, ``attention_mask``,
    ``action_mask``, ``old_logprobs``, ``ref_logprobs``, ``old_values``, ``advantages``,
    ``returns`` (per-token entries at the response columns, 0 elsewhere)."""
    b = len(exps)
    t = max(len(e.prompt_ids) + len(e.response_ids) for e in exps)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    act = torch.zeros(b, t, dtype=torch.long)
    per_token = {k: torch.zeros(b, t, dtype=torch.float32)
                 for k in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")}
    src = {"old_logprobs": rb.logprobs, "ref_logprobs": rb.ref_logprobs,
           "old_values": rb.values, "advantages": advantages, "returns": returns}
    for i, e in enumerate(exps):
        p, g = len(e.prompt_ids), len(e.response_ids)
        ids[i, : p + g] = torch.tensor(list(e.prompt_ids) + list(e.response_ids))
        attn[i, : p + g] = 1
        act[i, p: p + g] = 1
        for k, v in src.items():
            per_token[k][i, p: p + g] = v[i, :g].float()
    return {"input_ids": ids, "attention_mask": attn, "action_mask": act, **per_token}


def per_token_mean(kl: Tensor, lengths: Tensor) -> float:
    """``[B, R]`` masked per-token KL averaged over each response's ``[B]`` tokens, then over
    the batch (verl's ``apply_kl_penalty``): what the adaptive KL controller steers towards
    ``target_kl``."""
    return float((kl.sum(1) / lengths.clamp(min=1)).mean())


def rollout_metrics(rb: ResponseBatch, *, kl_coef: float, estimator: str) -> dict[str, float]:
    """TRL's ``objective/*`` metrics of one batch (per-sample sums, then the batch mean)."""
    m = rb.mask.to(torch.float64)
    kl = kl_estimate(rb.logprobs, rb.ref_logprobs, estimator) * m  # type: ignore[arg-type]
    non_score = (-kl_coef * kl).sum(1)
    lengths = rb.mask.sum(1).to(torch.float64)
    q = torch.quantile(lengths, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "objective/kl": float(kl.sum(1).mean()),
        "objective/kl_per_token": per_token_mean(kl, lengths),
        "objective/entropy": float((-rb.logprobs * m).sum(1).mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((rb.scores + non_score).mean()),
        "objective/scores": float(rb.scores.mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/p50": float(q[0]),
        "response_length/p90": float(q[1]),
        "response_length/p99": float(q[2]),
        "response_length/max": float(lengths.max()),
    }

