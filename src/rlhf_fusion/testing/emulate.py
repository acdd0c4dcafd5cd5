"""Emulated execution of an :class:`~rlhf_fusion.placement.ExecutionPlan` on real processes.

The estimator (:mod:`rlhf_fusion.placement.estimate`) predicts an iteration time from the plan's
augmented dataflow graph (calls, parameter-reallocation nodes, data-transfer delays on edges
between meshes) with ReaLHF's Algorithm 1. This module measures what that graph really takes
when every rank of a gloo process group walks it, with compute *emulated* and communication
*real*:

* the graph is the estimator's own: the :class:`~rlhf_fusion.placement.TNode` list of
  ``Estimator.estimate(plan).timeline`` (ranks, parents, durations, iterations), not a
  re-derivation, so the emulation cannot silently model a different graph;
* each rank runs the nodes that involve it in the order the estimator's schedule gives them
  (start time, then end, then index: one global order, so the per-mesh barriers cannot
  deadlock and dependencies always point forward);
* a call node: wait for the parents' outputs (real bytes over gloo point-to-point, sized as
  ``CostModel.data_bytes`` says, scattered from every producer rank to the consumer mesh and
  streamed in ``STREAM_CHUNKS`` chunks as the estimator assumes), wait for every rank of its
  mesh (a barrier on a subgroup made once per distinct rank set), sleep the node's estimated
  duration, sending output chunk ``i`` after ``(i + 1) / STREAM_CHUNKS`` of it;
* a reallocation node: a barrier over both meshes, then the real bytes of every
  :class:`~rlhf_fusion.placement.Transfer` of ``plan_realloc`` point-to-point, then a closing
  barrier (the estimator occupies both meshes until the last byte lands);
* a call of a host-offloaded model (``plan.offload``) has the estimator's ``prefetch_s``: as
  in :func:`~rlhf_fusion.placement.timeline.simulate`, its weights load while the previous
  node on its GPUs runs, from that node's start, so each rank waits until its previous node's
  start plus ``prefetch_s`` (its own ready time when it ran nothing before) before the mesh
  barrier: the call starts no earlier than the latest of those over its mesh. The prefetch is
  timed, not copied: a memcpy between CPU processes says nothing of a PCIe link, and the
  estimator's PCIe figure is the caller's (``local_hardware`` sets it to the measured link);
* every wait has a deadline; a late one raises :class:`EmulationError` naming node and rank.

Each rank records every node's start and end on ``time.monotonic()`` (``CLOCK_MONOTONIC``, one
clock for all processes of a Linux machine), so the parent can rebuild the measured timeline
and the measured iteration time exactly as ``Timeline.iteration_time`` defines the predicted
one: the end of the last iteration minus the end of the one before.

:func:`local_hardware` builds a :class:`~rlhf_fusion.placement.Hardware` for *this* machine:
link bandwidth and latency measured with gloo sends between local processes, FLOP/s chosen by
the caller (compute is only slept, so FLOP/s just set the scale of the durations).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RLHFFusionError
from ..launch import run_ranks
from ..placement.costs import CostModel
from ..placement.estimate import STREAM_CHUNKS, Estimate, Estimator
from ..placement.graph import TRAIN_CALL
from ..placement.hardware import A100_80G, Hardware
from ..placement.plan import ExecutionPlan
from ..placement.realloc_plan import MeshLayout, plan_realloc
from ..placement.timeline import Timeline


class EmulationError(RLHFFusionError, RuntimeError):
    """A wait of the emulated executor failed or passed its deadline; names node and rank."""


# -- the program every rank runs ---------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One point-to-point transfer: a data chunk between meshes or one reallocation piece."""

    tag: int           # unique within one run of the graph
    src: int
    dst: int
    nbytes: int
    producer: int      # node index that sends it (the reallocation node itself for pieces)
    consumer: int      # node index that waits for it
    chunk: int = 0     # data: which of the STREAM_CHUNKS the producer sends it after


@dataclass(frozen=True)
class ENode:
    """A node of the estimator's timeline, as the ranks need it (picklable, torch-free)."""

    index: int
    name: str
    kind: str                      # "call" | "realloc"
    ranks: tuple[int, ...]
    duration: float                # seconds slept (calls); predicted seconds (reallocations)
    iteration: int
    parents: tuple[int, ...]
    prefetch_s: float = 0.0        # a host-offloaded model's weight load (not scaled)


