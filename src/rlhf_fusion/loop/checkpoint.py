"""Checkpoints at iteration boundaries: each rank saves and restores its own share.

A rank's share is what only it holds: its training stages, its optimizers' state, and the
loop's own state (iteration index, the R_t planner's observations, the metric history). The
generation and inference copies are not saved: the next iteration starts with a weight sync
that rebuilds them from the training stages, and sampling is keyed on (seed, iteration,
sample), so a resumed run repeats exactly what the uninterrupted run would have done.

On disk, ``OUT/checkpoints/iter_NNNNN/`` holds ``rank{r}.pt`` for every rank and ``COMPLETE``
(JSON: iteration, world size, each file's size), and is written atomically, by rank 0 alone:
the other ranks send it their shares one at a time (so OUT need not be shared between nodes,
and rank 0 holds at most two shares at once); it writes each as ``rank{r}.pt.tmp`` inside
``iter_NNNNN.partial/`` and renames it, then writes ``COMPLETE`` and renames the folder. A
folder without the marker, or whose files do not match it, is never resumed from. Resuming,
rank 0 reads every share and sends each rank its own. A rank whose launcher died writes
nothing (:func:`rlhf_fusion.launch.orphaned`).
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


def worker_state(worker: Any, history: list[dict[str, float]]) -> dict[str, Any]:
    """This rank's share of the run (see the module docstring), as one picklable dict."""
    planner = worker.rt_planner
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
                       "scoring": planner.scoring, "current": planner.current,
                       "history": planner.history, "prompt_len": planner.prompt_len},
        "history": history,
    }


def load_worker(worker: Any, path: str | Path) -> list[dict[str, float]]:
    """Restore the share saved by :func:`save_worker`; returns the metric history."""
    return load_worker_state(worker, torch.load(path, map_location="cpu", weights_only=False),
                             str(path))


def load_worker_state(worker: Any, ck: dict[str, Any], where: str = "checkpoint"
                      ) -> list[dict[str, float]]:
    if ck["world_size"] != worker.world or ck["rank"] != worker.rank:
        raise ValueError(f"{where}: saved by rank {ck['rank']} of {ck['world_size']}; "
                         f"this is rank {worker.rank} of {worker.world}: resume with the same "
                         "world_size")
    for role, module in worker.training_modules().items():
        module.load_state_dict(ck["models"][role])
    for role, opt in worker.optimizers.items():
        opt.load_state_dict(ck["optimizers"][role])
    planner = worker.rt_planner
    st = ck["rt_planner"]
    planner.dist = None if st["dist"] is None else LengthDistribution(*st["dist"])
    planner.by_batch.clear()
    planner.by_batch.update(st["by_batch"])
    planner.scoring = list(st["scoring"])
    planner.current = st["current"]
    planner.history = list(st["history"])
    planner.prompt_len = st["prompt_len"]
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


def save_checkpoint(worker: Any, out_dir: str | Path, iteration: int,
                    history: list[dict[str, float]], *, keep: int = 0) -> Path | None:
    """Every rank calls this at the same iteration boundary (it is a collective when
    distributed). Returns the checkpoint folder on rank 0, None elsewhere (and on an orphaned
    rank: nothing written). ``keep`` > 0 prunes to the newest ``keep`` checkpoints."""
    import torch.distributed as dist

    from ..launch import orphaned

    if orphaned():
        os._exit(1)
    state = worker_state(worker, history)
    if worker.rank != 0:
        dist.send_object_list([state], dst=0)
        return None
    final = checkpoint_dir(out_dir, iteration)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for r in range(worker.world):
        if r:
            got: list[Any] = [None]
            dist.recv_object_list(got, src=r)
            state = got[0]
        sizes[f"rank{r}.pt"] = _write_atomic(partial / f"rank{r}.pt",
                                             lambda f, st=state: torch.save(st, f))
        del state
    if orphaned():
        os._exit(1)
    marker = {"iteration": iteration, "world_size": worker.world, "files": sizes}
    _write_atomic(partial / MARKER, lambda f: f.write(json.dumps(marker).encode()))
    if final.exists():   # an interrupted earlier run's folder of the same name
        shutil.rmtree(final)
    os.replace(partial, final)
    if keep > 0:
        prune_checkpoints(out_dir, keep)
    return final


def load_checkpoint(worker: Any, out_dir: str | Path, iteration: int) -> list[dict[str, float]]:
    """Restore every rank's share of the checkpoint of ``iteration`` (a collective when
    distributed: rank 0 reads the files and sends each rank its own); returns the metric
    history."""
    import torch.distributed as dist

    folder = checkpoint_dir(out_dir, iteration)
    if worker.rank != 0:
        got: list[Any] = [None]
        dist.recv_object_list(got, src=0)
        return load_worker_state(worker, got[0], f"{folder}/rank{worker.rank}.pt")
    for r in range(1, worker.world if _distributed(worker) else 1):
        share = torch.load(folder / f"rank{r}.pt", map_location="cpu", weights_only=False)
        dist.send_object_list([share], dst=r)
        del share
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
