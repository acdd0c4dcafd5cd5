"""Optimizer state keyed by parameter *name*, so it survives partitioning.

A partitioned rank's optimizer only knows its own parameters, by position. Keying the state by
the parameter's name in the unpartitioned module lets ranks merge their shares into the
standard ``Optimizer.state_dict()`` layout of the unpipelined optimizer (a gathered checkpoint
a single-device run can resume from) and lets any partition pick its share back out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

NAMED_KEY = "fused_pipeline_param_names"


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first (canonical) name in ``module``."""
    out: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def aliases(module: nn.Module) -> dict[str, str]:
    """Every parameter name -> the canonical name of the same tensor (tied weights)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], keep: set[str] | None = None
) -> dict[str, Any]:
    """``{"param_groups": [{hyper-params, "params": [names]}], "state": {name: state}}``.

    ``keep`` restricts the state to those names (e.g. the parameters this rank owns
    canonically); group membership lists keep every name this optimizer holds.
    """
    sd = optimizer.state_dict()
    groups = []
    state: dict[str, Any] = {}
    for group, sd_group in zip(optimizer.param_groups, sd["param_groups"], strict=True):
        group_names = [names[id(p)] for p in group["params"]]
        groups.append(
            {**{k: v for k, v in sd_group.items() if k != "params"}, "params": group_names}
        )
        for idx, name in zip(sd_group["params"], group_names, strict=True):
            if idx in sd["state"] and (keep is None or name in keep):
                state[name] = sd["state"][idx]
    return {"param_groups": groups, "state": state}


def merge_named_states(parts: Sequence[Mapping[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """Merge ranks' named states into the standard index layout of the full optimizer.

    ``order`` is the full module's parameter names in registration order; each group's
    parameters are laid out in that order. The names are kept under :data:`NAMED_KEY`.
    """
    rank = {n: i for i, n in enumerate(order)}
    groups: list[dict[str, Any]] = []
    members: list[set[str]] = []
    state: dict[str, Any] = {}
    for part in parts:
        for gi, g in enumerate(part["param_groups"]):
            if gi == len(groups):
                groups.append({k: v for k, v in g.items() if k != "params"})
                members.append(set())
            members[gi].update(n for n in g["params"] if n in rank)
        state.update(part["state"])
    out_groups, out_state, names = [], {}, []
    idx = 0
    for g, mem in zip(groups, members, strict=True):
        ordered = sorted(mem, key=rank.__getitem__)
        ids = list(range(idx, idx + len(ordered)))
        for i, n in zip(ids, ordered, strict=True):
            if n in state:
                out_state[i] = state[n]
        out_groups.append({**g, "params": ids})
        names.append(ordered)
        idx += len(ordered)
    return {"state": out_state, "param_groups": out_groups, NAMED_KEY: names}


def local_optimizer_state(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    names: Mapping[int, str],
    alias: Mapping[str, str],
) -> dict[str, Any]:
    """Pick this optimizer's share out of a merged (index layout + names) or named state."""
    if NAMED_KEY in saved:
        by_name: dict[str, Any] = {}
        for g, gnames in zip(saved["param_groups"], saved[NAMED_KEY], strict=True):
            for i, n in zip(g["params"], gnames, strict=True):
                if i in saved["state"]:
                    by_name[n] = saved["state"][i]
        groups = saved["param_groups"]
    else:
        by_name = dict(saved["state"])
        groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint optimizer has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}; configure_optimizers changed since the save"
        )
    out_state: dict[int, Any] = {}
    out_groups = []
    idx = 0
    for g_saved, group in zip(groups, optimizer.param_groups, strict=True):
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            st = by_name.get(name, by_name.get(alias.get(name, name)))
            if st is not None:
                out_state[idx] = copy.copy(st)
            ids.append(idx)
            idx += 1
        out_groups.append({**{k: v for k, v in g_saved.items() if k != "params"}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}
