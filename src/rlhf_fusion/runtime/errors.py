"""Errors raised by the pipeline runtime; each message names where it happened and the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import RLHFFusionError


class PipelineError(RLHFFusionError, RuntimeError):
    """Something went wrong while executing an instruction stream.

    When the failure happens inside :meth:`PipelineEngine.run`, the engine appends the
    instruction streams around the failing instruction (see :func:`format_stream_grid`) to the
    message, below its unchanged first line, and keeps the grid in :attr:`schedule`.
    """

    #: the step x rank grid appended by the engine (None until it is)
    schedule: str | None = None
    #: the :class:`~rlhf_fusion.runtime.comm.Transfer` whose wait failed, when the comm knows it
    transfer: object | None = None

    def add_schedule(self, grid: str) -> None:
        """Append ``grid`` to the message (once; a re-raised error keeps the first grid)."""
        if self.schedule is not None:
            return
        self.schedule = grid
        first = str(self.args[0]) if self.args else ""
        self.args = (f"{first}\n\n{grid}", *self.args[1:])


class PipelineTimeoutError(PipelineError):
    """A wait (receive, send completion, collective) exceeded the configured timeout.

    The message names the waiting rank and the model, copy, stage and micro-batch it waited for,
    so a stalled or dead peer can be found from any surviving rank's log.
    """


class PeerError(PipelineError):
    """The transport reported a failure (typically a peer process that died)."""


class PartitionError(RLHFFusionError, ValueError):
    """A model cannot be split into the requested pipeline stages."""


class PlanError(RLHFFusionError, ValueError):
    """A schedule/problem that does not match the models or the process layout."""


def format_stream_grid(
    streams: Mapping[int, Sequence[object]],
    rank: int,
    step: int,
    *,
    before: int = 3,
    after: int = 3,
) -> str:
    """Steps ``step - before .. step + after`` of every rank's instruction stream as a grid.

    Rows are steps (the index of an instruction in its rank's stream), columns are the ranks of
    ``streams`` (rank -> its actions, anything ``str()`` renders) in ascending order, as
    ``torch.distributed.pipelining`` prints a schedule. The cell of ``rank`` at ``step`` is
    marked ``>action<``; a ``step`` at or past the end of that rank's stream (a failure after its
    last instruction, e.g. while finishing sends) is drawn as ``>end of stream<``. A row of
    ``...`` stands for steps left out above or below the window. Pure string formatting::

        >>> print(format_stream_grid({0: ["F0", "SEND_F0", "F1"], 1: ["RECV_F0", "F0"]}, 1, 1))
                 rank 0    rank 1
        step 0:  F0        RECV_F0
        step 1:  SEND_F0  >F0<
        step 2:  F1
    """
    if rank not in streams:
        raise ValueError(f"rank {rank} is not one of the streams' ranks {sorted(streams)}")
    if step < 0 or before < 0 or after < 0:
        raise ValueError(f"step, before and after must be >= 0, got {step}, {before}, {after}")
    ranks = sorted(streams)
    longest = max(len(streams[r]) for r in ranks)
    lo = max(0, step - before)
    hi = max(step, min(step + after, longest - 1))  # inclusive

    def cell(r: int, s: int) -> str:
        stream = streams[r]
        if s < len(stream):
            return str(stream[s])
        return "end of stream" if (r, s) == (rank, step) else ""

    widths = {
        r: max([len(f"rank {r}")] + [len(cell(r, s)) for s in range(lo, hi + 1)]) for r in ranks
    }
    label_w = len(f"step {hi}:")

    def row(label: str, cells: Mapping[int, str], marked: int | None) -> str:
        parts = []
        for r in ranks:
            text = f">{cells[r]}<" if r == marked else f" {cells[r]} "
            parts.append(f"{text:<{widths[r] + 2}}")
        return f"{label:<{label_w}} " + " ".join(parts)

    lines = [row("", {r: f"rank {r}" for r in ranks}, None)]
    if lo > 0:
        lines.append(row("...", {r: "" for r in ranks}, None))
    for s in range(lo, hi + 1):
        lines.append(row(f"step {s}:", {r: cell(r, s) for r in ranks}, rank if s == step else None))
    if hi < longest - 1:
        lines.append(row("...", {r: "" for r in ranks}, None))
    return "\n".join(line.rstrip() for line in lines)


class EngineKindError(RLHFFusionError, ValueError):
    """Training layouts no training engine runs together; the message names the kinds."""
