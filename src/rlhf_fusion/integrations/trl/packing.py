"""Padding-free batches: the real tokens of a padded batch, bin-packed into fewer rows.

A GRPO/RLOO training batch is ``[B, T]`` with prompts left-padded and completions
right-padded to the longest completion; with a long tail most of it is padding. :func:`pack`
moves each row's real tokens (``attention_mask == 1``) into rows of capacity ``C`` (default
``T``) by first-fit-decreasing, so the model runs on ``[R, C]`` with ``R`` usually several times
smaller than ``B``; :func:`unpack` scatters per-token outputs back to ``[B, T]``.

What the model must be given so that every real token sees what it saw in the padded batch:

- ``position_ids``: each token's *original column index*. TRL's padded forward passes no
  ``position_ids`` and transformers' Llama/Qwen2 default them to ``arange(T)`` (not a cumsum of
  the mask), so a left-padded prompt's first token sits at position ``#pads``; packed tokens
  keep that position.
- a block-diagonal causal 4D mask ``[R, 1, C, C]``: a token attends to the earlier tokens of
  its own sequence only. Bin tail padding attends to itself alone, so no softmax row is empty
  (no NaN, and nothing real ever attends to it).

transformers 5 (``masking_utils._preprocess_mask_arguments``) returns any 4D mask as given,
without adding causality or sliding windows, and hands it to the attention function. Its
``sdpa`` attention takes a boolean mask (True = attend), but ``eager`` attention *adds* the mask
to the scores, so a boolean mask there would silently add 0/1: eager needs the additive float
mask of :func:`attention_mask_for` (0 = attend, ``finfo.min`` = not). Other attention
implementations (flash, flex) do not take a dense 4D mask, and sliding-window layers would lose
their window: the caller must fall back to the padded forward for those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Packed",
    "Targets",
    "attention_mask_for",
    "completion_targets",
    "first_fit_decreasing",
    "pack",
    "unpack",
]


@dataclass(frozen=True)
class Packed:
    """A packed batch and the maps back to the padded one.

    - ``input_ids``, ``position_ids``: ``[R, C]`` (bin tail padding: token ``pad_id``,
      position 0).
    - ``attention_mask``: ``[R, 1, C, C]`` bool, True where a query may attend to a key.
    - ``seq_ids``: ``[R, C]``, the source row of each packed slot, -1 on bin tail padding.
    - ``src``: ``[N]``, flat index ``b * T + t`` into the padded ``[B, T]`` of each real token.
    - ``dst``: ``[N]``, flat index ``r * C + j`` into the packed ``[R, C]`` of the same token.
    - ``shape``: ``(B, T)`` of the padded batch.

    Within a sequence the packed order is the original column order, so "earlier in the bin"
    and "earlier in the sequence" agree.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    seq_ids: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    shape: tuple[int, int]

    @property
    def rows(self) -> int:
        return int(self.input_ids.size(0))

    @property
    def capacity(self) -> int:
        return int(self.input_ids.size(1))

    def select(self, rows: slice) -> Packed:
        """The bins ``rows`` alone (for chunked forwards); ``src``/``dst`` keep only their
        tokens, ``dst`` re-based to the selected bins."""
        start, stop, _ = rows.indices(self.rows)
        c = self.capacity
        keep = (self.dst >= start * c) & (self.dst < stop * c)
        return Packed(self.input_ids[rows], self.position_ids[rows], self.attention_mask[rows],
                      self.seq_ids[rows], self.src[keep], self.dst[keep] - start * c,
                      self.shape)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: longest first, each into the first bin with room.

    Items of length 0 are left out. Raises ``ValueError`` if an item exceeds ``capacity``.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit a bin of {capacity}; "
                             "pass capacity >= the longest sequence")
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None = None,
         pad_id: int = 0) -> Packed:
    """Pack the real tokens of ``input_ids [B, T]`` (where ``attention_mask [B, T]`` is 1)
    into rows of ``capacity`` (default ``T``); see :class:`Packed` for what comes back.

    A batch with no real token gives one bin of padding (``R = 1``), so a forward still runs.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"pack needs input_ids and attention_mask of the same [B, T] shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    b, t = input_ids.shape
    cap = t if capacity is None else int(capacity)
    real = attention_mask.bool()
    lengths = real.sum(1).tolist()
    bins = first_fit_decreasing(lengths, cap) or [[]]
    dev = input_ids.device
    # Each real token's (row, column) in the padded batch, row-major: a row's tokens in order.
    rows_idx, cols_idx = real.nonzero(as_tuple=True)
    starts = [0] * b
    acc = 0
    for i, n in enumerate(lengths):
        starts[i] = acc
        acc += n
    # For every token in packed order, where it comes from (an index into rows_idx/cols_idx).
    order: list[int] = []
    dst: list[int] = []
    for r, members in enumerate(bins):
        j = 0
        for i in members:
            n = lengths[i]
            order.extend(range(starts[i], starts[i] + n))
            dst.extend(range(r * cap + j, r * cap + j + n))
            j += n
    order_t = torch.tensor(order, dtype=torch.long, device=dev)
    dst_t = torch.tensor(dst, dtype=torch.long, device=dev)
    src_rows, src_cols = rows_idx[order_t], cols_idx[order_t]
    n_bins = len(bins)
    flat_ids = input_ids.new_full((n_bins * cap,), pad_id)
    flat_ids[dst_t] = input_ids[src_rows, src_cols]
    flat_pos = torch.zeros(n_bins * cap, dtype=torch.long, device=dev)
    flat_pos[dst_t] = src_cols
    flat_seq = torch.full((n_bins * cap,), -1, dtype=torch.long, device=dev)
    flat_seq[dst_t] = src_rows
    seq_ids = flat_seq.view(n_bins, cap)
    # Block-diagonal causal mask. Padding slots get ids of their own (>= B, one per slot), so
    # "same id and not later" leaves them attending to themselves only.
    unique = torch.arange(n_bins * cap, device=dev).view(n_bins, cap) + b
    ids = torch.where(seq_ids >= 0, seq_ids, unique)
    causal = torch.ones(cap, cap, dtype=torch.bool, device=dev).tril()
    mask = (ids[:, :, None] == ids[:, None, :]) & causal
    return Packed(input_ids=flat_ids.view(n_bins, cap), position_ids=flat_pos.view(n_bins, cap),
                  attention_mask=mask.unsqueeze(1), seq_ids=seq_ids,
                  src=src_rows * t + src_cols, dst=dst_t, shape=(b, t))


def unpack(values: torch.Tensor, packed: Packed, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``values [R, C, *rest]`` back to ``[B, T, *rest]``, ``fill`` where the padded
    batch had padding. Differentiable in ``values``."""
    r, c = values.shape[:2]
    if (r, c) != (packed.rows, packed.capacity):
        raise ValueError(f"values are [{r}, {c}, ...], the packed batch is "
                         f"[{packed.rows}, {packed.capacity}]")
    rest = values.shape[2:]
    b, t = packed.shape
    flat = values.reshape(r * c, *rest)
    out = values.new_full((b * t, *rest), fill)
    out = out.index_put((packed.src,), flat[packed.dst])
    return out.view(b, t, *rest)


