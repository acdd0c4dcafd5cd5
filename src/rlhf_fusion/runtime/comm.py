"""Point-to-point and collective communication for the fused pipeline.

* One process group per (model, direction): activations (``F``) and gradients (``B``) of each
  model travel on their own communicator, so traffic flowing in opposite directions between
  the same two ranks can never block behind each other in one FIFO.
* Every tensor is preceded by a fixed-size int64 header (micro-batch, dtype, shape), so
  micro-batches of different sequence lengths need no agreement on shapes beforehand; the
  receiver also checks that the micro-batch it got is the one its stream expects.
* Receives are posted early: one background thread per incoming channel posts the next
  expected receive as soon as the previous one landed, so a sender never waits for the
  receiver to reach the matching instruction. The main thread only picks results up.
* Every wait has a deadline. A wait that passes it raises :class:`PipelineTimeoutError` naming
  the rank, model, copy, stage and micro-batch; a transport failure (a dead peer closes its
  sockets) raises :class:`PeerError` with the same details. Both carry the :class:`Transfer`
  they waited for (``exc.transfer``), so :class:`PipelineEngine` can mark the instruction in
  the step x rank grid it appends to the message.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..schedule import Action
from .errors import PeerError, PipelineError, PipelineTimeoutError
from .plan import PipelinePlan

_MAGIC = 0x52465553  # "RFUS": catches a payload read as a header
_MAX_DIMS = 8
HEADER_LEN = 4 + _MAX_DIMS
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
# Receiver threads wait on the transport this long; the caller-facing deadline is enforced by
# the main thread, because a receive is posted long before the stream needs it.
_TRANSPORT_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class Transfer:
    """One tensor moved between two stages of one model copy."""

    model: str
    kind: str  # "F": activation, stage src_stage -> src_stage+1; "B": its gradient, backwards
    copy: int
    micro_batch: int
    src_stage: int

    @classmethod
    def of(cls, a: Action) -> Transfer:
        if a.op == "SEND_F" or a.op == "SEND_B":
            return cls(a.model, a.op[-1], a.copy, a.micro_batch, a.stage)
        if a.op == "RECV_F":
            return cls(a.model, "F", a.copy, a.micro_batch, a.stage - 1)
        if a.op == "RECV_B":
            return cls(a.model, "B", a.copy, a.micro_batch, a.stage + 1)
        raise ValueError(f"{a} moves no tensor")

    def describe(self) -> str:
        if self.kind == "F":
            return (
                f"{self.model} copy {self.copy} stage {self.src_stage + 1} input activation of "
                f"micro-batch {self.micro_batch} (from stage {self.src_stage})"
            )
        return (
            f"{self.model} copy {self.copy} stage {self.src_stage - 1} output gradient of "
            f"micro-batch {self.micro_batch} (from stage {self.src_stage})"
        )


def make_header(tensor: Tensor, micro_batch: int) -> Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {tensor.dim()}-d tensor (at most {_MAX_DIMS} dims)")
    try:
        code = _DTYPES.index(tensor.dtype)
    except ValueError:
        raise ValueError(f"cannot send dtype {tensor.dtype}") from None
    dims = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_MAGIC, micro_batch, code, tensor.dim(), *dims], dtype=torch.int64)


def parse_header(header: Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    h = header.tolist()
    if h[0] != _MAGIC or not 0 <= h[2] < len(_DTYPES) or not 0 <= h[3] <= _MAX_DIMS:
        raise PeerError(f"corrupt tensor header {h}: sender and receiver streams are out of step")
    return h[1], _DTYPES[h[2]], tuple(h[4 : 4 + h[3]])


class _Receiver:
    """Background receives for one channel (model, direction, source rank), in stream order."""

    def __init__(self, comm: PipelineComm, group, src: int, name: str):  # noqa: ANN001
        self.comm = comm
        self.group = group
        self.src = src
        self.jobs: queue.Queue[Transfer | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _recv(self, tensor: Tensor) -> None:
        work = dist.irecv(tensor, src=self.src, group=self.group)
        work.wait(_TRANSPORT_TIMEOUT)

    def _run(self) -> None:
        dev = self.comm.device
        if dev.type == "cuda":
            # The current CUDA device is per thread; NCCL must see this rank's device.
            torch.cuda.set_device(dev)
        while True:
            t = self.jobs.get()
            if t is None:
                return
            result: Tensor | BaseException
            try:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=dev)
                self._recv(header)
                mb, dtype, shape = parse_header(header.cpu())
                if mb != t.micro_batch:
                    raise PeerError(
                        f"expected {t.describe()} but rank {self.src} sent micro-batch {mb}: "
                        "the two ranks run instruction streams that do not match"
                    )
                result = torch.empty(shape, dtype=dtype, device=dev)
                self._recv(result)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                result = exc
            self.comm._deliver(t, result)
            if isinstance(result, BaseException):
                return


class PipelineComm:
    """Process groups and transport of one rank of a :class:`PipelinePlan`.

    Every rank must construct it (group creation is collective) with the same plan.
    """

    def __init__(
        self,
        plan: PipelinePlan,
        rank: int | None = None,
        *,
        timeout: float = 300.0,
        device: torch.device | str = "cpu",
        max_pending_sends: int = 16,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call init_process_group first"
            )
        self.plan = plan
        self.rank = dist.get_rank() if rank is None else rank
        if dist.get_world_size() != plan.world_size:
            raise RuntimeError(
                f"the plan needs {plan.world_size} processes ({plan.replicas} replicas x "
                f"{plan.stage_groups} stage groups) but the world has {dist.get_world_size()}"
            )
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.replica, self.group_idx = plan.coords(self.rank)
        self.max_pending_sends = max_pending_sends
        td = timedelta(seconds=self.timeout)
        world = list(range(plan.world_size))
        # Group creation is collective over the default group: every rank creates every group,
        # in this fixed order, including groups it is not a member of.
        self.p2p: dict[tuple[str, str], object] = {}
        for name in plan.model_names:
            for kind in ("F", "B"):
                self.p2p[(name, kind)] = dist.new_group(world, timeout=_TRANSPORT_TIMEOUT)
        self.stage_groups: dict[tuple[str, int], object | None] = {}
        self.tied_groups: dict[str, object | None] = {}
        for mi, m in enumerate(plan.problem.models):
            for s in range(m.pipeline_stages):
                ranks = plan.stage_ranks(mi, s)
                self.stage_groups[(m.name, s)] = (
                    dist.new_group(ranks, timeout=td) if len(ranks) > 1 else None
                )
            tied = plan.tied_ranks(mi)
            self.tied_groups[m.name] = (
                dist.new_group(tied, timeout=td) if m.pipeline_stages > 1 else None
            )
        self.world_group = dist.new_group(world, timeout=td)
        self._cond = threading.Condition()
        self._arrived: dict[Transfer, Tensor | BaseException] = {}
        self._receivers: dict[tuple[str, str, int], _Receiver] = {}
        self._sends: deque[tuple[Transfer, int, list, tuple[Tensor, ...]]] = deque()
        self._announced: dict[Transfer, tuple[tuple[int, ...], torch.dtype]] = {}
        self._closed = False

    # -- naming ----------------------------------------------------------------------------------
    def where(self) -> str:
        return f"rank {self.rank} (replica {self.replica}, stage group {self.group_idx})"

    # -- point to point ----------------------------------------------------------------------------
    def post_receives(self, stream: Sequence[Action]) -> None:
        """Hand every receive of ``stream`` to its channel's thread, in stream order."""
        for a in stream:
            if a.op not in ("RECV_F", "RECV_B"):
                continue
            t = Transfer.of(a)
            src = self.plan.peer_rank(self.rank, a.peer)  # type: ignore[arg-type]
            key = (t.model, t.kind, src)
            rcv = self._receivers.get(key)
            if rcv is None:
                rcv = _Receiver(
                    self, self.p2p[(t.model, t.kind)], src, f"recv-{t.model}-{t.kind}-from{src}"
                )
                self._receivers[key] = rcv
            rcv.jobs.put(t)

    def _deliver(self, t: Transfer, result: Tensor | BaseException) -> None:
        with self._cond:
            self._arrived[t] = result
            self._cond.notify_all()

    def recv(self, a: Action) -> Tensor:
        """The tensor a posted RECV action brought; waits at most ``timeout`` seconds."""
        t = Transfer.of(a)
        src = self.plan.peer_rank(self.rank, a.peer)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while t not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    err = PipelineTimeoutError(
                        f"{self.where()} timed out after {self.timeout:g} s waiting for "
                        f"{t.describe()} from rank {src}; that rank stalled or died"
                    )
                    err.transfer = t
                    raise err
                self._cond.wait(left)
            result = self._arrived.pop(t)
        if isinstance(result, BaseException):
            if isinstance(result, PeerError):
                err = PeerError(f"{self.where()}: {result}")
            else:
                err = PeerError(
                    f"{self.where()} lost the connection while receiving {t.describe()} from "
                    f"rank {src}: {result}"
                )
            err.transfer = t
            raise err from result
        return result

    def send(self, tensor: Tensor, a: Action) -> None:
        """Start sending ``tensor`` for a SEND action (asynchronous; see :meth:`flush_sends`).

        Sends the header first unless :meth:`send_header` already announced this transfer.
        """
        t = Transfer.of(a)
        pre = self._announced.pop(t, None)
        tensor = tensor.contiguous()
        if pre is None:
            self.send_header(a, tuple(tensor.shape), tensor.dtype)
            pre = self._announced.pop(t)
        if pre != (tuple(tensor.shape), tensor.dtype):
            raise PeerError(
                f"{self.where()}: announced {t.describe()} as {pre[1]} {list(pre[0])} but the "
                f"tensor is {tensor.dtype} {list(tensor.shape)}; the stage runner's "
                "output_meta is wrong"
            )
        dst = self.plan.peer_rank(self.rank, a.peer)  # type: ignore[arg-type]
        work = dist.isend(tensor, dst=dst, group=self.p2p[(t.model, t.kind)])
        self._push_send(t, dst, work, tensor)

    def send_header(self, a: Action, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Announce the shape of a tensor before it is computed.

        The receiver's thread then has its payload receive posted by the time the tensor is
        sent, which takes a round trip off the critical path. The tensor must follow with
        :meth:`send` and match exactly.
        """
        t = Transfer.of(a)
        dst = self.plan.peer_rank(self.rank, a.peer)  # type: ignore[arg-type]
        header = make_header(torch.empty(shape, dtype=dtype, device="meta"), t.micro_batch)
        header = header.to(self.device)
        work = dist.isend(header, dst=dst, group=self.p2p[(t.model, t.kind)])
        self._announced[t] = (tuple(shape), dtype)
        self._push_send(t, dst, work, header)

    def _push_send(self, t: Transfer, dst: int, work, keep: Tensor) -> None:  # noqa: ANN001
        self._sends.append((t, dst, [work], (keep,)))
        # Receivers post early, so old sends are normally done: reclaiming them bounds memory.
        while len(self._sends) > self.max_pending_sends:
            self._finish_send(self._sends.popleft())

    def _finish_send(self, item: tuple[Transfer, int, list, tuple[Tensor, ...]]) -> None:
        t, dst, works, _ = item
        try:
            for w in works:
                self._wait(w, f"sending {t.describe()} to rank {dst}")
        except PipelineError as exc:
            exc.transfer = t  # the engine marks this send, not the instruction it was at
            raise

    def flush_sends(self) -> None:
        while self._sends:
            self._finish_send(self._sends.popleft())

    # -- collectives -------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, what: str) -> PipelineError:
        msg = str(exc)
        if "imed out" in msg or "imeout" in msg:
            return PipelineTimeoutError(
                f"{self.where()} timed out after {self.timeout:g} s {what}; a peer stalled or died"
            )
        return PeerError(f"{self.where()} failed {what}: {msg}")

    def _wait(self, work, what: str) -> None:  # noqa: ANN001
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._fail(exc, what) from exc

    def all_reduce(self, tensor: Tensor, group, what: str) -> Tensor:  # noqa: ANN001
        if group is None:
            return tensor
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._wait(work, what)
        return tensor

    def all_gather_object(self, obj: object, what: str) -> list[object]:
        """All-gather over the whole world (small objects, e.g. profiled times or stats)."""
        out: list[object] = [None] * self.plan.world_size
        try:
            dist.all_gather_object(out, obj, group=self.world_group)
        except RuntimeError as exc:
            raise self._fail(exc, what) from exc
        return out

    def barrier(self, what: str = "at a barrier") -> None:
        self._wait(dist.barrier(group=self.world_group, async_op=True), what)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the receiver threads and destroy this rank's groups (symmetric with __init__)."""
        if self._closed:
            return
        self._closed = True
        for rcv in self._receivers.values():
            rcv.jobs.put(None)
        for rcv in self._receivers.values():
            rcv.thread.join(timeout=10.0)  # idle after a step: they exit at once
        self._receivers.clear()
        self._sends.clear()
        self._announced.clear()
        groups = list(self.p2p.values()) + list(self.stage_groups.values())
        groups += list(self.tied_groups.values()) + [self.world_group]
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                try:
                    dist.destroy_process_group(g)
                except (RuntimeError, ValueError):
                    pass
