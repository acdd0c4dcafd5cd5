"""Errors raised by the pipeline runtime; each message names where it happened and the fix."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Something went wrong while executing an instruction stream."""


class PipelineTimeoutError(PipelineError):
    """A wait (receive, send completion, collective) exceeded the configured timeout.

    The message names the waiting rank and the model, copy, stage and micro-batch it waited for,
    so a stalled or dead peer can be found from any surviving rank's log.
    """


class PeerError(PipelineError):
    """The transport reported a failure (typically a peer process that died)."""


class PartitionError(ValueError):
    """A model cannot be split into the requested pipeline stages."""


class PlanError(ValueError):
    """A schedule/problem that does not match the models or the process layout."""
