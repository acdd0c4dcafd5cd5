"""Checkpoints at iteration boundaries: each rank saves and restores its own share.

A rank's share is what only it holds: its training stages, its optimizers' state, and the
loop's own state (iteration index, the R_t planner's observations, the metric history). The
generation and inference copies are not saved: the next iteration starts with a weight sync
that rebuilds them from the training stages, and sampling is keyed on (seed, iteration,
sample), so a resumed run repeats exactly what the uninterrupted run would have done.

On disk, ``OUT/checkpoints/iter_NNNNN/`` holds ``rank{r}.pt`` for every rank and ``COMPLETE``
(JSON: iteration, world size, each file's size, which ranks' roles another rank's file
holds), and is written atomically, by rank 0 alone: the other ranks stream it
:func:`torch.save`'s bytes of their shares one rank at a time, in chunks of
:data:`CHUNK_BYTES` that go straight into the files (so OUT need not be shared between
nodes, and rank 0 holds one chunk of another rank's share at a time, whatever the share's
size or device: ``torch.save`` brings one storage at a time to the CPU). Replicas save one
copy: a rank whose piece of a role a lower rank holds too (:func:`shard_keys`) saves
``same_as`` instead. Rank 0 writes each file as ``rank{r}.pt.tmp`` inside
``iter_NNNNN.partial/`` and renames it, then writes ``COMPLETE`` and renames the folder. A
folder without the marker, or whose files do not match it, is never resumed from. Resuming,
rank 0 streams each rank its file (and the files its replicas' roles are in), loaded on the
CPU. A rank whose launcher died writes nothing (:func:`rlhf_fusion.launch.orphaned`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..rollout.planning.lengths import LengthDistribution
from ..rollout.rt_control import SCORING_WINDOW
from .errors import LoopConfigError


def worker_state(worker: Any, history: list[dict[str, float]]) -> dict[str, Any]:
    """This rank's share of the run (see the module docstring), as one picklable dict."""
    planner = worker.rt_planner
    kl = getattr(worker, "kl", None)   # (a stand-in worker may have no KL controller)
    return {
        "iteration": worker.iteration_index,
        "world_size": worker.world,
        "rank": worker.rank,
        "models": {r: m.state_dict() for r, m in worker.training_modules().items()},
        "optimizers": {r: o.state_dict() for r, o in worker.optimizers.items()},
        # Plain lists only: Lightning loads checkpoints with torch.load(weights_only=True).
        "rt_planner": {"dist": None if planner.dist is None else
                       (planner.dist.lengths.tolist(), planner.dist.weights.tolist()),
                       "by_batch": dict(planner.by_batch),
                       "scoring": [[list(c) for c in b] for b in planner.scoring],
                       "current": planner.current,
                       "history": planner.history, "prompt_len": planner.prompt_len,
                       "prefills": [list(x) for x in planner.prefills],
                       "sweeps": [planner.sweeps, planner._interval, planner._skip],
                       "rollout_s": planner.rollout_s},
        # the KL coefficient an adaptive controller has reached (fixed: the configured one)
        "kl_ctrl": kl.state_dict() if kl is not None else None,
        "history": history,
    }


def load_worker(worker: Any, path: str | Path) -> list[dict[str, float]]:
    """Restore the share in the checkpoint file ``path`` (a role saved ``same_as`` another
    rank is read from that rank's file beside it); returns the metric history."""
    path = Path(path)
    ck = torch.load(path, map_location="cpu", weights_only=False)
    return load_worker_state(worker, _with_replicas(
        ck, lambda q: torch.load(path.with_name(f"rank{q}.pt"), map_location="cpu",
                                 weights_only=False)), str(path))


def load_worker_state(worker: Any, ck: dict[str, Any], where: str = "checkpoint"
                      ) -> list[dict[str, float]]:
    if ck["world_size"] != worker.world or ck["rank"] != worker.rank:
        raise LoopConfigError(f"{where}: saved by rank {ck['rank']} of {ck['world_size']}; "
                              f"this is rank {worker.rank} of {worker.world}: resume with the "
                              "same world_size")
    for role, module in worker.training_modules().items():
        module.load_state_dict(ck["models"][role])
    for role, opt in worker.optimizers.items():
        opt.load_state_dict(ck["optimizers"][role])
    planner = worker.rt_planner
    st = ck["rt_planner"]
    planner.dist = None if st["dist"] is None else LengthDistribution(*st["dist"])
    planner.by_batch.clear()
    planner.by_batch.update(st["by_batch"])
    # (older checkpoints kept (tokens, seconds) per batch or per call, which the fit of a cost
    # per sample cannot use: the window refills from the next batches)
    planner.scoring = [[tuple(c) for c in b] for b in st["scoring"]
                       if all(isinstance(c, list | tuple) and len(c) == 3 for c in b)
                       ][-SCORING_WINDOW:]
    planner.current = st["current"]
    planner.history = list(st["history"])
    planner.prompt_len = st["prompt_len"]
    # (older checkpoints: no prefill fit, and a sweep at the first iteration)
    planner.prefills = [tuple(x) for x in st.get("prefills", [])]
    planner.sweeps, planner._interval, planner._skip = st.get("sweeps", (0, 1, 0))
    planner.rollout_s = st.get("rollout_s")   # (older checkpoints: no sweep budget yet)
    if ck.get("kl_ctrl") is not None:   # (older checkpoints: the configured coefficient)
        worker.kl.load_state_dict(ck["kl_ctrl"])
    worker.iteration_index = ck["iteration"]
    return list(ck["history"])


