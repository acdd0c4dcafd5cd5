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
* once one rank has failed or died, the others get ``grace`` seconds to report their own error
  (they usually notice the dead peer at once) and are then stopped: a rank waiting on a dead
  peer outside any collective cannot hold the run. Each rank records what it is doing
  (:func:`note_stage`), so a rank that dies without reporting is named with its stage;
* ranks die with the launcher: ``PR_SET_PDEATHSIG`` on Linux, and a watchdog on the parent's
  pid everywhere, so a killed launcher leaves no rank behind (:func:`orphaned` lets a rank
  check before it writes anything lasting);
* an exception in the launcher while it waits (``KeyboardInterrupt``, or the
  :class:`RunInterrupted` of :func:`stop_gracefully_on_signals`) stops every rank (SIGKILL)
  before it propagates. Ranks ignore SIGINT: a Ctrl-C reaches them through the launcher, not
  as a traceback of their own; SIGTERM is a stop request to them (below).

So a fault-injection test can assert *how* each surviving rank failed.

Two more things for processes that run the loop:

* **joining a group started elsewhere**: :func:`group_from_env` reads the environment that
  ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or ``srun``
  (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST) gives each process, and
  :func:`join_group` joins that group instead of spawning ranks;
* **a stop at an iteration boundary** (preemption): :func:`stop_on_signals` makes SIGTERM and
  SIGUSR1 (SLURM's ``--signal=USR1@SECONDS`` warning) only record a request,
  :func:`agree_to_stop` tells every rank, at the same point of the run, whether any of them
  was asked to stop (SLURM signals every process, ``torchrun`` forwards the signal to its own
  node's ranks, a launcher forwards it to its spawned ranks). A process is often signalled
  more than once for one stop (SLURM and torchrun's agent both signal a torchrun worker;
  SLURM's preemption signals again when GraceTime ends): repeats are the same request, and
  only SIGINT or the ``grace`` deadline of :func:`stop_gracefully_on_signals` stop at once.
"""

from __future__ import annotations

import ctypes
import io
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import RLHFFusionError


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


class DistributedRunError(RLHFFusionError, RuntimeError):
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


class LaunchEnvError(RLHFFusionError, ValueError):
    """The torchrun/SLURM environment of this process is inconsistent; the message names the
    fix."""


class RunInterrupted(BaseException):
    """The launcher was asked to stop now (SIGINT, or a stop request whose ``grace`` ran out);
    every rank has been stopped.

    A :class:`BaseException`, as ``KeyboardInterrupt`` is: a stop is not an error, so it
    passes through every ``except Exception`` on its way (the loop's stage wrapper, which
    would make it a ``LoopStageError``, exit 1) to the command, which exits ``128 + signum``.
    Hence also outside ``RLHFFusionError``, the root of the package's errors.
    """

    def __init__(self, signum: int, reason: str = ""):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}"
                         + (f": {reason}" if reason else ""))


def exit_promptly(code: int) -> NoReturn:
    """End this process now: Python's exit handlers run (multiprocessing's clean-up among
    them), torch's C++ static destructors do not. After a stop signal they take seconds on a
    loaded machine, and the process was asked to go. After a distributed run whose process
    groups something still holds (DeepSpeed's engine, DDP's reducer), they can abort the
    finished process while gloo's threads still run."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- stopping at an iteration boundary (preemption) ---------------------------------------------

_stop_signal: int | None = None
_children: list[Any] = []  # the ranks run_ranks is waiting on: a stop request is passed on

STOP_SIGNALS: tuple[int, ...] = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s)
"""Signals that ask for a stop at the next iteration boundary: SIGTERM (SLURM, Kubernetes,
torchrun's agent) and SIGUSR1 (SLURM's early warning, ``#SBATCH --signal=USR1@90``, the
signal Lightning's SLURM support listens to)."""


def stop_requested() -> int | None:
    """The signal that asked this process to stop at the next boundary (None: none did)."""
    return _stop_signal


def _record_stop(signum: int, frame: Any) -> None:
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signum


def stop_on_signals() -> None:
    """Make SIGTERM and SIGUSR1 (:data:`STOP_SIGNALS`) only record a stop request (a rank: the
    run checks it with :func:`agree_to_stop` at its iteration boundaries); a repeat is the
    same request."""
    for s in STOP_SIGNALS:
        signal.signal(s, _record_stop)


def stop_on_sigterm() -> None:
    """:func:`stop_on_signals` for SIGTERM alone (Lightning's workers: SIGUSR1 stays with
    Lightning's SLURM auto-requeue)."""
    signal.signal(signal.SIGTERM, _record_stop)


def _pass_on(signum: int) -> None:
    """Pass a stop request on to the ranks :func:`run_ranks` started (a rank that has not set
    up its handler yet holds it blocked until it has: see :func:`run_ranks`)."""
    for p in list(_children):
        if p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


def stop_gracefully_on_signals(grace: float) -> None:
    """CLI use, in the process that runs the command: the first SIGTERM or SIGUSR1 asks for a
    stop at the next iteration boundary (passed on to the ranks :func:`run_ranks` spawned)
    and raises :class:`RunInterrupted` if the run has not ended ``grace`` seconds later.
    Further SIGTERMs/SIGUSR1s are the same request (SLURM and torchrun's agent each signal a
    worker; SLURM's preemption signals again when its GraceTime ends): they change nothing.
    SIGINT raises :class:`RunInterrupted` at once (:func:`run_ranks` then stops every rank)."""

    def now(signum: int, frame: Any = None, reason: str = "") -> None:
        for s in (*STOP_SIGNALS, signal.SIGINT, signal.SIGALRM):
            signal.signal(s, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise RunInterrupted(signum, reason)

    late = f"the run did not reach an iteration boundary within {grace:g} s (--stop-grace)"

    def on_stop(signum: int, frame: Any) -> None:
        if _stop_signal is not None:
            return   # the same stop, asked again: its deadline stands
        _record_stop(signum, frame)
        _pass_on(signum)
        signal.signal(signal.SIGALRM, lambda s, f: now(signum, reason=late))
        signal.setitimer(signal.ITIMER_REAL, max(grace, 1e-6))  # 0 would disarm it

    for s in STOP_SIGNALS:
        signal.signal(s, on_stop)
    signal.signal(signal.SIGINT, now)


def cancel_stop_deadline() -> None:
    """The run ended by itself: the ``grace`` deadline of a stop request no longer applies."""
    signal.setitimer(signal.ITIMER_REAL, 0)


def ignore_stop_signals() -> None:
    """The command has ended and this process is exiting: a SIGTERM or SIGUSR1 now is a late
    repeat of a stop already obeyed (SLURM and torchrun signal again). Ignored, since at
    shutdown Python gives the signals their default action back (termination) while torch's
    teardown can take seconds, and a run that stopped cleanly would end as killed by SIGTERM."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def clear_stop_request() -> None:
    """Forget a stop request (the run it was for has stopped)."""
    global _stop_signal
    _stop_signal = None


def agree_to_stop(also: bool = False) -> bool:
    """Whether any rank was asked to stop (by a signal, or ``also`` on some rank); every rank
    must call it at the same point (it is a collective on the default group when one is set
    up)."""
    asked = int(_stop_signal is not None or also)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([asked], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = int(flag.item())
    return bool(asked)


# -- joining a process group started by torchrun or srun -----------------------------------------

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class JoinedGroup:
    """Where this process stands in a group started outside rlhf-fusion."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" (the five variables, whoever set them) or "SLURM"

    @property
    def lead(self) -> bool:
        return self.rank == 0


def _int_var(env: dict[str, str], name: str, fix: str) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise LaunchEnvError(f"{name}={env[name]!r} is not an integer; {fix}") from None
    if value < 0:
        raise LaunchEnvError(f"{name}={value} is negative; {fix}")
    return value


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list (``node[01-03,7],gpu-a``) as host names, in order (what
    ``scontrol show hostnames`` prints)."""
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            if text[start:i].strip():
                hosts.extend(_expand_host(text[start:i].strip()))
            start = i + 1
    if depth != 0:
        raise LaunchEnvError(f"host list {text!r}: unbalanced brackets")
    if not hosts:
        raise LaunchEnvError(f"host list {text!r} names no host")
    return hosts


def _expand_host(name: str) -> list[str]:
    open_ = name.find("[")
    if open_ < 0:
        return [name]
    close = name.find("]", open_)
    head, body, tail = name[:open_], name[open_ + 1:close], name[close + 1:]
    values = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchEnvError(f"host list entry {name!r}: {part!r} is not N or N-M")
        if hi and int(hi) < int(lo):
            raise LaunchEnvError(f"host list entry {name!r}: the range {part!r} runs backwards "
                                 f"(write {hi.zfill(len(lo))}-{lo})")
        for v in range(int(lo), int(hi or lo) + 1):
            values.append(str(v).zfill(len(lo)))
    return [head + v + rest for v in values for rest in _expand_host(tail)]


def group_from_env(env: dict[str, str] | None = None) -> JoinedGroup | None:
    """The group this process was started in, read from torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; they win when both are set) or SLURM's
    (SLURM_PROCID, SLURM_NTASKS or SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the first host of
    SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST unless MASTER_ADDR is set,
    MASTER_PORT or else :func:`slurm_port` of SLURM_JOB_ID and SLURM_STEP_ID). None
    when neither is there, or the group has one process (nothing to join). Raises
    :class:`LaunchEnvError` naming the fix when the variables contradict each other."""
    env = dict(os.environ if env is None else env)
    given = [v for v in TORCHRUN_VARS if v in env]
    if any(v in env for v in TORCHRUN_VARS[:3]):  # MASTER_* alone also serve SLURM
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise LaunchEnvError(
                f"{', '.join(given)} set but {', '.join(missing)} not: start the command "
                "with torchrun (it sets all five), or set every one of "
                f"{', '.join(TORCHRUN_VARS)}, or unset them to spawn the ranks here")
        fix = "torchrun sets it; check the command that started this process"
        group = JoinedGroup(
            rank=_int_var(env, "RANK", fix), world_size=_int_var(env, "WORLD_SIZE", fix),
            local_rank=_int_var(env, "LOCAL_RANK", fix), master_addr=env["MASTER_ADDR"],
            master_port=_int_var(env, "MASTER_PORT", fix), source="torchrun")
    elif "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env):
        fix = "start one process per task with srun (it sets SLURM_PROCID, SLURM_NTASKS, " \
              "SLURM_LOCALID and SLURM_NODELIST)"
        tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        world = _int_var(env, tasks, fix)
        if world <= 1:
            return None
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodes = next((env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                           "SLURM_NODELIST") if env.get(v)), None)
            if nodes is None:
                raise LaunchEnvError(f"SLURM_PROCID and {tasks} set but no SLURM_NODELIST: "
                                     f"{fix}, or set MASTER_ADDR to the first task's host")
            addr = expand_hostlist(nodes)[0]
        if "MASTER_PORT" in env:
            port = _int_var(env, "MASTER_PORT", "set MASTER_PORT to a free TCP port")
        elif env.get("SLURM_JOB_ID", "").isdigit():
            step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
            port = slurm_port(int(env["SLURM_JOB_ID"]), int(step) if step.isdigit() else 0)
        else:
            raise LaunchEnvError("SLURM without SLURM_JOB_ID: set MASTER_PORT to a free TCP "
                                 "port (the same on every task)")
        group = JoinedGroup(
            rank=_int_var(env, "SLURM_PROCID", fix), world_size=world,
            local_rank=_int_var(env, "SLURM_LOCALID", fix) if "SLURM_LOCALID" in env else 0,
            master_addr=addr, master_port=port, source="SLURM")
    else:
        return None
    if group.world_size < 1 or group.rank >= group.world_size:
        names = ("RANK", "WORLD_SIZE") if group.source == "torchrun" else ("SLURM_PROCID", tasks)
        raise LaunchEnvError(f"{names[0]}={group.rank} with {names[1]}={group.world_size}: a "
                             f"rank is below the world size; {fix}")
    return None if group.world_size == 1 else group


SLURM_PORTS = (15000, 31000)
"""The ports :func:`slurm_port` picks from: below Linux's ephemeral range (32768 and up), where
outgoing connections take theirs."""


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port of a SLURM step when MASTER_PORT is not set: 15000 + 16 x (the job
    id's last 3 digits) + the step id modulo 16. Every task of a step computes the same one;
    two steps of one job running together (``srun ... &`` twice) get different ones (unless
    their step ids differ by a multiple of 16), as do jobs whose ids differ in the last 3
    digits. Lightning's 15000 + the job id's last 4 digits gives every step of a job one
    port."""
    return SLURM_PORTS[0] + (job_id % 1000) * 16 + step_id % 16


def device_for(local_rank: int) -> torch.device:
    """This process's GPU: ``cuda:LOCAL_RANK`` when the process sees several (torchrun
    --nproc-per-node, one task per node owning all its GPUs), the one it sees whatever its
    LOCAL_RANK when it sees one (``srun --gpus-per-task=1``, ``--gpu-bind``, a
    CUDA_VISIBLE_DEVICES per process: each task's GPU is its ``cuda:0``)."""
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise LaunchEnvError(
            f"LOCAL_RANK={local_rank} but this process sees {count} GPUs (cuda:0 to "
            f"cuda:{count - 1}): give each process one GPU of its own: start at most {count} "
            "processes per node (torchrun --nproc-per-node, srun --ntasks-per-node), or give "
            "each task its own GPU (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per "
            "process), or fix LOCAL_RANK (SLURM_LOCALID under srun) if whoever sets it "
            "counts the processes of this node differently")
    return torch.device("cuda", local_rank)


def join_group(group: JoinedGroup, *, timeout: float) -> torch.device:
    """Join ``group`` (every collective bounded by ``timeout`` seconds); returns this process's
    device: with a GPU, :func:`device_for` (``cuda:LOCAL_RANK``, or the one GPU the process
    sees) with NCCL for CUDA tensors (and gloo for CPU ones), else the CPU with gloo."""
    os.environ.update(RANK=str(group.rank), WORLD_SIZE=str(group.world_size),
                      LOCAL_RANK=str(group.local_rank), MASTER_ADDR=group.master_addr,
                      MASTER_PORT=str(group.master_port))
    if torch.cuda.is_available():
        device = device_for(group.local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return device


STAGE_BYTES = 160
_stage_buf: Any = None  # this rank's shared stage record (set in a launched rank)
_stage_parts: list[str] = []
_parent_pid: int | None = None
_stage_listener: Callable[[str], None] | None = None


def listen_to_stages(listener: Callable[[str], None] | None) -> None:
    """Call ``listener`` with the full stage text each time this process enters a stage
    (``None``: stop). Injected by whoever starts the rank: a run's
    :class:`~rlhf_fusion.loop.resolve.RunHooks` (fault-injection tests kill a rank there)."""
    global _stage_listener
    _stage_listener = listener


def note_stage(text: str, level: int = 0) -> None:
    """Record what this rank is doing; the launcher names it if the rank dies silently.

    ``level`` 0 is the loop's stage ("training of iteration 2"); level 1 a step inside it
    ("migration"), cleared when the next level-0 stage starts."""
    del _stage_parts[level:]
    _stage_parts.append(text)
    full = ": ".join(_stage_parts)
    if _stage_buf is not None:
        _stage_buf.value = full.encode()[: STAGE_BYTES - 1]
    if _stage_listener is not None:
        _stage_listener(full)


def orphaned() -> bool:
    """Whether this launched rank's launcher is gone (never true outside :func:`run_ranks`)."""
    return _parent_pid is not None and os.getppid() != _parent_pid


def die_with_parent(parent_pid: int) -> None:
    """Make this process end when ``parent_pid`` (its launcher) does: SIGKILL from the kernel
    (``PR_SET_PDEATHSIG``, Linux) and, everywhere, a watchdog thread on the parent's pid."""
    global _parent_pid
    _parent_pid = parent_pid
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it
    if orphaned():  # the launcher died before the line above took effect
        os._exit(1)

    def watch() -> None:
        while not orphaned():
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rlhf-fusion-parent-watchdog", daemon=True).start()


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
    parent_pid: int,
    stage: Any,
) -> None:
    global _stage_buf
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM or SIGUSR1 (the launcher passing a stop request on, or SLURM signalling every
    # process) is a request to stop at the next boundary; the launcher stops a rank at once
    # with SIGKILL. They were blocked from the start (run_ranks): one sent before this line
    # was held, and is recorded now instead of killing the rank.
    stop_on_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _stage_buf = stage
    note_stage("start-up")
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
        note_stage("reporting its result")
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
    # failure must not turn a clean report into a hang or a crash. multiprocessing's own
    # finalizers still run: a semaphore made here (tqdm's lock, say) is unlinked instead of
    # left to the resource tracker's "leaked semaphore objects" warning.
    try:
        from multiprocessing import util

        util._run_finalizers(0)
    except Exception:  # noqa: BLE001
        pass
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
    grace: float | None = None,
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
    Once a rank has failed, the ones still running get ``grace`` seconds (default
    ``min(collective_timeout + 5, 30)``) to report and are then stopped, reported as
    ``error_type="Stopped"`` naming the first failed rank.
    """
    needed = set(range(world_size) if wait_for is None else wait_for)
    grace = min(collective_timeout + 5.0, 30.0) if grace is None else grace
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    # Plain shared memory (no lock, so no semaphore): each rank's current stage.
    stages = [ctx.RawArray("c", STAGE_BYTES) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, collective_timeout, threads, fn, args, out,
                  os.getpid(), stages[r]),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        _children[:] = procs
        # A rank inherits this thread's signal mask: blocked until it records stop requests
        # (_worker), a SIGTERM during its start-up is held instead of killing it.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if _stop_signal is not None:   # asked before the ranks existed
            _pass_on(_stop_signal)
        results, first_failure = _collect(procs, stages, out, needed, timeout, grace)
    except BaseException:
        _stop(procs, at_once=True)
        raise
    finally:
        _children.clear()
    for r in range(world_size):
        if r not in results:
            if r not in needed:
                results[r] = RankResult(
                    r, False, error_type="NotAwaited", error="not in wait_for; terminated"
                )
            elif first_failure is not None:
                results[r] = RankResult(
                    r, False, error_type="Stopped",
                    error=f"stopped {grace:g} s after rank {first_failure} failed, while "
                          f"{_stage_of(stages[r])}",
                )
            else:
                results[r] = RankResult(
                    r, False, error_type="Deadline",
                    error=f"no report within {timeout:g} s, while {_stage_of(stages[r])}",
                )
    _stop(procs, at_once=first_failure is not None)
    ordered = [results[r] for r in range(world_size)]
    if raise_on_error and not all(r.ok for r in ordered):
        raise DistributedRunError(ordered)
    return ordered


def _stage_of(buf: Any) -> str:
    return buf.value.decode(errors="replace") or "starting"


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _collect(procs: list[Any], stages: list[Any], out: Any, needed: set[int], timeout: float,
             grace: float) -> tuple[dict[int, RankResult], int | None]:
    """The ranks' reports until every needed rank reported or died, the deadline passed, or
    ``grace`` seconds passed since the first failure."""
    results: dict[int, RankResult] = {}
    died: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    first_failure: int | None = None
    failed_at = 0.0
    while not needed <= (set(results) | set(died)):
        now = time.monotonic()
        if first_failure is not None:
            deadline = min(deadline, failed_at + grace)
        left = deadline - now
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
                        error=f"{_exit_text(p.exitcode)} without reporting, while "
                              f"{_stage_of(stages[r])}",
                        exitcode=p.exitcode,
                    )
                    if first_failure is None:
                        first_failure, failed_at = r, time.monotonic()
            continue
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        died.pop(rank, None)
        if not results[rank].ok and first_failure is None:
            first_failure, failed_at = rank, time.monotonic()
    return {**died, **results}, first_failure


def _stop(procs: list[Any], *, at_once: bool) -> None:
    """Join the ranks; SIGKILL the ones still running (SIGTERM only asks a rank to stop at its
    next boundary). ``at_once``: do not wait for them to finish by themselves first."""
    for p in procs:
        if p.pid is None:
            continue  # never started
        p.join(timeout=0.0 if at_once else 5.0)
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
