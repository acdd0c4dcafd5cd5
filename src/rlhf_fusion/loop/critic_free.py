"""The critic-free algorithms' pieces of an iteration, as pure functions: GRPO, RLOO and
REINFORCE++ run on :class:`~rlhf_fusion.loop.iteration.PPOWorker` like PPO (the same rollout,
placements, training engines, checkpoints), and the worker calls these where the algorithm
differs:

* :func:`group_specs`: ``n`` samples per prompt (a group), each its own sampling stream;
* :func:`critic_free_batch`: the training batch, group advantages from
  :class:`~rlhf_fusion.algorithms.GroupTracker` fed in the order the samples were scored (any
  order gives the whole batch's advantages), the KL in the reward when configured, and TRL's
  metric names;
* :func:`policy_loss_fn`: the clipped policy loss of one micro-batch, normalised by its
  *mini-batch's* tokens and sequences, so the micro-batches' losses sum to the mini-batch's
  whatever the split (one micro-batch per rank on 2 ranks gives one device's parameters bit
  for bit: ``a + b`` either way).

No Critic is built, placed, synced or checkpointed for these algorithms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..algorithms import GroupTracker, clipped_policy_loss, kl_penalty
from ..rollout.inference import Experience
from ..rollout.types import SampleSpec
from ..runtime.ppo import logprobs_from_logits
from . import advantages as adv
from .algorithm_config import ResolvedAlgorithm
from .config import RLHFConfig

__all__ = ["critic_free_batch", "group_specs", "policy_loss_fn"]


def group_specs(prompts: Sequence[Sequence[int]], n: int, *, iteration: int,
                cfg: RLHFConfig, eos: int) -> list[SampleSpec]:
    """``n`` samples per prompt: prompt ``p``'s are sample ids ``p*n .. p*n + n - 1`` (their
    group), each with its own sampling stream (keyed on the sample id)."""
    g = cfg.generation
    seed = g.seed * 1_000_003 + iteration
    out: list[SampleSpec] = []
    for p, ids in enumerate(prompts):
        first = SampleSpec(sample_id=p * n, prompt_ids=tuple(ids), max_new_tokens=g.max_new_tokens,
                           seed=seed, temperature=g.temperature, stop_token_ids=(eos,))
        # The group's other samples differ by their (positive) id alone: checked once, a
        # group's specs cost a third as much, on every rollout's critical path.
        out.append(first)
        out += [first._replace(sample_id=p * n + k) for k in range(1, n)]
    return out


def critic_free_batch(exps: Sequence[Experience], algo: ResolvedAlgorithm, *, kl_coef: float,
                      pad_id: int, order: Sequence[int] | None = None
                      ) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The training batch and TRL-named metrics of one iteration's experience.

    ``exps`` sorted by sample id; ``order``: the sample ids in the order they were scored (the
    tracker takes them so; the result does not depend on it). ``kl_coef``: the KL
    coefficient now (the controller's): subtracted in the reward when ``algo.kl_in_reward``,
    reported either way.
    """
    exps = sorted(exps, key=lambda e: e.sample_id)
    rb = adv.response_batch(exps)
    mask = rb.mask
    kl = kl_penalty(rb.logprobs, rb.ref_logprobs, algo.kl_penalty) * mask
    token_rewards = torch.zeros_like(rb.logprobs)
    last = mask.sum(-1).long() - 1
    rows = torch.arange(len(exps))
    token_rewards[rows, last.clamp(min=0)] = rb.scores
    if algo.kl_in_reward:
        token_rewards = token_rewards - kl_coef * kl
    scores = token_rewards.sum(-1)   # verl's token_level_rewards.sum(-1)
    pos = {e.sample_id: i for i, e in enumerate(exps)}
    tracker = GroupTracker([e.sample_id // algo.n for e in exps], algo.name,
                           scale_rewards=algo.scale_rewards, epsilon=algo.epsilon)
    for sid in (order if order is not None else [e.sample_id for e in exps]):
        tracker.add(pos[sid], float(scores[pos[sid]]))
    a, r = tracker.finish(mask, token_rewards, gamma=algo.gamma)
    batch = adv.training_batch(exps, a, r, rb, pad_id=pad_id)
    lengths = mask.sum(1).to(torch.float64)
    groups = rb.scores.view(-1, algo.n) if len(exps) % algo.n == 0 else rb.scores[None]
    metrics = {
        "objective/scores": float(rb.scores.mean()),
        "objective/kl": float(kl.sum(1).mean()),
        "objective/rlhf_reward": float(scores.mean()),   # minus the in-reward KL, if any
        "objective/kl_per_token": adv.per_token_mean(kl, lengths),
        "objective/kl_coef": float(kl_coef),   # the controller's, for whichever KL term is on
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        # the groups whose samples all scored the same: no GRPO signal from them
        "frac_reward_zero_std": float((groups.std(1) == 0).to(torch.float64).mean())
        if algo.n > 1 else 0.0,
    }
    return batch, metrics


def policy_loss_fn(algo: ResolvedAlgorithm, *, kl_loss_coef: float, horizon: int
                   ) -> Callable[[Tensor, Mapping[str, Tensor], float, float],
                                 tuple[Tensor, dict[str, Tensor]]]:
    """``loss(logits, micro_batch, num_tokens, num_seqs)``: the clipped policy loss of one
    micro-batch, normalised by its mini-batch's ``num_tokens``/``num_seqs`` (summing the
    micro-batches' losses gives the mini-batch's)."""

    def loss(logits: Tensor, mb: Mapping[str, Tensor], num_tokens: float,
             num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
        lp = logprobs_from_logits(logits, mb["input_ids"]).to(torch.float64)
        return clipped_policy_loss(
            lp, mb["old_logprobs"].to(torch.float64), mb["advantages"].to(torch.float64),
            mb["action_mask"], clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c,
            loss_agg_mode=algo.loss_agg_mode, ref_logprobs=mb["ref_logprobs"].to(torch.float64),
            kl_loss_coef=kl_loss_coef, kl_loss_type=algo.kl_loss_type,
            num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)

    return loss


def _split(batch: dict[str, Tensor], parts: int) -> list[dict[str, Tensor]]:
    rows = batch["input_ids"].shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i]:bounds[i + 1]] for k, v in batch.items()}
            for i in range(parts) if bounds[i + 1] > bounds[i]]



