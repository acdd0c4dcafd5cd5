"""An execution plan: for each call a device mesh and a parallel strategy (PPO's six calls,
or the four (three) of a critic-free run: ``graph.calls_of``).

The JSON form (``ExecutionPlan.save`` / ``load``) is what the loop reads to run a plan (``placement: {plan: FILE}``):
``{"format": "rlhf-fusion-plan", "version": 1, "cluster": ..., "calls": {call: {"mesh":
{"group", "nodes": [start, count], "gpus": [start, count], "ranks": [...]}, "dp", "tp", "pp"
[, "zero": 3]}},
"offload": [...], "estimate": {...}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlacementError
from .graph import CALL_MODEL, CALLS, models_of_calls, plan_calls
from .hardware import Cluster
from .layout import Layout
from .mesh import DeviceMesh, make_mesh

FORMAT = "rlhf-fusion-plan"
VERSION = 1


@dataclass(frozen=True)
class CallPlacement:
    mesh: DeviceMesh
    strategy: Layout

    def same_layout(self, other: CallPlacement) -> bool:
        return self.mesh.ranks == other.mesh.ranks and self.strategy == other.strategy

    def __str__(self) -> str:
        return f"{self.mesh} {self.strategy}"


@dataclass
class ExecutionPlan:
    calls: dict[str, CallPlacement]
    name: str = ""
    offload: tuple[str, ...] = ()         # frozen models kept in host memory between calls
    estimate: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models, self.call_names = plan_calls(self.calls, f"plan {self.name!r}")
        bad = [m for m in self.offload if m not in ("ref", "reward")]
        if bad:
            raise PlacementError(f"offload {bad}: only the frozen ref and reward can be offloaded")
        absent = [m for m in self.offload if m not in self.models]
        if absent:
            raise PlacementError(f"offload {absent}: the plan has no such model; offload only "
                                 f"frozen models it has ({[m for m in self.models if m in ('ref', 'reward')]})")

    def key(self) -> tuple:
        return tuple((self.calls[c].mesh.ranks, self.calls[c].strategy) for c in self.call_names)

    def replace(self, call: str, placement: CallPlacement, name: str | None = None) -> ExecutionPlan:
        calls = dict(self.calls)
        calls[call] = placement
        return ExecutionPlan(calls, self.name if name is None else name, self.offload)

    def table(self) -> str:
        """Per call: model, allocation and (dp, tp, pp), as ReaLHF's Table 6."""
        zero = any(self.calls[c].strategy.zero for c in self.call_names)
        rows = [("call", "model", "allocation", "GPUs", "dp", "tp", "pp") + (("zero",) * zero)]
        for c in self.call_names:
            p = self.calls[c]
            rows.append((c, CALL_MODEL[c], p.mesh.name, str(p.mesh.size), str(p.strategy.dp),
                         str(p.strategy.tp), str(p.strategy.pp))
                        + ((str(p.strategy.zero),) * zero))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def to_dict(self, cluster: Cluster | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "name": self.name}
        if cluster is not None:
            d["cluster"] = cluster.to_dict()
        d["calls"] = {c: {"model": CALL_MODEL[c], "mesh": self.calls[c].mesh.to_dict(),
                          **self.calls[c].strategy.to_dict()} for c in self.call_names}
        d["offload"] = list(self.offload)
        if self.estimate:
            d["estimate"] = self.estimate
        return d

    def save(self, path: str | Path, cluster: Cluster | None = None) -> None:
        Path(path).write_text(json.dumps(self.to_dict(cluster), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any], cluster: Cluster) -> ExecutionPlan:
        if d.get("format") != FORMAT:
            raise PlacementError(f"not a plan file (format {d.get('format')!r}, expected "
                                 f"{FORMAT!r}); write one with `rlhf-fusion place`")
        if d.get("version") != VERSION:
            raise PlacementError(f"plan version {d.get('version')!r} is not {VERSION}; "
                                 "re-run `rlhf-fusion place` to write a current plan")
        raw = d.get("calls")
        if not isinstance(raw, dict) or not raw:
            raise PlacementError("plan: no calls; write the plan with `rlhf-fusion place`")
        models_of_calls(raw, "plan")   # every call of each model it names, Actor and Ref
        calls = {}
        for c in CALLS:
            if c not in raw:
                continue
            e = raw[c]
            m = e["mesh"]
            mesh = make_mesh(cluster, m["group"], m["nodes"][0], m["nodes"][1],
                             m["gpus"][0], m["gpus"][1])
            if "ranks" in m and list(m["ranks"]) != list(mesh.ranks):
                raise PlacementError(f"plan: {c}'s ranks {m['ranks']} do not match its mesh "
                                     f"{mesh} ({list(mesh.ranks)}) on this cluster")
            calls[c] = CallPlacement(mesh, Layout(int(e["dp"]), int(e["tp"]), int(e["pp"]),
                                                            int(e.get("zero", 0))))
        return cls(calls, str(d.get("name", "")), tuple(d.get("offload", ())),
                   dict(d.get("estimate", {})))

    @classmethod
    def load(cls, path: str | Path, cluster: Cluster) -> ExecutionPlan:
        return cls.from_dict(json.loads(Path(path).read_text()), cluster)
