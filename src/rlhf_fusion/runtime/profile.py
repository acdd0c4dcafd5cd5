"""A short profiling pass on the real stages: measured times and activation memory for the
planner (:func:`rlhf_fusion.runtime.fused.problem_from_profiles` turns them into a problem)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .engine import TrainStageRunner

MIB = float(1 << 20)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SavedTensorMeter:
    """Bytes of the distinct storages autograd saves for backward while the meter is active.

    Used as a context manager around a forward (``torch.autograd.graph.saved_tensors_hooks``);
    a storage saved several times (or as several views) counts once, and storages of the
    tensors in ``exclude`` (parameters, the micro-batch itself) never count. :meth:`add`
    counts a tensor kept by other means (e.g. a stage output waiting to be sent).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._skip = {self._key(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: Tensor) -> tuple[str, int]:
        return (str(t.device), t.untyped_storage().data_ptr())

    def add(self, t: Tensor) -> None:
        try:
            key = self._key(t)
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (e.g. a sparse tensor)
            key, size = ("id", id(t)), t.numel() * t.element_size()
        if key[1] == 0 or key in self._skip or key in self._seen:
            return
        self._seen.add(key)
        self.bytes += size

    def _pack(self, t: Tensor) -> Tensor:
        self.add(t)
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class StageProfile(NamedTuple):
    """What :func:`profile_runner` measured on one stage."""

    #: mean over micro-batches of each one's fastest forward, seconds
    forward_s: float
    #: mean over micro-batches of each one's fastest backward, seconds
    backward_s: float
    #: the most bytes one micro-batch held from its forward to its backward on this stage
    activation_bytes: int


def profile_runner(
    runner: TrainStageRunner,
    micro_batches: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
    *,
    repeats: int = 1,
    device: torch.device | str = "cpu",
) -> StageProfile:
    """Forward and backward seconds per micro-batch on this stage, and the activation memory
    one micro-batch holds between its forward and its backward.

    One untimed pass over ``micro_batches`` warms up (allocator, kernels for each sequence
    length) and measures memory, then ``repeats`` timed passes; each micro-batch keeps its
    fastest time (least disturbed by other processes) and the mean over micro-batches is
    returned, since their lengths differ and the planner takes one number per stage.

    Activation memory is what the stage keeps alive from a forward until its backward: the
    tensors autograd saves for backward (deduplicated by storage; parameters and the
    micro-batch's own tensors excluded), the received input, and the output kept for sending.
    The largest over the micro-batches is returned (the planner takes one number per stage).

    Stages after the first get a random hidden state of the right shape (from a private
    generator, so the global RNG stream the training relies on is untouched). Gradients the
    pass leaves are cleared.
    """
    device = torch.device(device)
    mbs = [micro_batches] if isinstance(micro_batches, Mapping) else list(micro_batches)
    stage = runner.stage
    params = list(stage.parameters())
    dtype = params[0].dtype if params else torch.float32
    hidden = int(stage.module.config.hidden_size)
    gen = torch.Generator().manual_seed(1234)
    best_f = [float("inf")] * len(mbs)
    best_b = [float("inf")] * len(mbs)
    act_bytes = 0
    key = 0
    for r in range(1 + max(1, repeats)):
        for j, mb in enumerate(mbs):
            key -= 1
            rows, seq = mb["input_ids"].shape
            runner.begin_step(1.0)
            inp = None
            if not stage.is_first:
                inp = torch.randn(rows, seq, hidden, generator=gen).to(device=device, dtype=dtype)
            _sync(device)
            if r == 0:  # the warm-up pass measures memory (hooks stay out of the timed passes)
                with SavedTensorMeter(exclude=[*params, *mb.values()]) as meter:
                    out = runner.forward((0, key), inp, mb)
                if inp is not None:
                    meter.add(inp)
                if out is not None:
                    meter.add(out)
                act_bytes = max(act_bytes, meter.bytes)
            t0 = time.perf_counter()
            if r:
                out = runner.forward((0, key), inp, mb)
            _sync(device)
            t1 = time.perf_counter()
            grad = None
            if out is not None:
                grad = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
            runner.backward((0, key), grad)
            _sync(device)
            t2 = time.perf_counter()
            if r:  # pass 0 is the warm-up
                best_f[j] = min(best_f[j], t1 - t0)
                best_b[j] = min(best_b[j], t2 - t1)
    for p in params:
        p.grad = None
    runner.begin_step(1.0)
    return StageProfile(statistics.fmean(best_f), statistics.fmean(best_b), act_bytes)
