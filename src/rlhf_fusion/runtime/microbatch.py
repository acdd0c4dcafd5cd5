"""Splitting a PPO experience batch into micro-batches.

The strategy and the single-device reference both go through :func:`split_micro_batches`, so
they see exactly the same micro-batches (same rows, same trimmed lengths); that is what makes
the pipelined run comparable bit for bit with the unpipelined one.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

MicroBatch = dict[str, Tensor]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip padding: 0 for the first real token of each row (left padding safe)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


def _trim_bounds(attention_mask: Tensor) -> tuple[int, int]:
    used = attention_mask.bool().any(dim=0).nonzero().flatten()
    if used.numel() == 0:
        return 0, attention_mask.shape[1]
    return int(used[0]), int(used[-1]) + 1


def split_micro_batches(
    batch: Mapping[str, Tensor], num_micro_batches: int, *, trim: bool = True
) -> list[MicroBatch]:
    """Split ``batch`` row-wise into ``num_micro_batches`` equal micro-batches.

    Every tensor whose first dimension is the batch size is split. Per-token tensors (second
    dimension equal to the sequence length of ``attention_mask``) are trimmed to the columns that
    hold at least one real token in the micro-batch, so micro-batches of short responses carry
    short sequences: the pipeline then moves activations of varying shapes between stages.
    ``position_ids`` are derived from the attention mask when the batch has none.
    """
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise KeyError(
            "batch: needs 'input_ids' and 'attention_mask' (shape [batch, seq]); got keys "
            f"{sorted(batch)}"
        )
    rows, seq = batch["attention_mask"].shape
    if num_micro_batches < 1 or rows % num_micro_batches:
        raise ValueError(
            f"batch: {rows} rows cannot be split into {num_micro_batches} equal micro-batches; "
            "make the batch size a multiple of the number of micro-batches"
        )
    size = rows // num_micro_batches
    out: list[MicroBatch] = []
    for i in range(num_micro_batches):
        rows_i = slice(i * size, (i + 1) * size)
        mask = batch["attention_mask"][rows_i]
        lo, hi = _trim_bounds(mask) if trim else (0, seq)
        mb: MicroBatch = {}
        for key, value in batch.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != rows:
                continue
            part = value[rows_i]
            if part.dim() >= 2 and part.shape[1] == seq:
                part = part[:, lo:hi]
            mb[key] = part.contiguous()
        if "position_ids" not in mb:
            mb["position_ids"] = position_ids_from_mask(mb["attention_mask"])
        out.append(mb)
    return out