def attention_mask_for(mask: torch.Tensor, attn_implementation: str,
                       dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask as ``attn_implementation`` reads it: boolean for ``sdpa``, additive
    (0 / ``finfo(dtype).min``) for ``eager``, which adds the mask to the scores."""
    if attn_implementation == "sdpa":
        return mask
    if attn_implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min)
    raise ValueError(f"attn_implementation={attn_implementation!r} takes no dense 4D mask; "
                     "use 'sdpa' or 'eager', or the padded forward")


@dataclass(frozen=True)
class Targets:
    """The tokens a forward over a packed batch scores: every real token in the padded
    batch's columns ``>= first`` (TRL's completion columns, ``first = T - logits_to_keep``).

    - ``token``: ``[M]``, packed flat index of each scored token (its id is the label).
    - ``pred``: ``[M]``, packed flat index of the position whose output predicts it (``token - 1``).
    - ``out``: ``[M]``, flat index into the ``[B, T - first]`` output.
    """

    token: torch.Tensor
    pred: torch.Tensor
    out: torch.Tensor


def completion_targets(packed: Packed, first: int) -> Targets | None:
    """The scored tokens of ``packed`` in columns ``>= first``, or None when some such token is
    not preceded, in its own padded row, by a real token at the previous column: the padded
    forward predicts that one from a padding position, which the packed batch does not hold.
    """
    b, t = packed.shape
    c = packed.capacity
    row, col = packed.src // t, packed.src % t
    sel = col >= first
    token, row, col = packed.dst[sel], row[sel], col[sel]
    pred = token - 1
    if bool((token % c == 0).any()):
        return None
    seq, pos = packed.seq_ids.reshape(-1), packed.position_ids.reshape(-1)
    if not bool(((seq[pred] == row) & (pos[pred] == col - 1)).all()):
        return None
    return Targets(token=token, pred=pred, out=row * (t - first) + (col - first))