MARKER = "COMPLETE"


def checkpoint_dir(out_dir: str | Path, iteration: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"iter_{iteration:05d}"


def _write_atomic(path: Path, write: Any) -> int:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def _distributed(worker: Any) -> bool:
    import torch.distributed as dist

    return worker.world > 1 and dist.is_available() and dist.is_initialized()


CHUNK_BYTES = 16 << 20
"""Bytes per message when a share travels: what rank 0 holds of another rank's share."""


class _SendStream:
    """A write-only file for :func:`torch.save` whose bytes go to rank ``dst`` in chunks of
    at most :data:`CHUNK_BYTES` (each after its length; a length of 0 ends the file).
    ``torch.save`` copies one storage at a time to the CPU and writes it here, so neither
    side ever holds a pickled copy of the whole share."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.buf = bytearray(CHUNK_BYTES)
        self.view = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.used = 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n, at = len(mv), 0
        while at < n:
            take = min(n - at, CHUNK_BYTES - self.used)
            self.buf[self.used:self.used + take] = mv[at:at + take]
            self.used += take
            at += take
            if self.used == CHUNK_BYTES:
                self._send()
        return n

    def flush(self) -> None:
        pass

    def _send(self) -> None:
        import torch.distributed as dist

        dist.send(torch.tensor([self.used], dtype=torch.int64), dst=self.dst)
        if self.used:
            dist.send(self.view[:self.used], dst=self.dst)
        self.used = 0

    def close(self) -> None:
        if self.used:
            self._send()
        self._send()   # length 0: the end


def _recv_stream(src: int, write: Any) -> None:
    """Receive what a :class:`_SendStream` of rank ``src`` sends, chunk by chunk, into
    ``write(memoryview)``."""
    import torch.distributed as dist

    head = torch.zeros(1, dtype=torch.int64)
    buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    while True:
        dist.recv(head, src=src)
        n = int(head[0])
        if n == 0:
            return
        dist.recv(buf[:n], src=src)
        write(memoryview(buf[:n].numpy()))


def _send_file(path: Path, dst: int) -> None:
    """Stream the bytes of ``path`` to rank ``dst`` (read with :func:`_recv_share`)."""
    stream = _SendStream(dst)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            stream.write(chunk)
    stream.close()


def _recv_share(src: int) -> dict[str, Any]:
    """A share streamed by rank ``src``, loaded on the CPU."""
    import io

    got = io.BytesIO()
    _recv_stream(src, got.write)
    got.seek(0)
    return torch.load(got, map_location="cpu", weights_only=False)


def shard_keys(worker: Any) -> dict[str, tuple[Any, ...]]:
    """What piece of each role it trains this rank holds: ranks with equal keys for a role
    hold equal weights and optimizer state (their gradients are summed before every step),
    so a checkpoint saves one copy of them. Whole data-parallel copies are one piece, so is
    each stage of a fused pipeline in every replica; DTensor shards (tensor parallel,
    ZeRO-3) count as each rank's own (their device mesh is the rank's own)."""
    engine = getattr(worker, "engine", None)
    if engine is not None:
        return engine.shard_keys()
    return {role: ("own", worker.rank) for role in worker.training_modules()}


def _same_as(keys: list[dict[str, tuple[Any, ...]]]) -> dict[int, dict[str, int]]:
    """rank -> {role: the lowest rank holding the same piece}, for the roles a rank does not
    save itself."""
    first: dict[tuple[str, tuple[Any, ...]], int] = {}
    out: dict[int, dict[str, int]] = {}
    for rank, mine in enumerate(keys):
        for role, key in sorted(mine.items()):
            q = first.setdefault((role, key), rank)
            if q != rank:
                out.setdefault(rank, {})[role] = q
    return out


def save_checkpoint(worker: Any, out_dir: str | Path, iteration: int,
                    history: list[dict[str, float]], *, keep: int = 0) -> Path | None:
    """Every rank calls this at the same iteration boundary (it is a collective when
    distributed). Returns the checkpoint folder on rank 0, None elsewhere (and on an orphaned
    rank: nothing written). ``keep`` > 0 prunes to the newest ``keep`` checkpoints.

    Replicas save one copy (:func:`shard_keys`): a rank whose piece of a role a lower rank
    also holds saves ``same_as[role]`` (that rank) instead of its weights and optimizer
    state. The other ranks' shares reach rank 0 as :func:`torch.save`'s bytes, streamed in
    :data:`CHUNK_BYTES` chunks straight into their files."""
    import torch.distributed as dist

    from ..launch import orphaned

    if orphaned():
        os._exit(1)
    same_as: dict[int, dict[str, int]] = {}
    if _distributed(worker):
        keys: list[Any] = [None] * worker.world
        dist.all_gather_object(keys, shard_keys(worker))
        same_as = _same_as(keys)
    state = worker_state(worker, history)
    mine = same_as.get(worker.rank, {})
    if mine:
        for part in ("models", "optimizers"):
            state[part] = {r: v for r, v in state[part].items() if r not in mine}
        state["same_as"] = mine
    if worker.rank != 0:
        stream = _SendStream(0)
        torch.save(state, stream)
        stream.close()
        return None
    final = checkpoint_dir(out_dir, iteration)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    sizes = {"rank0.pt": _write_atomic(partial / "rank0.pt", lambda f, st=state: torch.save(st, f))}
    del state
    for r in range(1, worker.world):
        sizes[f"rank{r}.pt"] = _write_atomic(partial / f"rank{r}.pt",
                                             lambda f, r=r: _recv_stream(r, f.write))
    if orphaned():
        os._exit(1)
    marker = {"iteration": iteration, "world_size": worker.world, "files": sizes,
              "same_as": {str(r): v for r, v in same_as.items()}}
    _write_atomic(partial / MARKER, lambda f: f.write(json.dumps(marker).encode()))
    if final.exists():   # an interrupted earlier run's folder of the same name
        shutil.rmtree(final)
    os.replace(partial, final)
    if keep > 0:
        prune_checkpoints(out_dir, keep)
    return final


def _with_replicas(ck: dict[str, Any], get: Any) -> dict[str, Any]:
    """``ck`` with the roles it saved as ``same_as`` filled in from ``get(rank)`` (that
    rank's share), in ascending rank order."""
    same = ck.pop("same_as", None) or {}
    for q in sorted(set(same.values())):
        other = get(q)
        for role in (r for r, src in same.items() if src == q):
            ck["models"][role] = other["models"][role]
            ck["optimizers"][role] = other["optimizers"][role]
        del other
    return ck


def load_checkpoint(worker: Any, out_dir: str | Path, iteration: int) -> list[dict[str, float]]:
    """Restore every rank's share of the checkpoint of ``iteration`` (a collective when
    distributed: rank 0 streams each rank its file, and the file of the replica that saved
    a role for it); returns the metric history."""
    folder = checkpoint_dir(out_dir, iteration)
    if worker.rank != 0:
        ck = _with_replicas(_recv_share(0), lambda q: _recv_share(0))
        return load_worker_state(worker, ck, f"{folder}/rank{worker.rank}.pt")
    if _distributed(worker):
        marker = json.loads((folder / MARKER).read_text())
        same_as = marker.get("same_as", {})
        for r in range(1, worker.world):
            _send_file(folder / f"rank{r}.pt", r)
            for q in sorted(set(same_as.get(str(r), {}).values())):
                _send_file(folder / f"rank{q}.pt", r)
    return load_worker(worker, folder / "rank0.pt")


def checkpoint_problem(path: Path, world: int) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from by ``world`` ranks (None:
    it can): no marker, another world size, a file missing, truncated or corrupt."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} marker (it was being written when the run stopped)"
    except (OSError, ValueError) as exc:
        return f"unreadable {MARKER} marker ({exc})"
    if marker.get("world_size") != world:
        return f"saved by {marker.get('world_size')} ranks, this run has {world}"
    for name, size in marker["files"].items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} were written (truncated?)"
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{name} is corrupt ({exc})"
        if bad is not None:
            return f"{name} is corrupt ({bad} fails its checksum)"
    return None


