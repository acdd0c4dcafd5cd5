"""Host offload of a frozen model between its calls, with an asynchronous prefetch.

The Ref and the Reward are frozen: in a PPO iteration they run only while the batch is scored,
yet resident they hold their weights on the device through generation and training, where the
KV cache and the optimizer state want that memory. :class:`HostOffload` keeps such a model in
host memory between its calls and brings it back early enough that the copy hides behind
earlier work (the estimator's ``prefetch_s``, :mod:`rlhf_fusion.placement.timeline`):

* :meth:`HostOffload.offload` packs every parameter and buffer into one host buffer per dtype
  (pinned when the device is CUDA, so copies from it are asynchronous), once: the model is
  frozen, so later offloads only drop the device storage. The module keeps its Parameter
  objects (tied weights stay tied) with empty data.
* :meth:`HostOffload.prefetch` starts the copy back: on CUDA, ``non_blocking`` copies on a
  side stream, recording an event, so the copy overlaps whatever the compute stream is doing;
  elsewhere, a plain copy (deterministic, nothing to overlap with on a CPU).
* :meth:`HostOffload.wait` makes the compute stream wait for that event and points the
  module's tensors at the copied weights. The module's first call does it by itself (a forward
  pre-hook): the wait lands just before the first call, on whatever stream runs it. Calling
  the module while offloaded, with no prefetch, raises :class:`OffloadedModelError`.

``with offloaded:`` around calls prefetches (if needed), waits, and offloads on exit.
Restored weights are bit-identical to the originals (a copy, no cast); they come back
contiguous, as views of one device buffer per dtype (one copy per dtype, one allocation).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import RLHFFusionError

RESIDENT, OFFLOADED, PREFETCHING = "resident", "offloaded", "prefetching"


class OffloadedModelError(RLHFFusionError, RuntimeError):
    """A host-offloaded model was called before its weights were brought back."""


@dataclass
class OffloadStats:
    """What moved since the last :meth:`HostOffload.take_stats` (bytes both ways)."""

    bytes: int = 0
    prefetch_s: float = 0.0   # copy time host -> device (CUDA: measured on the side stream)
    wait_s: float = 0.0       # host time spent in wait() (the copy's exposed part on CPU: 0)
    offload_s: float = 0.0    # host time spent in offload() (a copy the first time only)

    def add(self, other: OffloadStats) -> None:
        self.bytes += other.bytes
        self.prefetch_s += other.prefetch_s
        self.wait_s += other.wait_s
        self.offload_s += other.offload_s


@dataclass(frozen=True)
class _Slot:
    tensor: Tensor          # the module's own Parameter or buffer object (kept, data swapped)
    offset: int             # in its dtype's packed buffer
    shape: torch.Size


class HostOffload:
    """One frozen module on ``device`` that lives in host memory between its calls.

    ``module``'s parameters and buffers must be on ``device``. The module must not be trained
    or loaded into while this object owns it: the host copy is taken at the first
    :meth:`offload` and is what every :meth:`prefetch` brings back.
    """

    def __init__(self, module: nn.Module, device: torch.device | str, *,
                 name: str = "model") -> None:
        self.module = module
        self.name = name
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors always carry an index ("cuda:0"), so a bare "cuda" would never match them.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self.device.type == "cuda"
        slots: dict[torch.dtype, list[_Slot]] = {}
        sizes: dict[torch.dtype, int] = {}
        seen: set[int] = set()
        # Each tensor once: a tied parameter is one object under two names.
        for tname, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.device != self.device:
                raise ValueError(f"{name}: {tname} is on {t.device}, not {self.device}; move "
                                 f"the module to {self.device} before handing it to HostOffload")
            off = sizes.get(t.dtype, 0)
            slots.setdefault(t.dtype, []).append(_Slot(t, off, t.shape))
            sizes[t.dtype] = off + t.numel()
        self._slots = slots
        self._sizes = sizes
        self.nbytes = sum(n * torch.empty(0, dtype=d).element_size() for d, n in sizes.items())
        self._host: dict[torch.dtype, Tensor] = {}     # allocated once, at the first offload
        self._incoming: dict[torch.dtype, Tensor] = {}  # device buffers of the prefetch
        self._stream: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._events: list[tuple[Any, Any]] = []       # CUDA (start, done) not yet timed
        self._done: Any = None                         # CUDA: the latest prefetch's event
        self._stats = OffloadStats()
        self.state = RESIDENT
        self._hook = module.register_forward_pre_hook(self._before_call)

    # -- the three steps ---------------------------------------------------------------------
    def offload(self) -> None:
        """Free the module's device storage; the weights stay in the host buffers."""
        if self.state == OFFLOADED:
            return
        if self.state == PREFETCHING:
            self.wait()   # never drop a buffer a copy may still be writing
        t0 = time.perf_counter()
        if not self._host:
            for dtype, n in self._sizes.items():
                host = torch.empty(n, dtype=dtype, pin_memory=self._cuda)
                for s in self._slots[dtype]:
                    # A synchronous copy: the device storage is dropped right after.
                    piece = host[s.offset: s.offset + s.tensor.numel()]
                    piece.copy_(s.tensor.detach().reshape(-1))
                self._host[dtype] = host
            self._stats.bytes += self.nbytes
        for dtype, slots in self._slots.items():
            for s in slots:
                s.tensor.data = torch.empty(0, dtype=dtype, device=self.device)
        self._incoming = {}
        self.state = OFFLOADED
        self._stats.offload_s += time.perf_counter() - t0

    def prefetch(self) -> None:
        """Start copying the weights back; :meth:`wait` (or the first call) completes it."""
        if self.state != OFFLOADED:
            return   # resident, or already on its way
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            # Buffers allocated on the side stream and filled there: the compute stream never
            # waits for the copy until wait(); the host buffers are pinned and never rewritten.
            with torch.cuda.stream(self._stream):
                start.record()
                for dtype, host in self._host.items():
                    buf = torch.empty(host.numel(), dtype=dtype, device=self.device)
                    buf.copy_(host, non_blocking=True)
                    self._incoming[dtype] = buf
                done.record()
            self._events.append((start, done))
            self._done = done
        else:
            t0 = time.perf_counter()
            self._incoming = {dtype: host.clone() if self.device.type == "cpu"
                              else host.to(self.device) for dtype, host in self._host.items()}
            self._stats.prefetch_s += time.perf_counter() - t0
        self._stats.bytes += self.nbytes
        self.state = PREFETCHING

    def wait(self) -> None:
        """Make the current (compute) stream wait for the prefetch; the module is usable."""
        if self.state == RESIDENT:
            return
        if self.state == OFFLOADED:
            raise OffloadedModelError(self._not_prefetched())
        t0 = time.perf_counter()
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self._done)
            for buf in self._incoming.values():
                # Freed at the next offload: not reused before the compute stream is done.
                buf.record_stream(compute)
        for dtype, slots in self._slots.items():
            buf = self._incoming[dtype]
            for s in slots:
                s.tensor.data = buf[s.offset: s.offset + s.shape.numel()].view(s.shape)
        self.state = RESIDENT
        self._stats.wait_s += time.perf_counter() - t0

    def __enter__(self) -> nn.Module:
        self.prefetch()
        self.wait()
        return self.module

    def __exit__(self, *exc: object) -> None:
        self.offload()

    # -- reporting -----------------------------------------------------------------------------
    def take_stats(self) -> OffloadStats:
        """Bytes and seconds since the last call (CUDA copy times once their copies ended)."""
        pending = []
        for start, done in self._events:
            if done.query():
                self._stats.prefetch_s += start.elapsed_time(done) / 1e3
            else:
                pending.append((start, done))
        self._events = pending
        out, self._stats = self._stats, OffloadStats()
        return out

    def device_elements(self) -> int:
        """Elements the module's parameters and buffers hold now (0 while offloaded)."""
        return sum(s.tensor.numel() for slots in self._slots.values() for s in slots)

    def close(self) -> None:
        """Bring the weights back for good and remove the call check."""
        self.prefetch()
        self.wait()
        self._hook.remove()

    # -- internals -----------------------------------------------------------------------------
    def _before_call(self, module: nn.Module, args: Any) -> None:
        if self.state == OFFLOADED:
            raise OffloadedModelError(self._not_prefetched())
        if self.state == PREFETCHING:
            self.wait()

    def _not_prefetched(self) -> str:
        return (f"{self.name} is offloaded to host memory and was called (or waited on) "
                "without a prefetch: call prefetch() before its calls (the first call waits "
                "for the copy), or run the calls inside `with offload:`")


class OffloadSet:
    """The frozen models of one rank that are offloaded, moved together; may be empty."""

    def __init__(self, offloads: Mapping[str, HostOffload]) -> None:
        self.offloads = dict(offloads)

    def offload(self) -> None:
        for o in self.offloads.values():
            o.offload()

    def prefetch(self) -> None:
        for o in self.offloads.values():
            o.prefetch()

    def take_stats(self) -> OffloadStats:
        total = OffloadStats()
        for o in self.offloads.values():
            total.add(o.take_stats())
        return total

    def __iter__(self) -> Iterator[HostOffload]:
        return iter(self.offloads.values())
