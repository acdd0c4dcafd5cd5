"""Weight sync: the trained weights from the training layout to the generation layout (ReaLHF §6).

Between two arbitrary (dp, tp, pp) layouts see :mod:`.realloc_execute`; this is the loop's
common case, a pipeline-split model to a whole copy on every rank.

Training holds each model split into pipeline stages (one stage per rank, possibly several
copies and replicas); generation and inference hold a whole copy on every rank. After each
PPO round every stage's parameters are broadcast from the one rank that owns them canonically
(replica 0, copy 0) to every rank, one flat buffer per owner, so each tensor crosses the
network once per receiving rank and nothing else moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .checkpoint import aliases


@dataclass(frozen=True)
class Ownership:
    """For one model: ``(owner rank, [parameter names])`` in broadcast order."""

    model: str
    parts: tuple[tuple[int, tuple[str, ...]], ...]


def ownership(stage_params: Mapping[str, Mapping[str, Tensor]],
              canonical: Mapping[str, bool]) -> dict[str, Ownership]:
    """Who sends what: collective over the default group (one ``all_gather_object``).

    ``stage_params``: this rank's ``{model: {name: parameter}}`` under the whole model's
    canonical names (:func:`stage_parameters`); ``canonical``: whether this rank is the
    canonical holder of its stage of each model. A name two owners report is sent by the
    first.
    """
    mine = {m: list(ps) for m, ps in stage_params.items() if canonical.get(m)}
    world = dist.get_world_size()
    reports: list[dict[str, list[str]] | None] = [None] * world
    dist.all_gather_object(reports, mine)
    out: dict[str, Ownership] = {}
    models = sorted({m for rep in reports if rep for m in rep})
    for model in models:
        seen: set[str] = set()
        parts = []
        for rank, rep in enumerate(reports):
            names = [n for n in (rep or {}).get(model, []) if n not in seen]
            seen.update(names)
            if names:
                parts.append((rank, tuple(names)))
        out[model] = Ownership(model, tuple(parts))
    return out


def broadcast_parameters(own: Ownership, stage_params: Mapping[str, Tensor],
                         shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
                         device: torch.device | str = "cpu") -> tuple[dict[str, Tensor], int]:
    """Every parameter of the model on every rank, by name; and the bytes this rank received.

    ``shapes`` gives each name's shape and dtype (every rank knows them from its own whole
    copy); the owner reads its values from ``stage_params``.
    """
    rank = dist.get_rank()
    out: dict[str, Tensor] = {}
    received = 0
    for owner, names in own.parts:
        dtype = shapes[names[0]][1]
        if rank == owner:
            buf = torch.cat([stage_params[n].detach().reshape(-1).to(dtype) for n in names])
        else:
            total = sum(shapes[n][0].numel() for n in names)
            buf = torch.empty(total, dtype=dtype, device=device)
            received += total * buf.element_size()
        dist.broadcast(buf, src=owner)
        off = 0
        for n in names:
            size = shapes[n][0].numel()
            out[n] = buf[off: off + size].view(shapes[n][0])
            off += size
    return out, received


def minimum_bytes(own: Ownership, shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
                  world: int) -> int:
    """Bytes any reallocation must move: each parameter to each rank that lacks it."""
    total = 0
    for _owner, names in own.parts:
        for n in names:
            shape, dtype = shapes[n]
            total += shape.numel() * torch.empty((), dtype=dtype).element_size() * (world - 1)
    return total


def full_state(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``model``'s state dict with every parameter (tied aliases too) taken from ``params``."""
    alias = aliases(model)
    state = model.state_dict()
    missing = [n for n in set(alias.values()) if n not in params]
    if missing:
        raise KeyError(f"reallocation: no owner sent {sorted(missing)[:3]} "
                       f"(of {len(missing)} parameters)")
    for k in state:
        if k in alias:
            state[k] = params[alias[k]]
    return state


def shapes_of(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {n: (p.shape, torch.float32 if p.is_floating_point() else p.dtype)
            for n, p in model.named_parameters()}


def tied_aliases(model: nn.Module) -> frozenset[str]:
    """The names under which a whole ``model`` reaches a tensor it also reaches under an
    earlier name (``lm_head.weight`` of a model with tied input/output embeddings). Read it
    from the whole model: a pipeline stage that dropped the embedding reports its LM head
    under the alias."""
    return frozenset(n for n, c in aliases(model).items() if n != c)


def stage_parameters(module: nn.Module, tied: frozenset[str]) -> dict[str, Tensor]:
    """A stage's parameters under the whole model's canonical names: a tied alias (the LM
    head on the last stage) is left out, because the stage holding the embedding sends that
    tensor and both ends hold the same values once their gradients are summed."""
    return {n: p for n, p in module.named_parameters() if n not in tied}

