"""Executes one rank's instruction stream: compute in stream order, tensors over PipelineComm.

The engine never reorders compute: it walks the stream the planner lowered. Receives were
posted ahead by :meth:`PipelineComm.post_receives`, so a ``RECV`` instruction normally finds
its tensor already there. What a forward or backward *does* is up to a :class:`StageRunner`:
:class:`TrainStageRunner` runs a real partitioned model with autograd and the PPO loss at the
last stage, :class:`EmulatedStageRunner` sleeps the planned time (benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..schedule import Action
from .comm import PipelineComm, Transfer
from .errors import PipelineError, format_stream_grid
from .partition import PipelineStage
from .plan import PipelinePlan, Resident
from .tied import TiedGradient, sum_in_device_order

LossFn = Callable[[Tensor, Mapping[str, Tensor]], "tuple[Tensor, Mapping[str, Tensor]]"]


class StageRunner(Protocol):
    """What forward and backward of one model stage mean on this rank."""

    def begin_step(self, loss_denominator: float) -> None: ...

    def forward(
        self, key: tuple[int, int], inp: Tensor | None, mb: Mapping[str, Tensor] | None
    ) -> Tensor | None:
        """Run the forward of micro-batch ``key = (copy, micro_batch)``; return what to send on
        (``None`` at the last stage, where the loss is kept for the backward)."""
        ...

    def backward(self, key: tuple[int, int], grad: Tensor | None) -> Tensor | None:
        """Run the backward; return the gradient with respect to the stage input (or None)."""
        ...

    def step_stats(self) -> dict[str, float]: ...

    # Optional: ``output_meta(key, inp, mb)`` and ``grad_meta(key)`` return the (shape, dtype)
    # of the tensor a forward / backward will send, or None. When present, the engine
    # announces the shape before computing, hiding the header round trip behind compute.


def scale_loss(loss: Tensor, denominator: float) -> Tensor:
    """The one place a micro-batch loss is normalised; the single-device reference uses it too,
    so the pipelined and unpipelined gradients are computed with the same floating-point op."""
    return loss / denominator


class TrainStageRunner:
    """A real partitioned model stage; at the last stage ``loss_fn(output, micro_batch)``."""

    def __init__(self, stage: PipelineStage, loss_fn: LossFn | None = None, device=None):  # noqa: ANN001
        if stage.is_last and loss_fn is None:
            raise ValueError(f"{stage.role}: the last stage needs a loss_fn")
        self.stage = stage
        self.loss_fn = loss_fn
        self.device = device
        self._saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self._denominator = 1.0
        self._stats: dict[str, Tensor] = {}
        weight = stage.tied_weight()
        # This stage's part of a weight tied to another stage, per micro-batch (see .tied).
        self.tied = TiedGradient(weight) if weight is not None else None

    def begin_step(self, loss_denominator: float) -> None:
        if self._saved:
            raise RuntimeError(
                f"{self.stage.role} stage {self.stage.stage}: micro-batches "
                f"{sorted(self._saved)} ran forward but never backward in the previous step"
            )
        self._denominator = float(loss_denominator)
        self._stats = {}

    def forward(self, key, inp, mb):  # noqa: ANN001, ANN201
        assert mb is not None
        if inp is not None:
            inp.requires_grad_(True)
        with torch.enable_grad():
            out = self.stage(inp, mb)
            if not self.stage.is_last:
                self._saved[key] = (inp, out)
                return out.detach()
            assert self.loss_fn is not None
            loss, stats = self.loss_fn(out, mb)
            scaled = scale_loss(loss, self._denominator)
        self._saved[key] = (inp, scaled)
        with torch.no_grad():
            self._accumulate("loss", scale_loss(loss.detach(), self._denominator))
            for name, value in stats.items():
                self._accumulate(name, scale_loss(value.detach(), self._denominator))
        return None

    def output_meta(self, key, inp, mb):  # noqa: ANN001, ANN201
        """Shape/dtype of the hidden state a non-last stage sends (known before computing)."""
        if self.stage.is_last or mb is None or torch.is_autocast_enabled():
            return None
        rows, seq = mb["input_ids"].shape
        if inp is not None:
            dtype = inp.dtype
        else:
            param = next(self.stage.parameters(), None)
            dtype = param.dtype if param is not None else torch.get_default_dtype()
        return (rows, seq, int(self.stage.module.config.hidden_size)), dtype

    def grad_meta(self, key):  # noqa: ANN001, ANN201
        """The gradient sent upstream has the shape and dtype of the received input."""
        inp = self._saved[key][0]
        return None if inp is None else (tuple(inp.shape), inp.dtype)

    def _accumulate(self, name: str, value: Tensor) -> None:
        prev = self._stats.get(name)
        self._stats[name] = value.double() if prev is None else prev + value.double()

    def backward(self, key, grad):  # noqa: ANN001, ANN201
        inp, out = self._saved.pop(key)
        if self.tied is not None:
            self.tied.key = key
        try:
            if grad is None:
                out.backward()
            else:
                torch.autograd.backward(out, grad)
        finally:
            if self.tied is not None:
                self.tied.key = None
        return None if inp is None else inp.grad

    def step_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._stats.items()}


class EmulatedStageRunner:
    """Sleeps the planned forward/backward time and passes small real tensors on (benchmarks:
    measures the runtime's scheduling and communication against the planner's prediction
    without being limited by the CPU cores the processes share)."""

    def __init__(
        self,
        forward_s: float,
        backward_s: float,
        *,
        is_first: bool,
        is_last: bool,
        shape: tuple[int, ...] = (4, 16, 8),
    ):
        self.forward_s, self.backward_s = forward_s, backward_s
        self.is_first, self.is_last = is_first, is_last
        self.shape = shape

    def begin_step(self, loss_denominator: float) -> None:
        return None

    @staticmethod
    def _sleep(seconds: float) -> None:
        # sleep() wakes late by 0.05-0.5 ms depending on load, which would add up over a
        # step; sleep most of the time and spin only the last 0.3 ms (spinning longer would
        # take CPU from the other ranks' communication threads).
        end = time.perf_counter() + seconds
        if seconds > 0.0003:
            time.sleep(seconds - 0.0003)
        while time.perf_counter() < end:
            pass

    def output_meta(self, key, inp, mb):  # noqa: ANN001, ANN201
        return None if self.is_last else (self.shape, torch.float32)

    def grad_meta(self, key):  # noqa: ANN001, ANN201
        return None if self.is_first else (self.shape, torch.float32)

    def forward(self, key, inp, mb):  # noqa: ANN001, ANN201
        self._sleep(self.forward_s)
        return None if self.is_last else torch.zeros(self.shape)

    def backward(self, key, grad):  # noqa: ANN001, ANN201
        self._sleep(self.backward_s)
        return None if self.is_first else torch.zeros(self.shape)

    def step_stats(self) -> dict[str, float]:
        return {}


@dataclass
class StepTrace:
    """Wall-clock record of one step on one rank (compute actions and receive waits)."""

    start: float = 0.0
    end: float = 0.0
    events: list[tuple[str, float, float]] = field(default_factory=list)


class PipelineEngine:
    """Runs this rank's part of a :class:`PipelinePlan` step by step."""

    def __init__(
        self,
        plan: PipelinePlan,
        comm: PipelineComm,
        runners: Mapping[str, StageRunner],
        *,
        stream: Sequence[Action] | None = None,
        trace: bool = False,
        announce: bool = True,
        model_barrier: bool = False,
    ):
        self.plan = plan
        # Serial 1F1B (RLHFuse-Base): one model's step completes on every rank before the next
        # model starts, rather than each rank moving on as soon as its own part is done.
        self.model_barrier = model_barrier
        # Send shape headers before computing (when the runner can tell the shape).
        self.announce = announce
        self.comm = comm
        self.rank = comm.rank
        self.residents: dict[str, Resident] = plan.residents(self.rank)
        missing = set(self.residents) - set(runners)
        if missing:
            raise ValueError(f"{comm.where()} hosts {sorted(missing)} but got no runner for it")
        self.runners = dict(runners)
        self.stream = list(stream) if stream is not None else plan.stream(self.rank)
        self.trace_enabled = trace
        self.last_trace: StepTrace | None = None

    def run(
        self,
        micro_batches: Sequence[Mapping[str, Tensor]] | None,
        *,
        loss_denominator: float | None = None,
        stream: Sequence[Action] | None = None,
    ) -> StepTrace | None:
        """Execute the stream once: every forward and backward of one optimizer step.

        ``micro_batches`` are this replica's ``plan.micro_batches`` micro-batches (copy ``j`` of
        a model with ``M`` micro-batches per copy takes ``j*M .. j*M+M-1``). Gradients
        accumulate in the stage parameters' ``.grad``; call :meth:`sync_gradients` next.
        ``loss_denominator`` divides every micro-batch loss (default: all micro-batches of all
        replicas, so summed gradients equal the gradient of the mean loss).
        """
        stream = self.stream if stream is None else list(stream)
        if micro_batches is not None and len(micro_batches) != self.plan.micro_batches:
            raise ValueError(
                f"{self.comm.where()}: got {len(micro_batches)} micro-batches, the schedule "
                f"processes {self.plan.micro_batches} per replica"
            )
        denom = loss_denominator or float(self.plan.micro_batches * self.plan.replicas)
        for r in self.runners.values():
            r.begin_step(denom)
            tied = getattr(r, "tied", None)
            if tied is not None and micro_batches is not None:
                tied.track(micro_batches)
        tr = StepTrace(start=time.perf_counter()) if self.trace_enabled else None
        self.comm.post_receives(stream)
        inbox: dict[tuple[str, str, int, int], Tensor] = {}
        outbox: dict[tuple[str, str, int, int], Tensor] = {}
        i = 0
        current = None
        try:
            for i, a in enumerate(stream):
                if self.model_barrier and current is not None and a.model != current:
                    self.comm.flush_sends()
                    self.comm.barrier("between the models of serial 1F1B")
                current = a.model
                key = (a.model, a.copy, a.micro_batch)
                if a.op == "RECV_F" or a.op == "RECV_B":
                    t0 = time.perf_counter()
                    inbox[(a.op[-1], *key)] = self.comm.recv(a)
                    if tr is not None:
                        tr.events.append((str(a), t0, time.perf_counter()))
                elif a.op == "F" or a.op == "B":
                    t0 = time.perf_counter()
                    runner = self.runners[a.model]
                    nxt = stream[i + 1] if i + 1 < len(stream) else None
                    announce = (
                        self.announce
                        and nxt is not None
                        and nxt.op == "SEND_" + a.op
                        and (nxt.model, nxt.copy, nxt.micro_batch) == key
                    )
                    if a.op == "F":
                        mb = None
                        if micro_batches is not None:
                            mb = micro_batches[
                                self.plan.global_micro_batch(a.model, a.copy, a.micro_batch)
                            ]
                        inp = inbox.pop(("F", *key), None)
                        meta_fn = getattr(runner, "output_meta", None)
                        meta = (
                            meta_fn((a.copy, a.micro_batch), inp, mb)
                            if announce and meta_fn
                            else None
                        )
                        if meta is not None:
                            self.comm.send_header(nxt, *meta)  # type: ignore[arg-type]
                        out = runner.forward((a.copy, a.micro_batch), inp, mb)
                        if out is not None:
                            outbox[("F", *key)] = out
                    else:
                        meta_fn = getattr(runner, "grad_meta", None)
                        meta = meta_fn((a.copy, a.micro_batch)) if announce and meta_fn else None
                        if meta is not None:
                            self.comm.send_header(nxt, *meta)  # type: ignore[arg-type]
                        grad = inbox.pop(("B", *key), None)
                        gin = runner.backward((a.copy, a.micro_batch), grad)
                        if gin is not None and a.stage > 0:
                            outbox[("B", *key)] = gin
                    if tr is not None:
                        tr.events.append((str(a), t0, time.perf_counter()))
                else:  # SEND_F / SEND_B
                    tensor = outbox.pop((a.op[-1], *key), None)
                    if tensor is None:
                        raise RuntimeError(f"{self.comm.where()}: {a} has nothing to send")
                    self.comm.send(tensor, a)
            i = len(stream)  # past the last instruction: finishing the sends
            self.comm.flush_sends()
        except Exception as exc:
            self._locate(exc, stream, i)
            raise
        if inbox or outbox:
            raise RuntimeError(
                f"{self.comm.where()}: stream left tensors unused: {sorted(inbox) + sorted(outbox)}"
            )
        if tr is not None:
            tr.end = time.perf_counter()
            self.last_trace = tr
        return tr

    def _locate(self, exc: Exception, stream: Sequence[Action], step: int) -> None:
        """Add the instruction streams around the failing instruction to ``exc``.

        A :class:`PipelineError` gets the grid appended to its message (its first line, naming
        the rank and what it waited for, is kept); any other exception gets it as a note, shown
        in its traceback. The failing instruction is the one whose wait failed: the ``SEND``
        of a send that did not complete, which may be earlier than the instruction the rank had
        reached (``step``).
        """
        failed = step
        transfer = getattr(exc, "transfer", None)
        if transfer is not None:
            here = stream[step] if step < len(stream) else None
            if here is None or here.is_compute or Transfer.of(here) != transfer:
                failed = next(
                    (
                        j
                        for j, a in enumerate(stream)
                        if a.op.startswith("SEND") and Transfer.of(a) == transfer
                    ),
                    step,
                )
        replica, _ = self.plan.coords(self.rank)
        streams: dict[int, Sequence[Action]] = {
            r: self.plan.stream(r)
            for r in (self.plan.rank_of(replica, g) for g in range(self.plan.stage_groups))
        }
        streams[self.rank] = stream  # the stream actually run (a test may pass its own)
        what = str(stream[failed]) if failed < len(stream) else "after its last instruction"
        title = (
            f"rank {self.rank} failed at step {failed} of its instruction stream ({what})"
            + (
                ""
                if failed == step
                else f", having reached step {step}"
                if step < len(stream)
                else ", while finishing its sends after the last step"
            )
            + f"; the streams of replica {replica} around it (>x< marks the failing spot):"
        )
        grid = f"{title}\n{format_stream_grid(streams, self.rank, failed)}"
        if isinstance(exc, PipelineError):
            exc.add_schedule(grid)
        elif hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(grid)

    # -- after the stream: gradients, norms, stats ------------------------------------------------
    def _stage(self, model: str) -> PipelineStage | None:
        runner = self.runners[model]
        return getattr(runner, "stage", None)

    def sync_gradients(self) -> None:
        """Sum gradients over every holder of the same stage (copies x replicas), and the
        tied embedding/LM-head gradient over the first and last stages.

        Groups are visited in one global order (model, then its stage group, then its tied
        group) so ranks never wait on each other in a cycle.
        """
        for name, res in self.residents.items():
            stage = self._stage(name)
            if stage is None:
                continue
            tied = stage.tied_weight()
            group = self.comm.stage_groups[(name, res.stage)]
            if group is not None:
                grads = [p.grad for p in stage.parameters() if p.grad is not None and p is not tied]
                if grads:
                    flat = _flatten_dense_tensors(grads)
                    self.comm.all_reduce(
                        flat, group, f"all-reducing {name} stage {res.stage} gradients"
                    )
                    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                        g.copy_(synced)
            tgroup = self.comm.tied_groups[name]
            if tied is None or tgroup is None:
                continue  # untied (the tied group exists all the same), or a middle stage
            record = getattr(self.runners[name], "tied", None)
            if record is not None and record.rows is not None and self._one_pipeline(name):
                sum_in_device_order(
                    record, is_last=stage.is_last, comm=self.comm, group=tgroup, what=name
                )
                continue
            # Several pipelines: summed like every gradient held by several ranks.
            if record is not None:
                record.done()
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            self.comm.all_reduce(
                tied.grad, tgroup, f"all-reducing the tied {name} embedding gradient"
            )

    def _one_pipeline(self, name: str) -> bool:
        """Whether one pipeline holds ``name`` (no data-parallel replicas or copies of it)."""
        return len(self.plan.stage_ranks(self.plan.model_names.index(name), 0)) == 1

    def _norm_params(self, name: str) -> list[nn.Parameter]:
        """Parameters of this rank's stage that count toward the model's global norm."""
        stage = self._stage(name)
        if stage is None or not self.plan.is_canonical(self.rank, name):
            return []
        tied = stage.tied_weight()
        skip = tied if tied is not None and not stage.is_first else None
        return [p for p in stage.parameters() if p.grad is not None and p is not skip]

    def grad_norms(self) -> dict[str, float]:
        """Global L2 gradient norm of every model (one all-reduce over the world)."""
        names = self.plan.model_names
        local = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in self.residents:
                local[i] = grad_norm_sq(self._norm_params(name))
        self.comm.all_reduce(local, self.comm.world_group, "all-reducing gradient norms")
        return {name: float(local[i].sqrt()) for i, name in enumerate(names)}

    def clip_gradients(self, max_norms: Mapping[str, float | None]) -> dict[str, float]:
        """Clip each model's gradients to its max norm (like ``clip_grad_norm_``); returns the
        norms before clipping."""
        norms = self.grad_norms()
        for name in self.residents:
            max_norm = max_norms.get(name)
            stage = self._stage(name)
            if max_norm is None or stage is None:
                continue
            grads = [p.grad for p in stage.parameters() if p.grad is not None]
            clip_grads_(grads, norms[name], max_norm)
        return norms

    def reduced_stats(self) -> dict[str, dict[str, float]]:
        """Loss statistics summed over the last-stage ranks: the mean over all micro-batches."""
        local: dict[str, dict[str, float]] = {}
        for name, runner in self.runners.items():
            res = self.residents.get(name)
            if res is not None and res.stage == res.num_stages - 1:
                local[name] = runner.step_stats()
        gathered = self.comm.all_gather_object(local, "gathering loss statistics")
        out: dict[str, dict[str, float]] = {}
        for part in gathered:
            for name, stats in part.items():  # type: ignore[union-attr]
                dst = out.setdefault(name, {})
                for k, v in stats.items():
                    dst[k] = dst.get(k, 0.0) + v
        return out

    def close(self) -> None:
        self.comm.close()


def grad_norm_sq(params: Iterable[nn.Parameter]) -> Tensor:
    """Sum of squared per-parameter gradient norms, accumulated in float64 in parameter order, on
    the gradients' device; returned on the CPU (gloo reduces it there). A 0-dim tensor."""
    total: Tensor | None = None
    for p in params:
        if p.grad is not None:
            sq = torch.linalg.vector_norm(p.grad).double().square()
            total = sq if total is None else total + sq.to(total.device)
    return torch.zeros((), dtype=torch.float64) if total is None else total.cpu()


def clip_grads_(grads: Sequence[Tensor], total_norm: float, max_norm: float) -> None:
    """Scale gradients by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's clip rule)."""
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Single-process counterpart of :meth:`PipelineEngine.clip_gradients` (the reference)."""
    params = [p for p in params if p.grad is not None]
    norm = float(grad_norm_sq(params).sqrt())
    if max_norm is not None:
        clip_grads_([p.grad for p in params], norm, max_norm)  # type: ignore[misc]
    return norm
