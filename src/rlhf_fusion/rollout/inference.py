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

    # Every rank all-gathers the batch's experiences after each rollout; pickling a tensor
    # costs tens of microseconds (its storage goes through torch's reductions), a numpy array
    # of the same float64s almost nothing: 12 ms vs under 1 ms to dump 64 experiences here.
    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for k in _TENSOR_FIELDS:
            t = state[k]
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad \
                    and t.dtype in _NUMPY_DTYPES:
                state[k] = t.numpy()
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        for k in _TENSOR_FIELDS:
            if not isinstance(state[k], torch.Tensor):
                state[k] = torch.from_numpy(state[k])  # type: ignore[arg-type]
        self.__dict__.update(state)


_TENSOR_FIELDS = ("logprobs", "ref_logprobs", "values")
_NUMPY_DTYPES = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32)


class InferenceModels:
    """Ref (causal LM), Reward and Critic (value models) forward on finished samples.

    ``reward`` is a value model (its output at the last token is the score) or a function
    ``f(prompt_ids, response_ids) -> float`` (a rule-based reward). Under a placement a rank
    may hold only some of the three: pass ``None`` for the others and use :meth:`score_parts`,
    whose partial results :func:`merge_parts` joins into :class:`Experience`.
    """

    def __init__(self, ref: nn.Module | None,
                 reward: nn.Module | Callable[[Sequence[int], Sequence[int]], float] | None,
                 critic: nn.Module | None, *,
                 micro_batch: int = 8, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", pad_id: int = 0,
                 values: bool = True) -> None:
        self.device = torch.device(device)
        # values=False: a critic-free run, whose experiences carry zero values (no Critic).
        self.values = values
        self.ref = ref.to(device=self.device, dtype=dtype).eval() if ref is not None else None
        self.reward = (reward.to(device=self.device, dtype=dtype).eval()
                       if isinstance(reward, nn.Module) else reward)
        self.critic = (critic.to(device=self.device, dtype=dtype).eval()
                       if critic is not None else None)
        self.micro_batch = micro_batch
        self.pad_id = pad_id

    def score(self, samples: Sequence[SampleResult]) -> list[Experience]:
        """Experience for ``samples`` (any number; run in micro-batches), in the given order."""
        need = ("ref", "reward", "critic") if self.values else ("ref", "reward")
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ValueError(f"score needs the models {list(need)}; this rank lacks {missing} "
                             "(use score_parts and merge_parts under a placement)")
        parts = self.score_parts(samples)
        return [merge_parts(s, [p], values=self.values) for s, p in zip(samples, parts)]

    def score_parts(self, samples: Sequence[SampleResult]) -> list[dict[str, object]]:
        """Per sample, the outputs of the models this rank holds: ``ref_logprobs`` and
        ``values`` (float64, one per response token), ``reward`` (float)."""
        out: list[dict[str, object]] = []
        for i in range(0, len(samples), self.micro_batch):
            out.extend(self._score_batch(samples[i: i + self.micro_batch]))
        return out

    def _score_batch(self, samples: Sequence[SampleResult]) -> list[dict[str, object]]:
        empty = [s.sample_id for s in samples if not s.prompt_ids]
        if empty:
            raise ValueError(f"samples {empty} have empty prompts: no position predicts their "
                             "first response token, so the Ref cannot score it")
        seqs = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
        width = max(len(x) for x in seqs)
        dev = self.device
        ids = torch.tensor([x + [self.pad_id] * (width - len(x)) for x in seqs], device=dev)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs], device=dev)
        reward_model = isinstance(self.reward, nn.Module)
        with torch.no_grad():
            logits = (self.ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
                      if self.ref is not None else None)
            rewards = self.reward(ids, mask) if reward_model else None
            values = self.critic(ids, mask) if self.critic is not None else None
        # Every response position of the micro-batch at once: one log_softmax, one gather and
        # one device-to-host copy per model, not one per sample (each a sync on a GPU). A row
        # of log_softmax is computed alone, so each sample gets the numbers the per-sample
        # path gave it from the same forward.
        ref_lp = vals = None
        if logits is not None or values is not None:
            lens = [len(s.token_ids) for s in samples]
            rows = torch.tensor([i for i, g in enumerate(lens) for _ in range(g)],
                                dtype=torch.long, device=dev)
            # Position p-1+j predicts response token j.
            cols = torch.tensor([len(s.prompt_ids) - 1 + j for s in samples
                                 for j in range(len(s.token_ids))], dtype=torch.long, device=dev)
            if logits is not None:
                tok = torch.tensor([t for s in samples for t in s.token_ids], dtype=torch.long,
                                   device=dev)
                ref_lp = torch.log_softmax(logits[rows, cols].to(torch.float64), dim=-1).gather(
                    1, tok[:, None])[:, 0].cpu().split(lens)
            if values is not None:
                vals = values[rows, cols].to(torch.float64).cpu().split(lens)
        scores = None
        if rewards is not None:
            last = torch.tensor([len(x) - 1 for x in seqs], device=dev)
            scores = rewards[torch.arange(len(seqs), device=dev), last].tolist()
        out: list[dict[str, object]] = []
        for i, s in enumerate(samples):
            part: dict[str, object] = {}
            if ref_lp is not None:
                part["ref_logprobs"] = ref_lp[i]
            if vals is not None:
                part["values"] = vals[i]
            if scores is not None:
                part["reward"] = float(scores[i])
            elif self.reward is not None:
                part["reward"] = float(self.reward(s.prompt_ids, s.token_ids))
            out.append(part)
        return out


def merge_parts(sample: SampleResult, parts: Sequence[dict[str, object]], *,
                values: bool = True) -> Experience:
    """One sample's experience from the partial scores of the ranks that hold each model;
    ``values=False`` (no Critic): zero values."""
    joined: dict[str, object] = {}
    if not values:
        joined["values"] = torch.zeros(len(sample.token_ids), dtype=torch.float64)
    for part in parts:
        joined.update(part)
    missing = [k for k in ("ref_logprobs", "values", "reward") if k not in joined]
    if missing:
        raise ValueError(f"sample {sample.sample_id}: no rank scored {missing}")
    return Experience(
        sample_id=sample.sample_id, prompt_ids=sample.prompt_ids, response_ids=sample.token_ids,
        finish_reason=sample.finish_reason,
        logprobs=torch.tensor(sample.logprobs, dtype=torch.float64),
        ref_logprobs=joined["ref_logprobs"],  # type: ignore[arg-type]
        values=joined["values"],  # type: ignore[arg-type]
        reward=joined["reward"],  # type: ignore[arg-type]
    )
