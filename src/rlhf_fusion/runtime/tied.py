"""Tied input/output embeddings across pipeline stages, summed in one device's order.

A model whose LM head reuses the token embedding holds that weight on two stages: the first
(the embedding) and the last (the head). Each accumulates its own part of the gradient, and
the two parts must be summed before the optimizer step (Megatron's embedding group). Summing
the two accumulated parts, ``(e_1 + e_2) + (h_1 + h_2)``, is not what one device computes:
there autograd adds both uses of the weight within every micro-batch's backward and
accumulates micro-batch by micro-batch, ``(h_1 + e_1) + (h_2 + e_2)``. Floating-point addition
is not associative, so the plain sum differs from one device by an ulp, and Adam grows that.

:class:`TiedGradient` records each micro-batch's part at the rows it can differ in, and
:func:`sum_in_device_order` redoes the sum there in one device's order. The embedding's
gradient is zero outside the rows of the tokens a micro-batch contains, so every other row
already holds one device's value on the last stage (``h + 0 == h``). What crosses between the
two stages is those rows, once per micro-batch, and the summed weight gradient once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from .comm import PipelineComm


class TiedGradient:
    """Records, per micro-batch, the tied weight's incoming gradient at the step's token rows.

    A tensor hook sees a leaf's gradient of one backward before it is accumulated into
    ``.grad``: on the first stage the embedding's part, on the last the head's.
    """

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self.rows: Tensor | None = None
        self.key: tuple[int, int] | None = None
        self.parts: dict[tuple[int, int], Tensor] = {}
        self.runs = 0
        weight.register_hook(self._record)

    def track(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> None:
        """Start a run over ``micro_batches``: the rows are every token id they contain (a
        superset of the rows any embedding gradient of the run touches).

        Several runs accumulating into one sum (gradient accumulation across engine runs) are
        not recorded: ``rows`` stays ``None`` and the sum is the plain one.
        """
        self.runs += 1
        self.parts = {}
        if self.runs > 1:
            self.rows = None
            return
        ids = torch.cat([mb["input_ids"].reshape(-1) for mb in micro_batches])
        self.rows = torch.unique(ids).to(self.weight.device)

    def _record(self, grad: Tensor) -> None:
        if self.rows is not None and self.key is not None:
            if self.key in self.parts:
                raise RuntimeError(f"tied embedding: micro-batch {self.key} ran backward twice")
            self.parts[self.key] = grad.index_select(0, self.rows)

    def stacked(self) -> Tensor:
        """The recorded parts in micro-batch order, ``[micro-batches, rows, hidden]``."""
        assert self.rows is not None
        if not self.parts:
            return self.weight.new_zeros((0, len(self.rows), *self.weight.shape[1:]))
        return torch.stack([self.parts[k] for k in sorted(self.parts)])

    def done(self) -> None:
        """The sum is taken: the next run starts a new one."""
        self.rows, self.key, self.parts, self.runs = None, None, {}, 0


def sum_in_device_order(
    tied: TiedGradient, *, is_last: bool, comm: PipelineComm, group: object, what: str
) -> None:
    """Sum the tied weight's gradient over the first and the last stage of one pipeline (the
    two ranks of ``group``), as one device adds it; both ends hold the sum afterwards.

    The first stage's per-micro-batch rows go to the last stage, which redoes
    ``sum_i (head_i + embedding_i)`` at those rows over its own record; then the last stage's
    whole gradient goes to the first (an all-reduce against zeros: ``x + 0 == x``).
    """
    w = tied.weight
    mine = tied.stacked()
    emb = mine if not is_last else torch.zeros_like(mine)
    comm.all_reduce(emb, group, f"sending the tied {what} embedding's rows to the last stage")
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    if is_last:
        if emb.shape[0] != mine.shape[0]:
            raise RuntimeError(
                f"tied {what} embedding: {emb.shape[0]} micro-batches on the "
                f"first stage, {mine.shape[0]} on the last"
            )
        if mine.shape[0]:
            acc = mine[0] + emb[0]
            for i in range(1, mine.shape[0]):
                acc = acc + (mine[i] + emb[i])
            assert tied.rows is not None
            w.grad.index_copy_(0, tied.rows, acc)
    else:
        w.grad.zero_()
    comm.all_reduce(w.grad, group, f"all-reducing the tied {what} embedding gradient")
    tied.done()
