"""Checkpoints at iteration boundaries: each rank saves and restores its own share.

A rank's share is what only it holds: its training stages, its optimizers' state, and the
loop's own state (iteration index, the R_t planner's observations, the metric history). The
generation and inference copies are not saved: the next iteration starts with a weight sync
that rebuilds them from the training stages, and sampling is keyed on (seed, iteration,
sample), so a resumed run repeats exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

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


def save_worker(worker: Any, path: str | Path, history: list[dict[str, float]]) -> None:
    torch.save(worker_state(worker, history), path)


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
