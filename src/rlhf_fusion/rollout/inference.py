"""The inference stage on finished samples: Ref logprobs, Reward score, Critic values.

A sample's experience depends only on that sample: micro-batches are right-padded and the
models run in float64 by default, so scoring a sample alone, in a micro-batch, on any rank,
early (streamed) or late (serial) gives the same numbers to float64 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .types import SampleResult


@dataclass
class Experience:
    """One sample of the experience batch."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    finish_reason: str
    logprobs: torch.Tensor      # actor, from generation (float64, one per response token)
    ref_logprobs: torch.Tensor  # (float64, one per response token)
    values: torch.Tensor        # critic value before each response token (float64)
    reward: float               # reward model score at the last token


class InferenceModels:
    """Ref (causal LM), Reward and Critic (value models) forward on finished samples.

    ``reward`` is a value model (its output at the last token is the score) or a function
    ``f(prompt_ids, response_ids) -> float`` (a rule-based reward).
    """

    def __init__(self, ref: nn.Module,
                 reward: nn.Module | Callable[[Sequence[int], Sequence[int]], float],
                 critic: nn.Module, *,
                 micro_batch: int = 8, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", pad_id: int = 0) -> None:
        self.device = torch.device(device)
        self.ref = ref.to(device=self.device, dtype=dtype).eval()
        self.reward = (reward.to(device=self.device, dtype=dtype).eval()
                       if isinstance(reward, nn.Module) else reward)
        self.critic = critic.to(device=self.device, dtype=dtype).eval()
        self.micro_batch = micro_batch
        self.pad_id = pad_id
        self.samples_scored = 0

    def score(self, samples: Sequence[SampleResult]) -> list[Experience]:
        """Experience for ``samples`` (any number; run in micro-batches), in the given order."""
        out: list[Experience] = []
        for i in range(0, len(samples), self.micro_batch):
            out.extend(self._score_batch(samples[i: i + self.micro_batch]))
        return out

    def _score_batch(self, samples: Sequence[SampleResult]) -> list[Experience]:
        seqs = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.as_tensor(x)
            mask[i, : len(x)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            logits = self.ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
            rewards = self.reward(ids, mask) if isinstance(self.reward, nn.Module) else None
            values = self.critic(ids, mask)
        out = []
        for i, s in enumerate(samples):
            p, g = len(s.prompt_ids), len(s.token_ids)
            # Position p-1+j predicts response token j.
            rows = logits[i, p - 1: p - 1 + g].to(torch.float64)
            tok = torch.as_tensor(s.token_ids, device=rows.device)
            ref_lp = torch.log_softmax(rows, dim=-1).gather(1, tok[:, None])[:, 0]
            out.append(Experience(
                sample_id=s.sample_id, prompt_ids=s.prompt_ids, response_ids=s.token_ids,
                finish_reason=s.finish_reason,
                logprobs=torch.tensor(s.logprobs, dtype=torch.float64),
                ref_logprobs=ref_lp.cpu(),
                values=values[i, p - 1: p - 1 + g].to(torch.float64).cpu(),
                reward=(float(rewards[i, p + g - 1]) if rewards is not None
                        else float(self.reward(s.prompt_ids, s.token_ids))),
            ))
        self.samples_scored += len(samples)
        return out
