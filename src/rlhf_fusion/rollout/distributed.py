"""Streaming coordinator: inter-stage fusion across ranks on torch.distributed.

Each rank is one generation instance (a GenerationBackend) that also holds the Ref, Reward and
Critic models. Timeline of ``run_rollout`` on every rank, fused mode:

1. **Generate and report.** Each rank decodes its shard and publishes its unfinished count,
   without waiting for the others (a collective here would lock every rank to the slowest
   one's step rate). The first rank that sees at most R_t unfinished samples in total sets
   the trigger; every rank checks it.
2. **Plan.** The m ranks with most samples left are the destinations, the rest are freed.
   With one destination on one host the trigger carries the counts it was set on and its
   claimer, and every rank reads its role from them (:func:`_roles_at_trigger`: the
   destination is the rank with most samples left other than the claimer); otherwise every
   rank's progress reaches every rank and each computes the same ``assign_migration`` plan.
3. **Migrate.** Sources export their unfinished samples ("kv" or "tokens") and send the
   tickets; destinations import them and acknowledge. A source waits for the acknowledgement
   only after it has scored its own finished samples, and raises ``MigrationError`` naming a
   destination that never acknowledges.
4. **Stream.** Destinations put the samples they finished before the trigger into the stream
   in whole micro-batches, keep generating and add the rest as they finish. Freed ranks score
   their own finished samples first (they are where they are), then take and score chunks
   from the stream; a destination whose generation is over takes its share too. Waiting
   consumers watch the destinations' heartbeats and raise ``CoordinatorTimeout`` naming a
   silent (or, on one host, dead) rank.
5. **Assemble.** Every rank's experience reaches every rank (an all-gather); each returns the
   batch sorted by sample id, checked exactly-once.

Two transports carry steps 1-4. When every rank of the group runs on one host, the group's
shared board (:mod:`.board`, set up by its first rollout) holds the counts, heartbeats,
pids and the trigger, written and read after every decode step, and the trigger's counts,
the progress reports, tickets, stream chunks and the final exchange are files beside it in
``/dev/shm`` (written whole, renamed into place; a consumer claims a chunk by renaming it):
no collective at the start, no gloo round trip or store request on the way, which on a
short rollout cost more than fusion gains
(``benchmarks/results/grpo_demo_compare_analysis.md``). Across hosts the c10d store carries
the counts (every ``report_every`` steps), heartbeats and stream queue, gloo the progress
(one all-gather), the tickets (point-to-point) and the final exchange.
Each rank's stats say which (``board``).

Serial mode: generate the shard, wait for every rank to finish (inference cannot start before
the last sample ends; the board's done words on one host), score the own shard, assemble
through the same transport as fused mode. Same models, same numbers.

The configuration and its up-front checks live in ``rollout.config``. Any launcher that
initialises the default process group works; ``rlhf_fusion.launch.run_ranks`` starts local
gloo ranks (tests, benchmarks).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import pickle
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..launch import note_stage
from .backend import GenerationBackend
from .board import NO_TRIGGER, SharedBoard
from .config import RolloutConfig, check_rollout
from .experience_wire import pack_batch, unpack_batch
from .inference import Experience, InferenceModels
from .local import RolloutOutput, assemble, moving, resolve_mode, shard_of, should_trigger
from .planning.planner import (
    MigrationAssignment,
    assign_migration,
    choose_mechanism,
    destination_at_trigger,
)
from .types import (
    CoordinatorTimeout,
    MigrationError,
    RolloutConfigError,
    RolloutError,
    SampleProgress,
    SampleResult,
    SampleSpec,
)
from .wire import header, pack_ticket_parts, pack_tickets, unpack_tickets

_TAG_TICKETS = 1100  # +0 header, +1 ints, +2 floats
_TAG_ACK = 1110

FaultHook = Callable[[str, int], None]
"""Tests only: called as ``hook(point, n)`` at ``"tickets_received"`` (a destination got a
source's ticket header; ``n`` is the source rank), ``"streaming_step"`` (a destination's
``n``-th decode step after the migration) and ``"progress_report"`` (a rank is about to write
its progress report at the trigger; ``n`` is its rank); it may kill the process to simulate a
fault, or sleep to simulate a slow one."""


def _no_fault(point: str, n: int) -> None:
    pass


_run_counter = 0


class _Rank:
    """Per-call state and the messaging helpers, each bounded by the timeout."""

    def __init__(self, config: RolloutConfig, store: Any, fault: FaultHook,
                 group: Any = None) -> None:
        global _run_counter
        _run_counter += 1
        # Ranks below are ranks of ``group`` (the generation instances); point-to-point
        # messages go to their global ranks.
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.members = ([dist.get_global_rank(group, i) for i in range(self.world)]
                        if group is not None else list(range(self.world)))
        self.cfg = config
        self.fault = fault
        self.timeout = timedelta(seconds=config.timeout_s)
        self.store = store
        # Every member counts its own calls; the first member's global rank keeps two disjoint
        # groups that roll out at once apart in the shared store.
        self.prefix = f"rlhf_fusion/rollout/{self.members[0]}/{_run_counter}/"
        self._keys: set[str] = set()
        # This rank's last three decode steps before the migration (the board's path).
        self.steps_s: collections.deque[float] = collections.deque(maxlen=3)

    def key(self, name: str) -> str:
        k = self.prefix + name
        self._keys.add(k)
        return k

    def wait(self, work: Any, what: str, peer: int, exc_type: type = CoordinatorTimeout) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise exc_type(
                f"rank {self.rank}: {what} (peer rank {peer}) failed within the "
                f"{self.cfg.timeout_s:g}s timeout; rank {peer} died or hung ({exc})"
            ) from exc

    @contextlib.contextmanager
    def store_errors(self, what: str) -> Iterator[None]:
        """Turn a broken c10d store connection (its host, rank 0, died) into a clear error."""
        try:
            yield
        except RolloutError:
            raise
        except dist.QueueEmptyError:
            raise
        except Exception as exc:
            raise CoordinatorTimeout(
                f"rank {self.rank}: lost the c10d store (served by rank 0) while {what}; "
                f"rank 0 died or the network failed ({exc})"
            ) from exc

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise CoordinatorTimeout(
                f"rank {self.rank}: all-gather of {what} failed within the "
                f"{self.cfg.timeout_s:g}s timeout; a peer died or hung ({exc})"
            ) from exc

    def gather_rows(self, rows: Sequence[Sequence[int]], width: int, capacity: int,
                    what: str) -> list[list[tuple[int, ...]]]:
        """Every rank's ``rows`` (at most ``capacity`` of ``width`` ints each): one all-gather
        of a fixed-size tensor, where ``gather`` pickles and needs two (sizes, then bytes)."""
        if len(rows) > capacity:
            raise RolloutError(f"rank {self.rank}: {len(rows)} rows of {what}, more than the "
                               f"{capacity} every rank reserved")
        mine = torch.full((capacity + 1, width), -1, dtype=torch.int64)
        mine[0, 0] = len(rows)
        if rows:
            mine[1: len(rows) + 1] = torch.tensor(rows, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        with self.collective(what):
            dist.all_gather(out, mine, group=self.group)
        return [[tuple(x) for x in t[1: int(t[0, 0]) + 1].tolist()] for t in out]

    def gather(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        with self.collective(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out


def _default_store() -> Any:
    # The c10d store of the default group; a private accessor, but stable since torch 1.x.
    return dist.distributed_c10d._get_default_store()


def run_rollout(
    backend: GenerationBackend,
    inference: InferenceModels | None,
    specs: Sequence[SampleSpec],
    config: RolloutConfig,
    *,
    bs_max: int | None = None,
    store: Any = None,
    group: Any = None,
    faults: FaultHook | None = None,
) -> RolloutOutput:
    """One generation + inference stage on every rank of ``group`` (default: every rank).

    Every rank passes the same ``specs`` and ``config``; each generates the samples with
    ``sample_id % world_size == rank`` first. Returns the whole batch, sorted, on every rank.
    Only the ranks of ``group`` call it; ranks in the text and the stats are ranks of
    ``group``. ``store`` defaults to the default group's c10d store. ``faults``: a hook called at
    each protocol point (see :data:`FaultHook`), injected by fault-injection tests.
    """
    if not dist.is_initialized():
        raise RolloutConfigError(
            "run_rollout needs torch.distributed initialised (rlhf_fusion.launch.run_ranks "
            "starts local ranks)")
    bs_max = bs_max if bs_max is not None else getattr(backend, "max_batch_size", 1 << 30)
    # Identical inputs on every rank: a bad configuration fails everywhere, before any wait.
    m = check_rollout(specs, config, dist.get_world_size(group), bs_max)
    r = _Rank(config, store if store is not None else _default_store(), faults or _no_fault,
              group)
    ids = [s.sample_id for s in specs]
    rt = config.resolve_rt(len(specs)) if config.fused else None
    migrates = m is not None   # R_t = 0: no migration, the serial rollout below
    kv_ok = backend.capabilities.kv_export and backend.capabilities.kv_import
    mechanism = "tokens"
    if migrates:
        if config.mechanism != "auto":
            mechanism = resolve_mode(config.mechanism, kv_ok)
    shard = [s for s in specs if shard_of(s.sample_id, r.world) == r.rank]
    shards = [sum(shard_of(i, r.world) == k for i in ids) for k in range(r.world)]
    # The group's one-host board (set up by its first rollout, serial or fused) carries this
    # rollout's messages under its own sequence number; None: the store and gloo.
    with r.store_errors("setting up the rollout"):
        board = _shared_board(r)
    if board is not None:
        board.begin(shards)
    backend.submit(shard)
    t0 = time.perf_counter()
    # t0: perf_counter's clock is the host's monotonic clock, so one host's ranks' timelines
    # line up through it.
    stats: dict[str, Any] = {"rank": r.rank, "fused": config.fused, "rt": rt, "m": m, "t0": t0,
                             "board": "store" if board is None else "shared"}
    done: list[SampleResult] = []
    assignment: MigrationAssignment | None = None
    # One destination on one host: the roles come with the trigger (the counts it was set
    # on), and no progress reports are exchanged (_roles_at_trigger).
    roles = migrates and board is not None and m == 1
    if not migrates:
        note_stage("generation", 1)
        while backend.unfinished():
            done.extend(backend.step())
        stats["generation_end_s"] = time.perf_counter() - t0
        note_stage("end-of-generation barrier", 1)
        if board is None:
            r.gather(None, "end-of-generation barrier")
        elif config.balance_scoring:
            # Not the done words: the stream that follows counts its chunks in them.
            _board_counts_barrier(r, board, "end-of-generation barrier")
        else:
            _board_barrier(r, board, "end-of-generation barrier")
        stats["inference_start_s"] = time.perf_counter() - t0
        note_stage("scoring", 1)
        if config.balance_scoring and inference is not None and r.world > 1:
            # Every rank a stream producer with its generation over: each scores its own
            # micro-batches and hands the rest to a rank that has run out, so ranks that score
            # at unequal speeds end together, as the fused stream's do, without the overlap.
            with (r.store_errors("balancing the scoring") if board is None
                  else contextlib.nullcontext()):
                results, exps = _stream(r, backend, inference, range(r.world), done, t0,
                                        stats, lambda: None, board)
        else:
            exps = inference.score(done) if inference is not None else []
            stats["scoring_batches"] = _micro_batches(len(done), inference)
            results = done
    else:
        assert rt is not None and m is not None
        # The experiences of this rank's first finished samples, scored before the trigger
        # (_score_while_idle): one per sample of done[:len(early_exps)].
        early_exps: list[Experience] = []
        idle_work = (_score_while_idle(inference, done, early_exps, stats, t0)
                     if roles and inference is not None else None)
        # On one host nothing below goes through the store: an error there is not a lost one.
        with (r.store_errors("generating until the trigger") if board is None
              else contextlib.nullcontext()):
            _generate_until_trigger(r, backend, rt, done, board, roles, idle_work)
        stats["trigger_s"] = time.perf_counter() - t0
        note_stage("migration", 1)
        if roles:
            assert board is not None
            assignment = _roles_at_trigger(r, backend, board, stats)
            if config.mechanism == "auto":
                # (latency 0: the rule compares per-token costs, so any positive count gives
                # the answer the sources' own counts would, on every rank alike)
                mechanism = _auto_mechanism(1, backend, config, kv_ok)
        else:
            rows = [(p.sample_id, p.prompt_len, p.generated, p.max_new_tokens)
                    for p in backend.progress()]
            if board is not None:
                reports = _exchange_reports(r, board, rows, backend, done)
            else:
                # At the trigger a rank holds at most its own shard (nothing has migrated yet).
                reports = r.gather_rows(rows, 4, max(shards), "progress reports at the trigger")
            stats["reports_s"] = time.perf_counter() - t0
            progress = {i: moving(SampleProgress(*x) for x in rep)
                        for i, rep in enumerate(reports)}
            assignment = assign_migration(progress, m, bs_max=bs_max,
                                          kv_capacity_tokens=config.kv_capacity_tokens)
            if config.mechanism == "auto":
                kv_tokens = {s.sample_id: s.kv_tokens for ss in progress.values() for s in ss}
                mechanism = _auto_mechanism(
                    max((sum(kv_tokens[i] for ids in assignment.incoming(d).values()
                             for i in ids) for d in assignment.destinations), default=0),
                    backend, config, kv_ok)
            # The plan; what moved is what the sources sent (below, after the final exchange).
            stats["planned"] = assignment.moved_ids
        stats.update(destinations=assignment.destinations, mechanism=mechanism,
                     plan_s=time.perf_counter() - t0)
        incoming: _Incoming | None = None
        if board is None:
            settle = _migrate(r, backend, assignment, mechanism, stats)
        else:
            settle, incoming = _migrate_shared(r, backend, assignment, mechanism, board, stats)
        # An engine may finish a sample between the report and the export (vLLM): it got no
        # ticket, so this rank must still collect it.
        if r.rank not in assignment.destinations:
            while backend.unfinished():
                done.extend(backend.step())
        stats["migration_end_s"] = time.perf_counter() - t0
        note_stage("streaming and scoring", 1)
        with (r.store_errors("streaming finished samples") if board is None
              else contextlib.nullcontext()):
            results, exps = _stream(r, backend, inference, assignment.destinations, done, t0,
                                    stats, settle, board, incoming, early_exps)
    stats["local_end_s"] = time.perf_counter() - t0
    note_stage("assembling the experience batch", 1)
    # As columns (.experience_wire): the last rank to finish dumps it, every peer then loads
    # it, both on the rollout's critical path.
    msg = (pack_batch(results, exps), stats)
    wire = (r.gather(msg, "the experience batch") if board is None
            else _board_gather(r, board, msg, "the experience batch"))
    gathered = [(results, exps, stats) if k == r.rank else (*unpack_batch(pb), st)
                for k, (pb, st) in enumerate(wire)]
    if assignment is not None:
        # What moved is what each source sent, which every rank knows now: the plan's samples
        # that finished before their export stayed where they were (roles at the trigger name
        # no samples; the reports' plan can name one that finished while its rank decoded on).
        assignment = MigrationAssignment(
            assignment.destinations, assignment.freed,
            {g[2]["rank"]: dict(g[2]["sent"]) for g in gathered if g[2].get("sent")})
        for g in gathered:
            g[2]["moved"] = assignment.moved_ids
    all_results = assemble((x for g in gathered for x in g[0]), ids, "results")
    all_exps = (assemble((x for g in gathered for x in g[1]), ids, "experience batch")
                if inference is not None else None)
    assembled = time.perf_counter() - t0
    if board is not None:   # every rank has read this rank's progress report
        with contextlib.suppress(FileNotFoundError):
            os.unlink(board.mailbox(f"r{board.seq}.{r.rank}"))
        if r.rank == 0:     # and the counts of the trigger
            board.remove_trigger_claim()
    if r.rank == 0:
        for k in list(r._keys):
            try:
                r.store.delete_key(k)
            except Exception:
                pass  # best effort: the keys are namespaced per run anyway
    return RolloutOutput(all_results, all_exps, assignment, None,
                         {"ranks": [g[2] for g in gathered], "assembled_s": assembled,
                          "seconds": time.perf_counter() - t0})


def _auto_mechanism(tokens_in: float, backend: GenerationBackend, config: RolloutConfig,
                    kv_ok: bool) -> str:
    """The planner rule on the heaviest destination's ``tokens_in``: KV transfer vs re-prefill
    time."""
    mode, _ = choose_mechanism(
        tokens_in, kv_bytes_per_token=float(getattr(backend, "kv_bytes_per_token", 0.0)),
        bandwidth_bytes_s=config.bandwidth_bytes_s, latency_s=0.0,
        prefill_s_per_token=config.prefill_s_per_token, kv_supported=kv_ok)
    return mode


IDLE_POLL_MIN_S = 0.001
# A destination's longest wait for its incoming tickets before its first step after the plan,
# in decode steps (see _stream).
HANDOFF_WAIT_STEPS = 0.5
# The most whole micro-batches a destination hands the stream in one chunk while it generates
# (see _stream's share).
STREAM_CHUNK_MICRO_BATCHES = 2
IDLE_POLL_MAX_S = 0.008
HEARTBEAT_CHECK_S = 0.05
# The longest sleep between two checks of a rank waiting on the board for a peer (its file, its
# count), which has nothing else to do meanwhile: every rollout ends in such a wait (the
# all-gather of the experience batch), and the waiter finds its peer's file half a sleep late
# on average. A sleep overshoots by about 55 us on the 2-core VM (0.1 ms sleeps 0.15 ms, 0.5 ms
# sleeps 0.56 ms): at 0.5 ms the final exchange's waiter saw its peer's file ~0.3 ms late.
AWAIT_POLL_MAX_S = 1e-4


# The shared board of each process group this process rolls out in, set up by the group's
# first rollout (None: some rank cannot open it, the group uses the store). Keyed by the
# group object, kept alive here so that a group made after this one is destroyed never finds
# its board.
_BOARDS: dict[int, tuple[Any, SharedBoard | None]] = {}


def _shared_board(r: _Rank) -> SharedBoard | None:
    """This group's board, agreed on once (one store round trip and one all-gather): rank 0
    creates it, every other rank opens it, and all use it only if all could."""
    pg = r.group if r.group is not None else dist.group.WORLD
    hit = _BOARDS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    key = r.key("board")
    board: SharedBoard | None
    if r.rank == 0:
        board = SharedBoard.create(r.world, r.rank)
        r.store.set(key, board.path if board is not None else "")
    else:
        board = SharedBoard.attach(r.store.get(key).decode(), r.world, r.rank)
    shared = all(r.gather(board is not None, "whether every rank opened the shared board"))
    if board is not None:
        if r.rank == 0:
            board.unlink()
        if not shared:
            board.close()
            board = None
    if board is not None:   # a process's exchange files go with it (a killed one's: sweep)
        atexit.register(board.remove_last_message)
    _BOARDS[id(pg)] = (pg, board)
    return board


def _generate_until_trigger(r: _Rank, backend: GenerationBackend, rt: int,
                            done: list[SampleResult], board: SharedBoard | None,
                            roles: bool = False,
                            idle_work: Callable[[], bool] | None = None) -> None:
    """Decode until at most ``rt`` samples are left over all ranks. Every rank heartbeats
    while it waits here, and a peer whose heartbeat stops for ``timeout_s`` ends the wait with
    an error naming it: the trigger is set by whichever rank sees the total first, so without
    it a dead peer's count would hold every other rank here forever. On one host through the
    group's shared ``board`` (:mod:`.board`: no collective at the start; with ``roles``, the
    trigger carries the counts it was set on), else the store. ``idle_work``: called instead of
    sleeping while this rank has nothing left to decode (on the board); True if it did some."""
    if board is not None:
        note_stage("generation until the migration trigger", 1)
        _until_trigger_shared(r, backend, rt, done, board, roles, idle_work)
        return
    store = r.store
    published = len(backend.unfinished())
    store.set(r.key(f"unfinished/{r.rank}"), str(published))
    store.set(r.key(f"alive/{r.rank}"), "0")
    r.gather(None, "start of generation")  # every count key exists before anyone reads them
    note_stage("generation until the migration trigger", 1)
    _until_trigger_store(r, backend, rt, done, published)


def _until_trigger_shared(r: _Rank, backend: GenerationBackend, rt: int,
                          done: list[SampleResult], board: SharedBoard, roles: bool,
                          idle_work: Callable[[], bool] | None = None) -> None:
    """The one-host board: publish and check after every decode step (memory accesses)."""
    start, hb = time.perf_counter(), board.heartbeats()
    beats = {i: (hb[i], start) for i in range(r.world) if i != r.rank}
    next_check = 0.0
    idle = IDLE_POLL_MIN_S / 4
    while True:
        left = len(backend.unfinished())
        if left:
            _step(r, backend, done)
            left = len(backend.unfinished())
        elif idle_work is None or not idle_work():
            # Nothing to decode: the peers need the core more than a tight poll does.
            time.sleep(idle)
            idle = min(2 * idle, IDLE_POLL_MAX_S / 4)
        board.publish(left)
        if board.trigger() != NO_TRIGGER:
            return
        counts = board.counts()
        if should_trigger(sum(counts), rt):
            if roles:
                board.claim_trigger(counts)
            else:
                board.set_trigger()
            return
        now = time.perf_counter()
        if now >= next_check:
            _check_alive(r, beats, board.heartbeats(), now)
            next_check = now + HEARTBEAT_CHECK_S


def _roles_at_trigger(r: _Rank, backend: GenerationBackend, board: SharedBoard,
                      stats: dict[str, Any]) -> MigrationAssignment:
    """This rank's part of a one-destination plan, from the claim of the trigger
    (:meth:`.SharedBoard.claim_trigger`: the counts it was claimed on and the claimer). The
    destination is the rank with most samples left other than the claimer
    (:func:`~.planning.destination_at_trigger`): the claimer has just ended a decode step and
    exports at once, while its peer is usually in the middle of one and finds the tickets
    there when it ends. Every other rank with samples left sends all its unfinished samples
    there. Nothing else is needed: with one destination there is nothing to balance, and
    m = ceil(R_t·M/C) = 1 means it holds any R_t samples. So a source exports as soon as it
    sees the trigger, and the destination expects their tickets at once. The progress
    reports' exchange kept the migrated samples out of a whole decode step of the
    destination's (the rank that saw the trigger first stepped until its peer's report was
    there): on the demo's CPU the import came 6.5 ms after the trigger at the median, up to
    16, and 1.8 ms after it with roles at the trigger. A source whose samples all finished
    meanwhile sends an empty file, acknowledged as any other. Each source's stats say what it
    sent (``sent``); the final exchange tells every rank."""
    claim = board.trigger_claim()
    if claim is None:
        raise CoordinatorTimeout(f"rank {r.rank}: the migration trigger is set without the "
                                 "counts it was set on; every rank of a rollout must run the "
                                 "same rlhf-fusion version")
    counts, claimer = claim
    stats["trigger_claim"] = (counts, claimer)
    dests = [destination_at_trigger(counts, claimer)]
    sources = [i for i, n in enumerate(counts) if n > 0 and i not in dests]
    ids = backend.unfinished() if r.rank in sources else []
    return MigrationAssignment(
        destinations=dests, freed=[i for i in range(r.world) if i not in dests],
        moves={s: {d: list(ids) if s == r.rank else [] for d in dests} for s in sources})


def _score_while_idle(inference: InferenceModels, done: list[SampleResult],
                      early_exps: list[Experience], stats: dict[str, Any], t0: float
                      ) -> Callable[[], bool]:
    """Work for a rank whose shard has finished before the trigger: it scores its own finished
    samples, one whole micro-batch a call, between its checks of the board, instead of idling
    until a peer's count brings the total down to R_t. Such a rank has no sample to send and
    becomes a freed rank at the trigger, which scores its own samples first anyway; the
    trigger is seen at most one scoring call late, and with one destination on one host
    (roles at the trigger) no peer waits for this rank then. Measured on the GRPO demo (2
    ranks, session 56): a quarter of the fused rollouts had one rank idle 1-6.6 ms there, the
    start skew and unequal core speeds leaving its short completions done early. The serial
    rollout idles at its end-of-generation barrier instead; this is overlap too."""
    micro = inference.micro_batch

    def work() -> bool:
        batch = done[len(early_exps): len(early_exps) + micro]
        if len(batch) < micro:   # whole micro-batches: the rest goes with the stream's
            return False
        stats.setdefault("inference_start_s", time.perf_counter() - t0)
        stats["scoring_batches"] = stats.get("scoring_batches", 0) + 1
        early_exps.extend(inference.score(batch))   # one experience per sample, in order
        return True

    return work


def _step(r: _Rank, backend: GenerationBackend, done: list[SampleResult]) -> None:
    t = time.perf_counter()
    done.extend(backend.step())
    r.steps_s.append(time.perf_counter() - t)


def _until_trigger_store(r: _Rank, backend: GenerationBackend, rt: int,
                         done: list[SampleResult], published: int) -> None:
    """Ranks on several hosts: counts and heartbeats in the c10d store, read every
    ``report_every`` steps (each read is a round trip to rank 0's process)."""
    store = r.store
    mine = r.key(f"unfinished/{r.rank}")
    keys = [r.key(f"unfinished/{i}") for i in range(r.world)]
    alive = [r.key(f"alive/{i}") for i in range(r.world)]
    trigger = r.key("trigger")
    beats = {i: ("0", time.perf_counter()) for i in range(r.world) if i != r.rank}
    last_hb = time.perf_counter()
    steps = 0
    idle = IDLE_POLL_MIN_S
    while True:
        left = len(backend.unfinished())
        if left:
            done.extend(backend.step())
            steps += 1
            left = len(backend.unfinished())
            if steps % r.cfg.report_every and left:
                continue
        else:
            # Nothing to decode: idle until the trigger. Back off as _stream does: each poll
            # is store requests that rank 0's process serves, on the cores the decoding
            # ranks need.
            time.sleep(idle)
            idle = min(2 * idle, IDLE_POLL_MAX_S)
        if left != published:
            store.set(mine, str(left))
            published = left
        now = time.perf_counter()
        if now - last_hb >= r.cfg.heartbeat_s:
            store.add(alive[r.rank], 1)
            last_hb = now
        if store.check([trigger]):
            return
        values = store.multi_get(keys + alive)
        total = sum(int(v) for v in values[: r.world])
        if should_trigger(total, rt):
            store.set(trigger, str(r.rank))
            return
        _check_alive(r, beats, values[r.world:], now)


def _check_alive(r: _Rank, beats: dict[int, tuple[Any, float]], counts: Any, now: float,
                 doing: str = "waiting for the migration trigger") -> None:
    """``beats``: per watched rank, its last heartbeat count and since when; ``counts``: the
    counts now, indexed by rank."""
    for i, (last, since) in beats.items():
        if counts[i] != last:
            beats[i] = (counts[i], now)
        elif now - since > r.cfg.timeout_s:
            raise CoordinatorTimeout(
                f"rank {r.rank}: generation rank {i} sent no heartbeat for {now - since:.1f}s "
                f"(timeout {r.cfg.timeout_s:g}s) while {doing}; rank {i} died or hung")


def _migrate(r: _Rank, backend: GenerationBackend, plan: MigrationAssignment,
             mechanism: str, stats: dict[str, Any]) -> Callable[[], None]:
    """Send this rank's moving samples and import the ones sent to it (``stats["sent"]``:
    the ids sent to each destination). Returns ``settle``:
    the waits for the destinations' acknowledgements. A source
    calls it once it has scored its own finished samples, not before: waiting for the
    acknowledgement first would hold its scoring back by the destination's import, on the
    critical path of a short rollout; a destination that died still fails the source with a
    ``MigrationError`` within the timeout."""
    sends = []
    mine = plan.moves.get(r.rank, {})
    for dst, ids in sorted(mine.items()):
        tickets = backend.export_samples(ids, mode=mechanism)  # type: ignore[arg-type]
        stats.setdefault("sent", {})[dst] = [t.sample_id for t in tickets]
        ints, floats = pack_tickets(tickets)
        hdr = header(0, len(tickets), ints, floats)
        what = (f"sending {len(ids)} migrated samples to destination rank {dst}, which must "
                "receive and acknowledge them")
        sends.append((dist.isend(hdr, r.members[dst], tag=_TAG_TICKETS), hdr, what, dst))
        sends += _send_body(r, dst, ints, floats, what)
    if r.rank in plan.destinations:
        for src in plan.incoming(r.rank):
            hdr = torch.zeros(4, dtype=torch.int64)
            r.wait(dist.irecv(hdr, r.members[src], tag=_TAG_TICKETS), "receiving migrated samples",
                   src, MigrationError)
            r.fault("tickets_received", src)
            _, n, n_int, n_flt = hdr.tolist()
            ints, floats = _recv_body(r, src, n_int, n_flt, "receiving migrated samples")
            tickets = unpack_tickets(n, ints, floats)
            backend.import_samples(tickets)
            ack = torch.tensor([len(tickets)], dtype=torch.int64)
            sends.append((dist.isend(ack, r.members[src], tag=_TAG_ACK), ack,
                          f"acknowledging {len(tickets)} migrated samples to source rank {src}",
                          src))
    acks = []
    for dst, ids in sorted(mine.items()):
        ack = torch.zeros(1, dtype=torch.int64)
        acks.append((dist.irecv(ack, r.members[dst], tag=_TAG_ACK), ack, dst, len(ids)))
    # The sends complete now, though: gloo moves the bytes on a thread of this process, which
    # a source that went on to score would starve (7 ms for 0.6 MB of KV measured, on the
    # destination's critical path).
    for work, _, what, peer in sends:
        r.wait(work, what, peer, MigrationError)

    def settle() -> None:
        for work, _, dst, n in acks:
            r.wait(work, f"waiting for destination rank {dst} to acknowledge {n} migrated "
                   "samples", dst, MigrationError)

    return settle


def _send_body(r: _Rank, dst: int, ints: torch.Tensor, floats: torch.Tensor, what: str
               ) -> list[tuple[Any, torch.Tensor, str, int]]:
    """Post the sends of a ticket header's body (ints, then floats) over gloo."""
    return [(dist.isend(t, r.members[dst], tag=_TAG_TICKETS + off), t, what, dst)
            for off, t in ((1, ints), (2, floats)) if t.numel()]


def _recv_body(r: _Rank, src: int, n_int: int, n_flt: int, what: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive what :func:`_send_body` sent, sized by the header."""
    ints = torch.zeros(n_int, dtype=torch.int64)
    floats = torch.zeros(n_flt, dtype=torch.float64)
    for off, t in ((1, ints), (2, floats)):
        if t.numel():
            r.wait(dist.irecv(t, r.members[src], tag=_TAG_TICKETS + off), what, src,
                   MigrationError)
    return ints, floats


# Tickets larger than this, or than half of what /dev/shm has free, go over gloo even on one
# host (the file then holds only their header): a KV cache can be gigabytes, and /dev/shm is
# often small (64 MB by default in a Docker container).
SHM_TICKET_MAX_BYTES = 1 << 30
_IN_FILE, _OVER_GLOO = 0, 1


def _migrate_shared(r: _Rank, backend: GenerationBackend, plan: MigrationAssignment,
                    mechanism: str, board: SharedBoard, stats: dict[str, Any]
                    ) -> Callable[[], None]:
    """:func:`_migrate` for ranks on one host: each source writes its tickets for a
    destination to a file beside the board (renamed into place, so it appears whole), the
    destination reads it and renames it ``.ack``, its acknowledgement. No gloo round trips:
    their wake-ups took 0.3 ms at the median and 4 ms at the 90th percentile here, several
    per migration, on the long tail's critical path. A peer whose process is gone is noticed
    at once (the board's pids); one that hangs, after ``timeout_s``. Tickets too large for
    /dev/shm go over gloo, announced by a header-only file."""
    sent = []
    sends = []
    for dst, ids in sorted(plan.moves.get(r.rank, {}).items()):
        tickets = backend.export_samples(ids, mode=mechanism)  # type: ignore[arg-type]
        stats.setdefault("sent", {})[dst] = [t.sample_id for t in tickets]
        # In parts: the KV block goes into the file as export gathered it.
        ints, parts = pack_ticket_parts(tickets)
        path = board.mailbox(f"m{board.seq}.{r.rank}.{dst}")
        n_flt = sum(t.numel() for t in parts)
        kind = _IN_FILE if _fits_in_shm(path, 8 * (4 + ints.numel() + n_flt)) else _OVER_GLOO
        try:
            _write_whole(path, header(kind, len(tickets), ints, parts),
                         *((ints, *parts) if kind == _IN_FILE else ()))
        except OSError:   # /dev/shm filled up meanwhile
            kind = _OVER_GLOO
            _write_whole(path, header(kind, len(tickets), ints, parts))
        if kind == _OVER_GLOO:
            sends += _send_body(r, dst, ints, torch.cat(parts),
                                "sending migrated samples over gloo (too large for /dev/shm)")
        stats.setdefault("tickets", []).append("file" if kind == _IN_FILE else "gloo")
        sent.append((path, dst, len(ids)))
    for work, _, what, peer in sends:   # as in _migrate: before scoring, or they starve
        r.wait(work, what, peer, MigrationError)
    incoming = (_Incoming(r, backend, board, plan.incoming(r.rank))
                if r.rank in plan.destinations else None)

    def settle() -> None:
        try:
            for path, dst, n in sent:
                _await_file(r, board, path + ".ack", dst,
                            f"waiting for destination rank {dst} to acknowledge {n} migrated "
                            "samples")
                os.unlink(path + ".ack")
        finally:
            for path, _, _ in sent:   # a dead destination's unread tickets
                for p in (path, path + ".part"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)

    return settle, incoming


def _micro_batches(samples: int, inference: InferenceModels | None) -> int:
    """The scoring forwards ``samples`` samples take (``InferenceModels.score`` splits)."""
    return -(-samples // inference.micro_batch) if inference is not None else 0


def _view(buf: bytearray, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` items of ``buf`` from byte ``offset`` on, without a copy (empty: an empty
    tensor, which ``frombuffer`` refuses to make)."""
    return (torch.frombuffer(buf, dtype=dtype, offset=offset, count=count) if count > 0
            else torch.empty(0, dtype=dtype))


class _Incoming:
    """A destination's tickets still to come, one file per source. The destination goes on
    decoding its own samples and imports each file between two decode steps once it is there
    (:meth:`poll`), instead of idling until the source has exported and written it: on a
    short tail that wait was a decode step or more of the destination's, on the critical
    path. It blocks only when it has nothing left to decode (``poll(block=True)``), and
    before its first step after the plan waits at most ``HANDOFF_WAIT_STEPS`` of a step
    (:meth:`wait`): tickets a fraction of a step away then join that step."""

    def __init__(self, r: _Rank, backend: GenerationBackend, board: SharedBoard,
                 sources: Sequence[int]) -> None:
        self.r, self.backend, self.board = r, backend, board
        self.pending = list(sources)

    def _path(self, src: int) -> str:
        return self.board.mailbox(f"m{self.board.seq}.{src}.{self.r.rank}")

    def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every pending file (a peer's death shows as a timeout
        here; :meth:`poll` then notices it)."""
        end = time.perf_counter() + seconds
        paths = [self._path(src) for src in self.pending]
        while time.perf_counter() < end and not all(os.path.exists(p) for p in paths):
            time.sleep(2e-5)

    def poll(self, block: bool = False) -> None:
        r, board = self.r, self.board
        for src in list(self.pending):
            path = self._path(src)
            if block:
                _await_file(r, board, path, src,
                            f"receiving migrated samples from source rank {src}")
            elif not os.path.exists(path):
                continue
            r.fault("tickets_received", src)
            data = _read_whole(path)
            kind, n, n_int, n_flt = torch.frombuffer(data, dtype=torch.int64,
                                                     count=4).tolist()
            if kind == _OVER_GLOO:
                ints, floats = _recv_body(r, src, n_int, n_flt,
                                          "receiving migrated samples over gloo")
            else:
                have = max(len(data) - 32 - 8 * n_int, 0) // 8
                ints = _view(data, 32, min(n_int, (len(data) - 32) // 8), torch.int64)
                floats = _view(data, 32 + 8 * n_int, have, torch.float64)
            if floats.numel() != n_flt or ints.numel() != n_int:
                raise MigrationError(f"rank {r.rank}: the tickets from source rank {src} hold "
                                     f"{ints.numel()} ints and {floats.numel()} floats, their "
                                     f"header says {n_int} and {n_flt}")
            os.rename(path, path + ".ack")
            self.backend.import_samples(unpack_tickets(n, ints, floats))
            self.pending.remove(src)


def _fits_in_shm(path: str, nbytes: int) -> bool:
    st = os.statvfs(os.path.dirname(path))
    return nbytes <= min(SHM_TICKET_MAX_BYTES, st.f_bavail * st.f_frsize // 2)


def _read_whole(path: str) -> bytearray:
    """The file's bytes, read straight into one buffer that tensors can share (``read()``
    and a ``bytearray`` of it were two copies into freshly faulted pages: 0.48 ms for the
    demo's 464 KB of tickets against 0.05 ms, on the destination's path to its tail)."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        view, got = memoryview(data), 0
        while got < len(data):
            n = f.readinto(view[got:])
            if not n:
                break   # (the file is written whole before it appears: not reached)
            got += n
    return data


def _write_whole(path: str, *tensors: torch.Tensor) -> None:
    """``path`` appears whole or not at all (written aside, then renamed)."""
    try:
        with open(path + ".part", "wb") as f:
            for t in tensors:
                f.write(t.contiguous().numpy())   # the buffer itself, not a bytes copy
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".part")
        raise
    os.rename(path + ".part", path)


def _exchange_reports(r: _Rank, board: SharedBoard, rows: Sequence[tuple[int, ...]],
                      backend: GenerationBackend, done: list[SampleResult]
                      ) -> list[list[tuple[int, ...]]]:
    """Every rank's progress rows at the trigger, through files beside the board (written
    whole and renamed into place, as the migration's): no gloo wake-ups. ``run_rollout``
    removes this rank's file after the final all-gather, when every peer has read it.

    A rank that sees the trigger while a peer is still in its decode step goes on decoding
    until the peer's report is there (a step, 2-3 ms on the demo's CPU, was this rank's idle
    time): whether it turns out a source or a destination, its samples get nearer their end.
    A sample the plan moves that finishes meanwhile stays here: its source exports only
    unfinished samples (``export_samples`` skips the others), so none is lost or doubled, and
    ``run_rollout`` reports as moved what the sources sent, not the plan."""
    own = board.mailbox(f"r{board.seq}.{r.rank}")
    r.fault("progress_report", r.rank)
    _write_whole(own, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4))
    out = []
    for i in range(r.world):
        path = board.mailbox(f"r{board.seq}.{i}")
        while not os.path.exists(path) and backend.unfinished():
            _step(r, backend, done)
        _await_file(r, board, path, i, "waiting for its progress report at the trigger",
                    CoordinatorTimeout)
        with open(path, "rb") as f:
            data = f.read()
        out.append([tuple(x) for x in torch.frombuffer(bytearray(data), dtype=torch.int64)
                    .reshape(-1, 4).tolist()] if data else [])
    return out


