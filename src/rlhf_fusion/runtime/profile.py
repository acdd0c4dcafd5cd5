"""A short profiling pass on the real stages, feeding measured times and activation memory to
the planner."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..schedule import Problem, fused_problem
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


def problem_from_profiles(
    profiles: Sequence[Mapping[str, Sequence[float]]],
    *,
    stage_groups: int,
    micro_batches: int,
    actor_stages: int,
    critic_stages: int,
    activation: Mapping[str, Sequence[float]] | None = None,
    sizes: Mapping[str, float] | None = None,
) -> Problem:
    """The fused problem with measured per-stage times in milliseconds and activation memory
    in MiB.

    ``profiles`` holds, per rank, ``{model: (stage, forward_s, backward_s[, activation_bytes])}``
    (``(stage, *profile_runner(...))``); a stage held by several ranks (copies, replicas) takes
    the largest measurement. ``activation`` overrides the measured memory (any unit, the same
    for both models); without either, every stage gets 1.0 (the planner then counts
    micro-batches in flight).
    """
    times: dict[str, dict[int, list[float]]] = {"actor": {}, "critic": {}}
    measured = True
    for prof in profiles:
        for model, (stage, f, b, *rest) in prof.items():
            act = float(rest[0]) if rest else 0.0
            measured &= bool(rest)
            cur = times[model].get(stage)
            times[model][stage] = (
                [max(cur[0], f), max(cur[1], b), max(cur[2], act)] if cur else [f, b, act]
            )

    def per_stage(model: str, stages: int, k: int, scale: float) -> list[float]:
        missing = [s for s in range(stages) if s not in times[model]]
        if missing:
            raise RuntimeError(f"profiling: no measurement for {model} stages {missing}")
        # Three decimals (us, KiB), floored at 0.001 so a trivially cheap stage still counts.
        return [max(round(times[model][s][k] * scale, 3), 0.001) for s in range(stages)]

    stages = {"actor": actor_stages, "critic": critic_stages}
    if activation is not None:
        act = {m: list(activation[m]) for m in stages}
    elif measured:
        act = {m: per_stage(m, s, 2, 1.0 / MIB) for m, s in stages.items()}
    else:
        act = {m: [1.0] * s for m, s in stages.items()}
    return fused_problem(
        stage_groups=stage_groups,
        micro_batches=micro_batches,
        actor_stages=actor_stages,
        critic_stages=critic_stages,
        actor_times=(
            per_stage("actor", actor_stages, 0, 1e3),
            per_stage("actor", actor_stages, 1, 1e3),
        ),
        critic_times=(
            per_stage("critic", critic_stages, 0, 1e3),
            per_stage("critic", critic_stages, 1, 1e3),
        ),
        actor_activation=act["actor"],
        critic_activation=act["critic"],
        actor_size=(sizes or {}).get("actor"),
        critic_size=(sizes or {}).get("critic"),
    )
