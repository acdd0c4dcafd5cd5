"""Run a function on several local processes with torch.distributed set up.

The one process launcher of the project: the runtime's and the rollout's multi-process tests,
the benchmarks and the examples all spawn their gloo ranks through :func:`run_ranks`.

Unlike ``torch.multiprocessing.spawn`` this never hangs and never loses a rank's outcome:

* every rank reports a :class:`RankResult` (its return value, or its error and traceback);
* a rank that dies without reporting (killed, crashed, ``os._exit``) is reported as
  ``error_type="Died"`` with its exit code;
* the parent enforces an overall deadline (``timeout``) and terminates stragglers, reported as
  ``error_type="Deadline"``;
* ``collective_timeout`` is the process group's timeout, so every collective and
  point-to-point wait inside ``fn`` is bounded too;
* ``threads`` sets torch's intra-op threads per rank (small machines: keep it at 1).

So a fault-injection test can assert *how* each surviving rank failed.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0  # wall time of fn on that rank
    exitcode: int | None = None  # set when the process died without reporting


class DistributedRunError(RuntimeError):
    """Some rank failed; ``results`` holds every rank's :class:`RankResult`, in rank order."""

    def __init__(self, results: list[RankResult]):
        self.results = results
        bad = [r for r in results if not r.ok]
        detail = "\n".join(
            f"--- rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in bad
        )
        super().__init__(f"{len(bad)} of {len(results)} ranks failed:\n{detail}")

    @property
    def failed(self) -> dict[int, RankResult]:
        """The failed ranks' results by rank."""
        return {r.rank: r for r in self.results if not r.ok}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    collective_timeout: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    out: Any,
) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    t0 = time.perf_counter()
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world, *args)
        res = RankResult(rank, True, value, seconds=time.perf_counter() - t0)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        res = RankResult(
            rank,
            False,
            error_type=type(exc).__name__,
            error=str(exc),
            traceback=traceback.format_exc(),
            seconds=time.perf_counter() - t0,
        )
    try:
        payload = _dumps(res)
    except Exception as exc:  # noqa: BLE001
        payload = _dumps(RankResult(rank, False, error_type="PicklingError", error=str(exc)))
    out.put((rank, payload))
    out.close()
    out.join_thread()  # the queue's feeder thread must flush before os._exit below
    if res.ok:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # Skip interpreter teardown: a receiver thread still blocked in the transport after a
    # failure must not turn a clean report into a hang or a crash.
    os._exit(0 if res.ok else 1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    collective_timeout: float = 60.0,
    threads: int = 1,
    raise_on_error: bool = True,
    wait_for: Iterable[int] | None = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (module level). Returns one :class:`RankResult` per rank; ranks
    that did not report within ``timeout`` seconds are terminated and reported as
    ``error_type="Deadline"``; ranks that exited without reporting as ``error_type="Died"``
    (with ``exitcode``). ``collective_timeout`` bounds every collective and point-to-point wait
    inside ``fn`` (the process group's timeout); ``threads`` is torch's thread count per rank.
    With ``raise_on_error`` any failure raises
    :class:`DistributedRunError` carrying every rank's outcome. ``wait_for`` limits the ranks
    whose report is awaited (fault tests: do not wait for a rank that was told to stall).
    """
    needed = set(range(world_size) if wait_for is None else wait_for)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, collective_timeout, threads, fn, args, out),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, RankResult] = {}
    died: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    while not needed <= (set(results) | set(died)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, payload = out.get(timeout=min(left, 0.5))
        except queue.Empty:
            # The queue is drained: a process that is gone now never reported (killed,
            # crashed, or os._exit from inside fn).
            for r, p in enumerate(procs):
                if r not in results and r not in died and not p.is_alive():
                    died[r] = RankResult(
                        r,
                        False,
                        error_type="Died",
                        error=f"exit code {p.exitcode} without reporting",
                        exitcode=p.exitcode,
                    )
            continue
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        died.pop(rank, None)
    results = {**died, **results}
    for r, p in enumerate(procs):
        if r not in results:
            if r in needed:
                results[r] = RankResult(
                    r, False, error_type="Deadline", error=f"no report within {timeout:g} s"
                )
            else:
                results[r] = RankResult(
                    r, False, error_type="NotAwaited", error="not in wait_for; terminated"
                )
        p.join(timeout=5.0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
    ordered = [results[r] for r in range(world_size)]
    if raise_on_error and not all(r.ok for r in ordered):
        raise DistributedRunError(ordered)
    return ordered
