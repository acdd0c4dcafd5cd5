"""Generation and scoring for :class:`FusedPPOTrainer`, in TRL PPO's tensor layout.

Two ways to produce one step's :class:`PPORollout`, with the same meaning:

- :func:`padded_rollout` is the stock path: ``model.generate`` on chunks of the padded batch,
  then Ref, Critic and Reward forward passes over the padded chunks (what ``FusionConfig.off()``
  runs, step for step as trl 1.12's ``PPOTrainer``).
- :func:`streamed_rollout` generates with our continuous-batching backend and scores every
  finished sample on its own row while the rest decode; with several processes the long tail
  migrates to fewer of them (:func:`rlhf_fusion.rollout.distributed.run_rollout`).

Both fill the same ``[B, C + R]`` / ``[B, R]`` tensors: ``C`` the padded query width of this
process's batch, ``R`` the longest response of the batch. Tokens after a response's end hold the
generation pad token, as ``generate`` leaves them, so the masks TRL derives later (first pad,
``sequence_length + 1`` for values) mean the same in both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...rollout.rt_control import ScoringCall, scoring_call
from ...rollout.types import SampleResult, SampleSpec


@dataclass
class PPORollout:
    """One step's samples and their scores (this process's share of the batch).

    ``query_responses`` ``[B, C+R]``; ``logprobs``, ``ref_logprobs``, ``values`` ``[B, R]``
    (float32, unmasked: TRL masks them later); ``scores`` ``[B]``; ``gen_s`` and ``inf_s`` the
    seconds spent generating and scoring (overlapping when streamed).
    """

    query_responses: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor
    scores: Tensor
    context_length: int
    gen_s: float
    inf_s: float
    stats: dict[str, Any]

    @property
    def responses(self) -> Tensor:
        return self.query_responses[:, self.context_length:]


def first_true_indices(bools: Tensor) -> Tensor:
    """Index of the first True of each row of ``bools`` ``[..., N]``; ``N`` where none is."""
    n = bools.size(-1)
    idx = torch.arange(n, dtype=torch.long, device=bools.device)
    return torch.min(n * (~bools).long() + idx, dim=-1).values


def truncate_at_stop(responses: Tensor, stop_id: int | None, pad_id: int) -> Tensor:
    """``responses`` ``[B, R]`` with every token after the first ``stop_id`` set to ``pad_id``."""
    if stop_id is None:
        return responses
    cut = first_true_indices(responses == stop_id).unsqueeze(-1)
    idx = torch.arange(responses.shape[1], device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idx > cut, pad_id)


def lm_forward(model: nn.Module, query_responses: Tensor, pad_id: int) -> Any:
    """A causal LM (or TRL's policy+value wrapper) on right-padded rows: pads masked, positions
    counted over real tokens."""
    attention_mask = query_responses != pad_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 return_dict=True, output_hidden_states=True)


def head_logits(model: nn.Module, query_responses: Tensor, pad_id: int, context_length: int
                ) -> Tensor:
    """Per-token outputs ``[B, T, 1]`` of a sequence-classification model (Critic or Reward):
    TRL's ``get_reward`` without the pick."""
    from trl.experimental.utils import get_reward

    return get_reward(model, query_responses, pad_id, context_length)[0]


def _tokens_to_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    from trl.trainer.utils import selective_log_softmax

    return selective_log_softmax(logits, tokens)


# -- stock path -------------------------------------------------------------------------------

@torch.no_grad()
def padded_rollout(*, policy: nn.Module, ref: nn.Module, critic: nn.Module, reward: nn.Module,
                   queries: Tensor, generation_config: Any, chunk: int, pad_id: int,
                   stop_id: int | None, temperature: float) -> PPORollout:
    """``generate`` on chunks of ``queries`` ``[B, C]``, then scoring chunk by chunk."""
    from trl.trainer.utils import pad

    t0 = time.perf_counter()
    context_length = queries.shape[1]
    outs, scores_ = [], []
    for i in range(0, queries.shape[0], chunk):
        q = queries[i: i + chunk]
        mask = q != pad_id
        out = policy.generate(input_ids=torch.masked_fill(q, ~mask, 0), attention_mask=mask,
                              generation_config=generation_config, return_dict_in_generate=True,
                              output_scores=True)
        outs.append(torch.cat((q, out.sequences[:, context_length:]), 1))
        scores_.append(torch.stack(out.scores, 1))
    b = queries.shape[0]
    query_responses = pad(outs, padding_value=pad_id, padding_side="right")
    query_responses = query_responses.view(-1, query_responses.shape[-1])[:b]
    gen_logits = pad(scores_, padding_value=0, padding_side="right")
    gen_logits = gen_logits.view(-1, *gen_logits.shape[2:])[:b]
    t1 = time.perf_counter()
    lp, ref_lp, values, scores = score_padded(
        ref=ref, critic=critic, reward=reward, queries=queries, query_responses=query_responses,
        gen_logits=gen_logits, chunk=chunk, pad_id=pad_id, stop_id=stop_id,
        temperature=temperature)
    t2 = time.perf_counter()
    assert lp is not None
    return PPORollout(query_responses, lp, ref_lp, values, scores, context_length,
                      gen_s=t1 - t0, inf_s=t2 - t1, stats={})


@torch.no_grad()
def score_padded(*, ref: nn.Module, critic: nn.Module, reward: nn.Module, queries: Tensor,
                 query_responses: Tensor, gen_logits: Tensor | None, chunk: int, pad_id: int,
                 stop_id: int | None, temperature: float
                 ) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """Stock scoring of padded rows, chunk by chunk: generation logprobs (when ``gen_logits``
    ``[B, R, V]`` is given), Ref logprobs, Critic values ``[B, R]`` and Reward scores ``[B]``."""
    context_length = queries.shape[1]
    parts: dict[str, list[Tensor]] = {"lp": [], "ref": [], "v": [], "s": []}
    for i in range(0, queries.shape[0], chunk):
        qr = query_responses[i: i + chunk]
        response = qr[:, context_length:]
        if gen_logits is not None:
            parts["lp"].append(_tokens_to_logprobs(gen_logits[i: i + chunk], response))
        ref_logits = lm_forward(ref, qr, pad_id).logits[:, context_length - 1: -1]
        ref_logits /= temperature + 1e-7
        parts["ref"].append(_tokens_to_logprobs(ref_logits, response))
        post = torch.cat((queries[i: i + chunk], truncate_at_stop(response, stop_id, pad_id)), 1)
        parts["v"].append(head_logits(critic, qr, pad_id, context_length)
                          [:, context_length - 1: -1].squeeze(-1))
        parts["s"].append(_pick_scores(head_logits(reward, post, pad_id, context_length),
                                       post, pad_id, context_length))
    return (torch.cat(parts["lp"]) if parts["lp"] else None, torch.cat(parts["ref"]),
            torch.cat(parts["v"]), torch.cat(parts["s"]))


def _pick_scores(reward_logits: Tensor, post: Tensor, pad_id: int, context_length: int) -> Tensor:
    """The reward at each row's last response token before the first pad (TRL's rule)."""
    last = first_true_indices(post[:, context_length:] == pad_id) - 1 + context_length
    return reward_logits[torch.arange(post.shape[0], device=post.device), last].squeeze(-1)


# -- streamed path ----------------------------------------------------------------------------

@dataclass
class ScoredSample:
    """What scoring one finished sample yields (per response position, float32)."""

    sample_id: int
    tokens: tuple[int, ...]
    logprobs: Tensor      # [g] from generation
    ref_logprobs: Tensor  # [g]
    values: Tensor        # [g + 1]: the Critic also reads the position after the response
    score: float


class RowScorer:
    """Ref, Critic and Reward on finished samples, each on its own row (query row as batched,
    the response, one fill token), in micro-batches; ``score`` is what run_rollout calls."""

    def __init__(self, *, ref: nn.Module, critic: nn.Module, reward: nn.Module,
                 query_rows: dict[int, Tensor], pad_id: int, fill_id: int, stop_id: int | None,
                 temperature: float, micro_batch: int, max_rows: int | None = None,
                 min_tokens: int = 1024) -> None:
        self.ref, self.critic, self.reward = ref, critic, reward
        self.query_rows = query_rows
        self.pad_id, self.fill_id, self.stop_id = pad_id, fill_id, stop_id
        self.temperature = temperature
        self.micro_batch = micro_batch
        self.max_rows = max_rows or micro_batch
        self.min_tokens = min_tokens
        self.seconds = 0.0
        self.calls: list[ScoringCall] = []

    def ready(self, pending: Sequence[SampleResult]) -> bool:
        """Whether the finished samples waiting to be scored fill one scoring pass (``max_rows``
        rows or ``min_tokens`` padded tokens; see :func:`.scoring.pass_is_full`)."""
        from .scoring import pass_is_full

        width = max((int(self.query_rows[s.sample_id].numel()) for s in pending), default=0)
        return pass_is_full(pending, width + 1, max_rows=self.max_rows,
                            min_tokens=self.min_tokens)

    def score(self, samples: Sequence[SampleResult], rows: int | None = None
              ) -> list[ScoredSample]:
        """Score ``samples`` in passes of ``rows`` (default :attr:`micro_batch`) samples."""
        out: list[ScoredSample] = []
        rows = rows or self.micro_batch
        for i in range(0, len(samples), rows):
            t = time.perf_counter()
            chunk = samples[i: i + rows]
            out.extend(self._score(chunk))
            dt = time.perf_counter() - t
            self.seconds += dt
            self.calls.append(scoring_call(chunk, dt))
        return out

    @torch.no_grad()
    def _score(self, samples: Sequence[SampleResult]) -> list[ScoredSample]:
        # Rows grouped by query width (one width per process's batch): the context slice is
        # shared within a group.
        out: list[ScoredSample] = []
        by_ctx: dict[int, list[SampleResult]] = {}
        for s in samples:
            by_ctx.setdefault(int(self.query_rows[s.sample_id].numel()), []).append(s)
        for ctx, group in by_ctx.items():
            out.extend(self._score_group(ctx, group))
        return out

    def _score_group(self, ctx: int, samples: Sequence[SampleResult]) -> list[ScoredSample]:
        width = ctx + max(len(s.token_ids) for s in samples) + 1
        rows = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(samples):
            q = self.query_rows[s.sample_id]
            g = len(s.token_ids)
            rows[i, :ctx] = q
            rows[i, ctx: ctx + g] = torch.tensor(s.token_ids)
            rows[i, ctx + g] = self.fill_id
        device = next(self.critic.parameters()).device
        rows = rows.to(device)
        responses = rows[:, ctx:]
        ref_logits = lm_forward(self.ref, rows, self.pad_id).logits[:, ctx - 1: -1]
        ref_logits /= self.temperature + 1e-7
        ref_lp = _tokens_to_logprobs(ref_logits, responses)
        values = head_logits(self.critic, rows, self.pad_id, ctx)[:, ctx - 1: -1].squeeze(-1)
        post = torch.cat((rows[:, :ctx], truncate_at_stop(responses, self.stop_id, self.pad_id)),
                         1)
        # Each row's fill token is past its end: mask it so the reward pick stops there.
        for i, s in enumerate(samples):
            post[i, ctx + len(s.token_ids):] = self.pad_id
        scores = _pick_scores(head_logits(self.reward, post, self.pad_id, ctx), post,
                              self.pad_id, ctx)
        out = []
        for i, s in enumerate(samples):
            g = len(s.token_ids)
            out.append(ScoredSample(
                sample_id=s.sample_id, tokens=tuple(s.token_ids),
                logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
                ref_logprobs=ref_lp[i, :g].float().cpu(), values=values[i, : g + 1].float().cpu(),
                score=float(scores[i])))
        return out


def assemble(queries: Tensor, scored: Sequence[ScoredSample], *, fill_id: int, pad_id: int,
             chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """TRL's padded tensors from per-sample scores, in ``queries`` order.

    Past a response's end, ``generate`` leaves its pad token up to the longest response of the
    sample's generation chunk and ``pad`` the tokenizer's pad token beyond: the same here, so
    the query-response rows are the ones stock TRL would hold for these tokens.
    """
    b, ctx = queries.shape
    lens = [len(s.tokens) for s in scored]
    r = max(lens)
    qr = torch.full((b, ctx + r), pad_id, dtype=torch.long)
    qr[:, :ctx] = queries.cpu()
    lp, ref, val = (torch.zeros(b, r) for _ in range(3))
    scores = torch.zeros(b)
    for start in range(0, b, chunk):
        chunk_len = max(lens[start: start + chunk])
        for i in range(start, min(b, start + chunk)):
            s, g = scored[i], lens[i]
            qr[i, ctx: ctx + g] = torch.tensor(s.tokens)
            qr[i, ctx + g: ctx + chunk_len] = fill_id
            lp[i, :g] = s.logprobs
            ref[i, :g] = s.ref_logprobs
            val[i, : min(g + 1, r)] = s.values[: min(g + 1, r)]
            scores[i] = s.score
    return qr, lp, ref, val, scores


def left_pad(queries: Tensor, pad_id: int) -> Tensor:
    """``queries`` ``[B, C]`` with each row's real tokens moved to the right end.

    The training forward predicts response token 0 from column ``C - 1``; with right-padded
    queries that column is a pad for short prompts, so the generation that samples token 0
    from the prompt's real last token would not be the distribution training scores. Stock
    TRL has the same mismatch (transformers warns about right padding); the streamed rollout
    lays queries out left-padded, as TRL's PPO examples do.
    """
    keep = queries != pad_id
    out = torch.full_like(queries, pad_id)
    width = queries.shape[1]
    for i in range(queries.shape[0]):
        row = queries[i][keep[i]]
        out[i, width - row.numel():] = row
    return out


def sample_specs(queries: Tensor, *, pad_id: int, ids: Sequence[int], max_new_tokens: int,
                 seed: int, temperature: float, stop_ids: tuple[int, ...]) -> list[SampleSpec]:
    """One request per query row: the row's real tokens (pads dropped, as the training forward
    masks them), TRL's sampling temperature, its stop token."""
    return [SampleSpec(sample_id=int(sid), prompt_ids=tuple(q[q != pad_id].tolist()),
                       max_new_tokens=max_new_tokens, seed=seed,
                       temperature=temperature + 1e-7, stop_token_ids=stop_ids)
            for sid, q in zip(ids, queries.cpu())]