@dataclass
class Program:
    """Everything the ranks need: nodes, per-rank order, messages, subgroups."""

    nodes: list[ENode]
    order: dict[int, list[int]]                 # rank -> node indices in execution order
    data_in: dict[int, list[Message]]           # consumer node -> data messages it waits for
    data_out: dict[int, list[Message]]          # producer node -> data messages it sends
    realloc: dict[int, list[Message]]           # reallocation node -> its pieces
    groups: list[tuple[int, ...]]               # every distinct rank set of > 1 rank, sorted
    world: int

    def realloc_bytes(self, node: int) -> int:
        return sum(m.nbytes for m in self.realloc.get(node, ()))


def _pieces(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(producer rank, consumer rank) of each of ``max(|src|, |dst|)`` equal pieces: every
    producer sends its share and every consumer receives its share, so the busiest link
    carries ``1 / min(|src|, |dst|)`` of the bytes, the estimator's ``lanes``."""
    n = max(len(src), len(dst))
    return [(src[k * len(src) // n], dst[k * len(dst) // n]) for k in range(n)]


def build_program(plan: ExecutionPlan, estimator: Estimator, estimate: Estimate | None = None,
                  *, byte_scale: float = 1.0, duration_scale: float = 1.0) -> Program:
    """The emulation program of ``plan`` from the estimator's own timeline nodes.

    ``byte_scale`` multiplies every transferred byte count (data and reallocation); evaluate
    the estimator with bandwidths divided by the same factor (``local_hardware(byte_scale=)``)
    so its delays describe the bytes that really move. ``duration_scale`` multiplies the
    slept call durations (tests: a fast run of the same graph); a prefetch is a transfer
    (its estimate already counts ``byte_scale`` through the bandwidth) and is not scaled.
    """
    est = estimate if estimate is not None and estimate.timeline is not None \
        else estimator.estimate(plan)
    tl = est.timeline
    assert tl is not None
    cost: CostModel = estimator.cost
    p = estimator.p
    nodes = [ENode(i, n.name, n.kind, tuple(sorted(n.ranks)),
                   n.duration * (duration_scale if n.kind == "call" else 1.0), n.iteration,
                   tuple(j for j, _ in n.parents), n.prefetch_s)
             for i, n in enumerate(tl.nodes)]
    # One global order (the estimator's schedule), restricted to each rank.
    key = sorted(range(len(nodes)), key=lambda i: (tl.start[i], tl.end[i], i))
    order: dict[int, list[int]] = {r: [] for r in range(p.cluster.size)}
    for i in key:
        for r in nodes[i].ranks:
            order[r].append(i)
    tag = 0
    data_in: dict[int, list[Message]] = defaultdict(list)
    data_out: dict[int, list[Message]] = defaultdict(list)
    realloc: dict[int, list[Message]] = {}
    for i, n in enumerate(tl.nodes):
        if n.kind == "realloc":
            model, call = n.model, n.call
            src, dst = plan.calls[TRAIN_CALL[model]], plan.calls[call]
            rp = plan_realloc(p.models[model], MeshLayout(src.mesh, src.strategy),
                              MeshLayout(dst.mesh, dst.strategy), p.cluster, detail=False)
            msgs = []
            for t in rp.transfers:
                msgs.append(Message(tag, t.src, t.dst, max(1, round(t.nbytes * byte_scale)),
                                    i, i))
                tag += 1
            realloc[i] = msgs
            continue
        for j, _delay in n.parents:
            par = tl.nodes[j]
            if par.kind != "call" or par.ranks == n.ranks:
                continue   # same mesh: the data stays; reallocation parents end in a barrier
            total = cost.data_bytes(par.call) * byte_scale
            pieces = _pieces(sorted(par.ranks), sorted(n.ranks))
            per = max(1, round(total / len(pieces) / STREAM_CHUNKS))
            for s, d in pieces:
                if s == d:
                    continue   # the rank hands the piece to itself
                for c in range(STREAM_CHUNKS):
                    m = Message(tag, s, d, per, j, i, c)
                    tag += 1
                    data_in[i].append(m)
                    data_out[j].append(m)
    groups = sorted({n.ranks for n in nodes if len(n.ranks) > 1})
    return Program(nodes, order, dict(data_in), dict(data_out), realloc, groups,
                   p.cluster.size)


# -- the rank side ------------------------------------------------------------------------------
class _Rank:
    def __init__(self, rank: int, prog: Program, timeout: float):
        self.rank, self.prog = rank, prog
        self.td = timedelta(seconds=timeout)
        # new_group is collective over the world: every rank creates every group, same order.
        self.groups = {g: dist.new_group(list(g), timeout=self.td) for g in prog.groups}
        out = [m.nbytes for ms in prog.data_out.values() for m in ms if m.src == rank]
        out += [m.nbytes for ms in prog.realloc.values() for m in ms if m.src == rank]
        # Payload bytes are never read: one zero buffer serves every send (a view per message).
        self.send_buf = torch.zeros(max(out, default=1), dtype=torch.uint8)
        rin = [sum(m.nbytes for m in ms if m.dst == rank) for ms in prog.realloc.values()]
        # zeros, not empty: the first reallocation must not pay the page faults of its buffer.
        self.realloc_buf = torch.zeros(max(rin, default=1), dtype=torch.uint8)

    def _wait(self, work: Any, node: ENode, what: str) -> None:
        try:
            work.wait(self.td)
        except Exception as exc:  # noqa: BLE001 - re-raised with where it happened
            raise EmulationError(
                f"rank {self.rank}: node {node.name!r} ({node.kind} on ranks "
                f"{list(node.ranks)}): {what} failed or passed its "
                f"{self.td.total_seconds():g} s deadline: {exc}") from exc

    def _barrier(self, node: ENode, what: str) -> None:
        if len(node.ranks) > 1:
            g = self.groups[node.ranks]
            self._wait(dist.barrier(group=g, async_op=True), node, what)

    def run_once(self) -> tuple[float, list[tuple[int, float, float, int]]]:
        """One walk of the graph: (t0, [(node, start, end, bytes received)])."""
        prog, rank = self.prog, self.rank
        # Data receives are posted up front so a producer never waits for its consumer to
        # reach the node (the estimator streams data while the producer still computes).
        recv: dict[int, Any] = {}
        keep: list[torch.Tensor] = []
        for ms in prog.data_in.values():
            for m in ms:
                if m.dst == rank:
                    buf = torch.empty(m.nbytes, dtype=torch.uint8)
                    keep.append(buf)
                    recv[m.tag] = dist.irecv(buf, src=m.src, tag=m.tag)
        sends: list[tuple[Any, ENode]] = []
        whole = ENode(-1, "start of the run", "call", tuple(range(prog.world)), 0.0, 0, ())
        self._wait(dist.barrier(async_op=True), whole, "the start barrier")
        t0 = time.monotonic()
        records = []
        last_start: float | None = None    # of the previous node on this rank
        for i in prog.order[rank]:
            node = prog.nodes[i]
            got = 0
            if node.kind == "realloc":
                self._barrier(node, "the barrier before the reallocation")
                start = time.monotonic()
                works = []
                off = 0
                for m in prog.realloc[i]:
                    if m.dst == rank:
                        view = self.realloc_buf[off:off + m.nbytes]
                        off += m.nbytes
                        works.append((dist.irecv(view, src=m.src, tag=m.tag), m))
                for m in prog.realloc[i]:
                    if m.src == rank:
                        works.append((dist.isend(self.send_buf[:m.nbytes], dst=m.dst,
                                                 tag=m.tag), m))
                for w, m in works:
                    self._wait(w, node, f"reallocation piece {m.src}->{m.dst} "
                                        f"({m.nbytes} bytes)")
                    if m.dst == rank:
                        got += m.nbytes
                end = time.monotonic()   # before the closing barrier: see the module doc
                self._barrier(node, "the barrier after the reallocation")
            else:
                for m in prog.data_in.get(i, ()):
                    if m.dst == rank:
                        self._wait(recv.pop(m.tag), node,
                                   f"data chunk {m.chunk} from {prog.nodes[m.producer].name!r} "
                                   f"on rank {m.src}")
                        got += m.nbytes
                if node.prefetch_s > 0:
                    # The weights load from the previous node's start (else from now).
                    loaded = (last_start if last_start is not None
                              else time.monotonic()) + node.prefetch_s
                    left = loaded - time.monotonic()
                    if left > 0:
                        time.sleep(left)
                self._barrier(node, "the barrier of its mesh")
                start = time.monotonic()
                out = [m for m in prog.data_out.get(i, ()) if m.src == rank]
                for c in range(STREAM_CHUNKS):
                    # Sleep to an absolute deadline so send overheads do not accumulate.
                    left = start + node.duration * (c + 1) / STREAM_CHUNKS - time.monotonic()
                    if left > 0:
                        time.sleep(left)
                    if c == STREAM_CHUNKS - 1:
                        end = time.monotonic()   # the output exists before its last chunk leaves
                    for m in out:
                        if m.chunk == c:
                            sends.append((dist.isend(self.send_buf[:m.nbytes], dst=m.dst,
                                                     tag=m.tag), node))
            records.append((i, start, end, got))
            last_start = start
        for w, node in sends:
            self._wait(w, node, "an output send")
        return t0, records


def _emulate_worker(rank: int, world: int, prog: Program, repeats: int, timeout: float,
                    warmup: int = 0) -> dict:
    r = _Rank(rank, prog, timeout)
    for _ in range(warmup):
        r.run_once()
    runs = [r.run_once() for _ in range(repeats)]
    dist.barrier()
    return {"t0": [t for t, _ in runs], "records": [rec for _, rec in runs]}


# -- results ------------------------------------------------------------------------------------
@dataclass
class Measured:
    """One walk of the graph, merged over ranks (times relative to the start barrier)."""

    start: list[float]                    # per node: earliest start over its ranks
    end: list[float]                      # per node: latest end over its ranks
    ranks: list[list[int]]                # per node: ranks that recorded it (in rank order)
    runs: list[int]                       # per node: how many records it has in total
    per_rank: dict[int, dict[int, tuple[float, float]]]   # rank -> node -> (start, end)
    recv_bytes: dict[int, int]            # reallocation node -> bytes received, all ranks
    iteration_time: float

    def timeline(self, prog_nodes: Sequence[Any]) -> Timeline:
        return Timeline(list(self.start), list(self.end), list(prog_nodes))


@dataclass
class EmulationResult:
    plan: str
    predicted: Estimate
    program: Program
    runs: list[Measured] = field(default_factory=list)

    @property
    def measured_iteration_time(self) -> float:
        """Median over repeats of the measured steady-state iteration time."""
        return statistics.median(m.iteration_time for m in self.runs)

    @property
    def ratio(self) -> float:
        return self.measured_iteration_time / self.predicted.iteration_time


def _iteration_time(nodes: Sequence[ENode], start: Sequence[float], end: Sequence[float]
                    ) -> float:
    """The estimator's own ``Timeline.iteration_time`` on measured times (it reads only each
    node's ``iteration`` and end, which ``ENode`` carries as ``TNode`` does)."""
    return Timeline(list(start), list(end), list(nodes)).iteration_time()  # type: ignore[arg-type]


def merge(prog: Program, values: Sequence[dict]) -> list[Measured]:
    """Per-rank records (``_emulate_worker`` values in rank order) -> one Measured per run."""
    out = []
    for k in range(len(values[0]["t0"])):
        t0 = min(v["t0"][k] for v in values)
        n = len(prog.nodes)
        start, end = [float("inf")] * n, [float("-inf")] * n
        ranks: list[list[int]] = [[] for _ in range(n)]
        runs = [0] * n
        per_rank: dict[int, dict[int, tuple[float, float]]] = {}
        recv: dict[int, int] = defaultdict(int)
        for rank, v in enumerate(values):
            per_rank[rank] = {}
            for i, s, e, got in v["records"][k]:
                start[i] = min(start[i], s - t0)
                end[i] = max(end[i], e - t0)
                ranks[i].append(rank)
                runs[i] += 1
                per_rank[rank][i] = (s - t0, e - t0)
                if prog.nodes[i].kind == "realloc":
                    recv[i] += got
        out.append(Measured(start, end, ranks, runs, per_rank, dict(recv),
                            _iteration_time(prog.nodes, start, end)))
    return out


def emulate_plan(plan: ExecutionPlan, estimator: Estimator, *, repeats: int = 3,
                 warmup: int = 1, byte_scale: float = 1.0, duration_scale: float = 1.0,
                 timeout: float = 60.0, run_timeout: float = 600.0) -> EmulationResult:
    """Run ``plan``'s graph ``repeats`` times on ``cluster.size`` local gloo processes, after
    ``warmup`` unrecorded runs (first sends on fresh connections and buffers are slower than
    the steady state the estimator describes).

    ``timeout`` bounds every wait inside a rank; ``run_timeout`` the whole launch.
    """
    est = estimator.estimate(plan)
    prog = build_program(plan, estimator, est, byte_scale=byte_scale,
                         duration_scale=duration_scale)
    res = run_ranks(_emulate_worker, prog.world, prog, repeats, timeout, warmup,
                    timeout=run_timeout, collective_timeout=timeout)
    return EmulationResult(plan.name, est, prog, merge(prog, [r.value for r in res]))


# -- this machine as a Hardware preset ---------------------------------------------------------
@dataclass(frozen=True)
class LinkMeasurement:
    """gloo point-to-point between local processes."""

    latency_s: float            # one-way, small message (half a ping-pong)
    bandwidth: float            # bytes/s, one pair sending alone
    concurrent_bandwidth: float  # bytes/s per pair while every other pair sends too
    nbytes: int
    pairs: int
    bidirectional_bandwidth: float = 0.0  # bytes/s per rank and direction, all ranks both ways

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _link_worker(rank: int, world: int, nbytes: int, reps: int) -> dict:
    small = torch.zeros(8, dtype=torch.uint8)
    big = torch.zeros(nbytes, dtype=torch.uint8)
    peer = rank ^ 1                      # pairs (0, 1), (2, 3), ...
    out: dict[str, float] = {}
    # Latency: ping-pong between ranks 0 and 1 only.
    dist.barrier()
    if rank < 2:
        rtts = []
        for _ in range(reps * 20):
            t = time.perf_counter()
            if rank == 0:
                dist.send(small, 1)
                dist.recv(small, 1)
            else:
                dist.recv(small, 0)
                dist.send(small, 0)
            rtts.append(time.perf_counter() - t)
        out["latency_s"] = statistics.median(rtts) / 2

    def stream(active: bool) -> float | None:
        dist.barrier()
        if not active:
            dist.barrier()
            return None
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            if rank % 2 == 0:
                dist.send(big, peer)
                dist.recv(small, peer)          # the receiver's ack: the bytes landed
            else:
                dist.recv(big, peer)
                dist.send(small, peer)
            times.append(time.perf_counter() - t)
        dist.barrier()
        return nbytes / statistics.median(times)

    bw = stream(rank < 2)
    if bw is not None:
        out["bandwidth"] = bw
    out["concurrent_bandwidth"] = stream(True) or 0.0
    # Every rank sends to and receives from its pair at once (what a reallocation between two
    # tensor-parallel layouts does): the per-GPU link model says this costs no more than one
    # direction; on a CPU-bound loopback transport it does.
    dist.barrier()
    times = []
    other = torch.empty_like(big)
    for _ in range(reps):
        t = time.perf_counter()
        works = [dist.irecv(other, peer), dist.isend(big, peer)]
        for w in works:
            w.wait()
        dist.barrier()
        times.append(time.perf_counter() - t)
    out["bidirectional_bandwidth"] = nbytes / statistics.median(times)
    return out


def measure_links(world: int = 4, nbytes: int = 64 << 20, reps: int = 5) -> LinkMeasurement:
    """Latency and bandwidth of gloo sends between ``world`` local processes (even).

    ``nbytes`` per message: large, as reallocation pieces are (100-400 MB in the benchmark);
    at 16 MB the per-message overhead of gloo already costs a third of the rate.
    """
    res = run_ranks(_link_worker, world, nbytes, reps, timeout=300.0)
    v = [r.value for r in res]
    return LinkMeasurement(v[0]["latency_s"], statistics.median([v[0]["bandwidth"],
                                                                 v[1]["bandwidth"]]),
                           statistics.median(x["concurrent_bandwidth"] for x in v),
                           nbytes, world // 2,
                           statistics.median(x["bidirectional_bandwidth"] for x in v))


def local_hardware(*, flops: float, hbm_bw: float, link: LinkMeasurement | None = None,
                   concurrent: bool = True, byte_scale: float = 1.0,
                   gpus_per_node: int = 4, base: Hardware = A100_80G,
                   name: str = "local-gloo") -> Hardware:
    """A Hardware for this machine's processes.

    NVLink and InfiniBand bandwidth are the measured gloo bandwidth (per pair while all pairs
    send when ``concurrent``, as reallocations and scatters do; else one pair alone), divided
    by ``byte_scale`` (the emulation moves ``byte_scale`` times the bytes), and
    ``comm_efficiency`` is 1 (the figure is already what a transfer reaches); link latency is
    the measured one-way latency. FLOP/s and HBM bandwidth are the caller's: compute is only
    slept, so they set the scale of the call durations. Memory figures stay ``base``'s.
    """
    link = link or measure_links()
    bw = (link.concurrent_bandwidth if concurrent else link.bandwidth) / byte_scale
    return dataclasses.replace(base, name=name, flops=flops, hbm_bw=hbm_bw, nvlink_bw=bw,
                               ib_bw=bw, pcie_bw=bw, gpus_per_node=gpus_per_node,
                               comm_efficiency=1.0, link_latency_s=link.latency_s)