def complete_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(iteration, folder) of every folder with a marker, oldest first (not verified)."""
    base = Path(out_dir) / "checkpoints"
    found = []
    for p in base.glob("iter_*") if base.exists() else []:
        name = p.name[5:]
        if name.isdigit() and (p / MARKER).exists():
            found.append((int(name), p))
    return sorted(found)


def resume_point(out_dir: str | Path, world: int, *, say: Any = None) -> int | None:
    """The iteration of the newest checkpoint that ``world`` ranks can resume from, skipping
    (and reporting through ``say``, default stderr) newer ones that are incomplete or
    corrupt; None when there is none."""
    say = say or (lambda msg: print(msg, file=sys.stderr))
    base = Path(out_dir) / "checkpoints"
    candidates = sorted(((int(p.name[5:]), p) for p in base.glob("iter_*")
                         if p.name[5:].isdigit()), reverse=True) if base.exists() else []
    for it, path in candidates:
        problem = checkpoint_problem(path, world)
        if problem is None:
            return it
        say(f"resume: skipping {path}: {problem}")
    return None


def prune_checkpoints(out_dir: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and leftover partial ones."""
    done = complete_checkpoints(out_dir)
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = done[-1][0] if done else -1
    for p in (Path(out_dir) / "checkpoints").glob("iter_*.partial"):
        if p.name[5:10].isdigit() and int(p.name[5:10]) < newest:
            shutil.rmtree(p, ignore_errors=True)
