"""Sharded checkpoint directories of :class:`~rlhf_fusion.plugins.FusedPipelineStrategy`.

A sharded checkpoint is a directory with one file per model stage, ``<model>_stage<s>.pt``
(that stage's weights and its optimizer's share, written by the rank that holds the stage's
canonical copy), and ``meta.pt`` (everything else of the Lightning checkpoint: loops,
callbacks, schedulers, the state-dict entries outside the two models, and the stage layout),
written by rank 0. No file needs the others' ranks, so no rank gathers the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..runtime.errors import PlanError
from ..runtime.fused import ROLES

SHARD_META = "meta.pt"
_LAYOUT_KEY = "fused_pipeline_layout"
_REST_KEY = "state_dict_rest"


def shard_file(model: str, stage: int) -> str:
    return f"{model}_stage{stage}.pt"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / SHARD_META).is_file()


def save_shards(
    path: str | os.PathLike, checkpoint: Mapping[str, Any], stages: Mapping[str, tuple[int, int]]
) -> None:
    """Write the shard of every ``{model: (stage, num_stages)}`` given (the stages this rank
    holds canonically): the model's state-dict entries and its optimizer state (the
    checkpoint's ``optimizer_states`` are in :data:`ROLES` order). ``path`` must exist."""
    path = Path(path)
    for model, (stage, num_stages) in stages.items():
        shard = {
            "state_dict": {
                k: v for k, v in checkpoint["state_dict"].items() if k.startswith(model + ".")
            },
            "optimizer": checkpoint["optimizer_states"][ROLES.index(model)],
            "stage": stage,
            "num_stages": num_stages,
        }
        torch.save(shard, path / shard_file(model, stage))


def save_meta(
    path: str | os.PathLike, checkpoint: Mapping[str, Any], layout: Mapping[str, int]
) -> None:
    """Write ``meta.pt``: the checkpoint without the models' weights and optimizer states,
    plus ``layout = {model: pipeline stages}``."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta[_REST_KEY] = {
        k: v for k, v in checkpoint["state_dict"].items() if k.split(".", 1)[0] not in ROLES
    }
    meta[_LAYOUT_KEY] = dict(layout)
    torch.save(meta, Path(path) / SHARD_META)


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def load_shards(path: str | os.PathLike, stages: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """The Lightning checkpoint dict for a rank holding ``{model: (stage, num_stages)}``: the
    meta entries, those stages' weights (plus the entries outside the models) and their
    optimizer states (``None`` for a model the rank does not hold).

    Raises :class:`PlanError` if the checkpoint was saved with other stage counts.
    """
    path = Path(path)
    meta = _load(path / SHARD_META)
    layout = meta.pop(_LAYOUT_KEY, {})
    state = dict(meta.pop(_REST_KEY, {}))
    optimizer_states: list[Any] = [None] * len(ROLES)
    for model, (stage, num_stages) in stages.items():
        if layout.get(model) not in (None, num_stages):
            raise PlanError(
                f"checkpoint {path}: {model} was saved with {layout[model]} pipeline stages, "
                f"this run uses {num_stages}; save a gathered checkpoint to change stages"
            )
        shard = _load(path / shard_file(model, stage))
        state.update(shard["state_dict"])
        optimizer_states[ROLES.index(model)] = shard["optimizer"]
    return {**meta, "state_dict": state, "optimizer_states": optimizer_states}


def consolidate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Merge a sharded checkpoint directory into one ordinary Lightning checkpoint dict.

    The model weights are complete (every stage's file); optimizer states are left out
    because their order depends on ``configure_optimizers``: resume sharded checkpoints with
    the strategy, or load the returned ``state_dict`` into a fresh module.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a sharded FusedPipelineStrategy checkpoint")
    meta = _load(path / SHARD_META)
    layout = meta.pop(_LAYOUT_KEY, {})
    state = dict(meta.pop(_REST_KEY, {}))
    for model, stages in layout.items():
        for s in range(stages):
            state.update(_load(path / shard_file(model, s))["state_dict"])
    return {**meta, "state_dict": state}