def _board_barrier(r: _Rank, board: SharedBoard, what: str) -> None:
    """Every rank of the group has reached this point of this rollout: each sets its done
    word and waits for the others' (memory reads; a gloo barrier's wake-ups cost 1 ms at the
    median and 4 ms at the 90th percentile here). A peer whose process is gone fails the wait
    at once, one that hangs after ``timeout_s``."""
    board.set_done()
    for peer in range(r.world):
        _await(r, board, peer, lambda p=peer: board.done(p) is not None, what,
               CoordinatorTimeout)


def _board_counts_barrier(r: _Rank, board: SharedBoard, what: str) -> None:
    """:func:`_board_barrier` through the unfinished counts: each rank publishes 0 and waits
    for every peer's 0 in this rollout. A count stays 0 until the peer's next rollout, which
    it cannot reach before this rank's final exchange, so no reader misses it."""
    board.publish(0)
    for peer in range(r.world):
        _await(r, board, peer, lambda p=peer: board.counts()[p] == 0, what,
               CoordinatorTimeout)


def _board_gather(r: _Rank, board: SharedBoard, obj: Any, what: str) -> list[Any]:
    """``all_gather_object`` through files beside the board: each rank writes its pickle
    whole (renamed into place) and reads every peer's. A rank removes its file of the
    previous rollout here: a peer that wrote this rollout's file has read that one."""
    own = board.mailbox(f"x{board.seq}.{r.rank}")
    with open(own + ".part", "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.rename(own + ".part", own)
    out = []
    for peer in range(r.world):
        path = board.mailbox(f"x{board.seq}.{peer}")
        if peer != r.rank:
            _await_file(r, board, path, peer, f"all-gather of {what}", CoordinatorTimeout)
        with open(path, "rb") as f:
            out.append(obj if peer == r.rank else pickle.load(f))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(board.mailbox(f"x{board.seq - 1}.{r.rank}"))
    board.last_message = own
    return out


def _await(r: _Rank, board: SharedBoard, peer: int, ready: Callable[[], bool], what: str,
           exc_type: type[RolloutError]) -> None:
    """Poll ``ready`` (backing off to ``AWAIT_POLL_MAX_S``) until it holds; a ``peer`` whose
    process is gone fails the wait at once, one that hangs after ``timeout_s``."""
    deadline = time.perf_counter() + r.cfg.timeout_s
    idle = 2e-5
    while not ready():
        if not board.alive(peer):
            raise exc_type(f"rank {r.rank}: {what} (peer rank {peer}) failed: its process "
                           f"is gone; rank {peer} died or hung")
        if time.perf_counter() > deadline:
            raise exc_type(f"rank {r.rank}: {what} (peer rank {peer}) failed within the "
                           f"{r.cfg.timeout_s:g}s timeout; rank {peer} died or hung")
        time.sleep(idle)
        idle = min(2 * idle, AWAIT_POLL_MAX_S)


def _await_file(r: _Rank, board: SharedBoard, path: str, peer: int, what: str,
                exc_type: type[RolloutError] = MigrationError) -> None:
    _await(r, board, peer, lambda: os.path.exists(path), what, exc_type)


def _stream(r: _Rank, backend: GenerationBackend, inference: InferenceModels | None,
            destinations: Sequence[int], done: list[SampleResult], t0: float,
            stats: dict[str, Any], settle: Callable[[], None], board: SharedBoard | None,
            incoming: _Incoming | None = None, scored: Sequence[Experience] = ()
            ) -> tuple[list[SampleResult], list[Experience]]:
    """Score this rank's finished samples and the stream's; ``scored``: the experiences of
    ``done[:len(scored)]``, scored before the trigger (:func:`_score_while_idle`)."""
    chan: _StoreStream | _BoardStream = (_StoreStream(r) if board is None
                                         else _BoardStream(r, board, destinations))
    micro = inference.micro_batch if inference is not None else 64
    exps: list[Experience] = list(scored)
    own = done[len(scored):]   # this rank's finished samples still to score
    results: list[SampleResult] = []
    # Samples waiting for a whole micro-batch: a scoring call of a partial one costs nearly a
    # whole one's time on a small model (its cost is mostly per call), and the stream's
    # chunks and a rank's own share rarely come in multiples of ``micro``: scored as they
    # came, the fused rollout made 5% more scoring calls than the serial one. Each rank scores
    # at most one partial micro-batch, at its end.
    carry: list[SampleResult] = []

    def score(samples: Sequence[SampleResult], final: bool = False) -> None:
        carry.extend(samples)
        n = len(carry) if final else len(carry) // micro * micro
        if not n:
            return
        batch = carry[:n]
        del carry[:n]
        stats.setdefault("inference_start_s", time.perf_counter() - t0)
        stats["scoring_batches"] = stats.get("scoring_batches", 0) + _micro_batches(n, inference)
        if inference is not None:
            exps.extend(inference.score(batch))

    # A destination's finished samples, not yet scored here or handed to the stream.
    backlog: list[SampleResult] = []

    def share(generating: bool) -> None:
        # Whole micro-batches only while generating: a consumer scores what one pop brings, so
        # a chunk of the one or two samples a decode step finishes would cost a forward of its
        # own (0.46 ms a sample streamed that way vs 0.37 in whole micro-batches, measured).
        # On one host a chunk is written only when a consumer has run out of its own samples
        # and fewer than two of this rank's chunks wait for it (``chan.wants``): every chunk is a
        # file written, renamed, read and removed (0.1-0.2 ms), and a destination pushing its
        # whole backlog at the trigger held its share of the tail back by milliseconds.
        # While generating, up to STREAM_CHUNK_MICRO_BATCHES whole micro-batches a chunk: every
        # push and pop sits on a critical path (the destination's tail, the freed rank's
        # scoring), and the end of the stream, where a coarse chunk would leave one rank idle
        # while another scores, comes after the generation.
        while backlog and (len(backlog) >= micro or not generating) and chan.wants():
            size = (micro * min(STREAM_CHUNK_MICRO_BATCHES, len(backlog) // micro) if generating
                    else micro)
            chunk = backlog[:size]
            del backlog[:size]
            chan.push(pickle.dumps(chunk))
            stats.setdefault("stream_chunks", []).append(len(chunk))

    if r.rank in destinations:
        results.extend(done)
        backlog.extend(own)
        last_hb = 0.0
        steps = 0
        if incoming is not None and incoming.pending and backend.unfinished():
            # The sources export as soon as they have the reports, as this rank has now: their
            # tickets are usually a fraction of a step away. Started now, a step would keep
            # the migrated samples out for all of it (2.4 ms at the median on the demo's CPU)
            # and they hold half of the tail's longest samples; waiting costs this rank's own
            # samples the wait. Half a step at most: past it the step is the better bet.
            incoming.wait(HANDOFF_WAIT_STEPS * (statistics.median(r.steps_s) if r.steps_s
                                                else 0.0))
        while True:
            if incoming is not None and incoming.pending:
                incoming.poll(block=not backend.unfinished())
                if not incoming.pending:
                    stats["imported_s"] = time.perf_counter() - t0
            # (not generating at all: a serial rollout balancing its scoring, whose chunks
            # stay one micro-batch)
            generating = bool(backend.unfinished())
            share(generating=generating)
            if not generating:
                break
            finished = backend.step()
            results.extend(finished)
            backlog.extend(finished)
            steps += 1
            r.fault("streaming_step", steps)
            now = time.perf_counter()
            if now - last_hb >= r.cfg.heartbeat_s:
                chan.beat()
                last_hb = now
        # (a serial rollout balancing its scoring ended generation before its barrier)
        stats.setdefault("generation_end_s", time.perf_counter() - t0)
        # Its generation over, a destination scores its backlog itself, a micro-batch at a
        # time, handing one to a consumer whenever one wants it (share); then, done, it takes
        # from the stream like every rank.
        while True:
            share(generating=False)
            if not backlog:
                break
            if len(backlog) <= 2 * micro:
                # Hungry two micro-batches before its end, as a freed rank is: another
                # destination still scoring (or generating) hands it a chunk meanwhile.
                chan.hungry()
            score(backlog[:micro])
            del backlog[:micro]
            chan.beat()
        chan.finish()
    else:
        # A freed rank scores its own finished samples first, where they are: only it can,
        # without a push and a pop for each chunk. The destinations' samples wait in the
        # stream for whichever rank is free first, a destination whose generation has ended
        # included.
        results.extend(done)
        stats["generation_end_s"] = stats.get("trigger_s")
        if own:
            # Hungry two micro-batches before the end of its own samples: the destinations
            # check between their decode steps and scoring calls, so the first chunk is
            # there when this rank needs it.
            cut = max(len(own) - 2 * micro, 0) // micro * micro
            score(own[:cut])
            chan.hungry()
            score(own[cut:])
            stats["own_scored_s"] = time.perf_counter() - t0
    settle()
    chan.hungry()   # from here on this rank scores only what the stream brings
    # Consume the shared stream until every destination is done and the stream is empty.
    beats: dict[int, tuple[Any, float]] = {
        d: (-1, time.perf_counter()) for d in destinations if d != r.rank}
    # An idle consumer backs off (doubling up to a cap) and checks heartbeats every
    # HEARTBEAT_CHECK_S: through the store every poll is requests that rank 0's process
    # serves, on the cores the decoding ranks need.
    idle = chan.idle_min
    next_beat_check = 0.0
    while True:
        got = False
        while len(carry) < micro and (item := chan.pop()) is not None:
            carry.extend(pickle.loads(item))
            got = True
        if got:
            idle = chan.idle_min
            score(())
            continue
        if chan.over(destinations):
            break
        now = time.perf_counter()
        if now >= next_beat_check:
            chan.check(beats)
            next_beat_check = now + HEARTBEAT_CHECK_S
        time.sleep(idle)
        idle = min(2 * idle, chan.idle_max)
    score((), final=True)
    stats.setdefault("inference_start_s", None)
    stats.setdefault("scoring_batches", 0)
    stats["scored"] = len(exps)
    return results, exps


class _StoreStream:
    """The stream through the c10d store (ranks on several hosts): one queue, a heartbeat and
    a generation-done counter, per-rollout keys that rank 0 deletes at the end."""

    idle_min, idle_max = IDLE_POLL_MIN_S, IDLE_POLL_MAX_S

    def __init__(self, r: _Rank) -> None:
        self.r = r
        self.queue = r.key("stream")
        self.gen_done = r.key("generation_done")

    def push(self, item: bytes) -> None:
        self.r.store.queue_push(self.queue, item)

    def wants(self) -> bool:
        # Across hosts every whole chunk goes out as it is ready: asking whether a consumer
        # is idle would be a store round trip per decode step.
        return True

    def hungry(self) -> None:
        pass

    def pop(self) -> bytes | None:
        try:
            return self.r.store.queue_pop(self.queue, False)
        except dist.QueueEmptyError:
            return None

    def beat(self) -> None:
        self.r.store.add(self.r.key(f"heartbeat/{self.r.rank}"), 1)

    def finish(self) -> None:
        self.r.store.add(self.gen_done, 1)

    def over(self, destinations: Sequence[int]) -> bool:
        return (int(self.r.store.add(self.gen_done, 0)) >= len(destinations)
                and self.r.store.queue_len(self.queue) == 0)

    def check(self, beats: dict[int, tuple[Any, float]]) -> None:
        r = self.r
        counts = {d: int(r.store.add(r.key(f"heartbeat/{d}"), 0)) for d in beats}
        _check_alive(r, beats, counts, time.perf_counter(),
                     f"rank {r.rank} waited for its streamed samples")


class _BoardStream:
    """The stream on one host: a destination writes chunk ``k`` to a file beside the board
    (renamed into place) and counts it on the board; a consumer claims a chunk by renaming
    its file (one rename wins), reads and removes it. No store round trips, nothing served by
    rank 0's process (0.1-0.2 ms a push or a pop, and more while rank 0 scores). A chunk a
    destination counted whose file is gone was claimed by another consumer."""

    idle_min, idle_max = IDLE_POLL_MIN_S / 8, IDLE_POLL_MAX_S / 8

    def __init__(self, r: _Rank, board: SharedBoard, destinations: Sequence[int]) -> None:
        self.r = r
        self.board = board
        self.written = 0
        self.claimed = 0   # this rank's chunks known to be claimed (in order)
        self.next = {d: 0 for d in destinations}   # the next chunk to try, per destination

    def _path(self, d: int, k: int) -> str:
        return self.board.mailbox(f"q{self.board.seq}.{d}.{k}")

    def push(self, item: bytes) -> None:
        path = self._path(self.r.rank, self.written)
        with open(path + ".part", "wb") as f:
            f.write(item)
        os.rename(path + ".part", path)
        self.written += 1
        self.board.set_pushed(self.written)

    # Chunks a destination keeps waiting for hungry consumers: one that a consumer takes
    # while it scores another, so it never waits for the destination's next check.
    AHEAD = 2

    def wants(self) -> bool:
        """Whether a consumer has run out of its own samples and fewer than :attr:`AHEAD` of
        this rank's chunks wait unclaimed (a claim renames the chunk's file away)."""
        if not self.board.any_hungry():   # (memory reads; the claims below are file checks)
            return False
        while self.claimed < self.written and not os.path.exists(
                self._path(self.r.rank, self.claimed)):
            self.claimed += 1
        return self.written - self.claimed < self.AHEAD

    def hungry(self) -> None:
        self.board.set_hungry()

    def pop(self) -> bytes | None:
        for d in self.next:
            item = self._pop_from(d)
            if item is not None:
                return item
        return None

    def _pop_from(self, d: int) -> bytes | None:
        while self.next[d] < self.board.pushed(d):
            path = self._path(d, self.next[d])
            self.next[d] += 1
            mine = f"{path}.c{self.r.rank}"
            try:
                os.rename(path, mine)
            except FileNotFoundError:
                continue   # another consumer claimed it
            with open(mine, "rb") as f:
                item = f.read()
            os.unlink(mine)
            return item
        return None

    def beat(self) -> None:
        self.board.beat()

    def finish(self) -> None:
        self.board.set_done(self.written)

    def over(self, destinations: Sequence[int]) -> bool:
        for d in destinations:
            total = self.board.done(d)
            if total is None or self.next[d] < total:
                return False
        return True

    def check(self, beats: dict[int, tuple[Any, float]]) -> None:
        r = self.r
        for d in [d for d in beats if self.board.done(d) is not None]:
            del beats[d]   # its generation is over: nothing more to watch
        for d in beats:
            if not self.board.alive(d):
                raise CoordinatorTimeout(
                    f"rank {r.rank}: generation rank {d} sent no heartbeat: its process is "
                    f"gone while rank {r.rank} waited for its streamed samples; rank {d} died")
        _check_alive(r, beats, self.board.heartbeats(), time.perf_counter(),
                     f"rank {r.rank} waited for its streamed samples")


