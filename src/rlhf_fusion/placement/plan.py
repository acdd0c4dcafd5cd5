"""An execution plan: for each of the six calls a device mesh and a parallel strategy.

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
from .graph import CALL_MODEL, CALLS
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
        missing = [c for c in CALLS if c not in self.calls]
        if missing:
            raise PlacementError(f"plan {self.name!r}: no placement for {missing}; every one of "
                                 f"{list(CALLS)} needs a mesh and (dp, tp, pp)")
        bad = [m for m in self.offload if m not in ("ref", "reward")]
        if bad:
            raise PlacementError(f"offload {bad}: only the frozen ref and reward can be offloaded")

    def key(self) -> tuple:
        return tuple((self.calls[c].mesh.ranks, self.calls[c].strategy) for c in CALLS)

    def replace(self, call: str, placement: CallPlacement, name: str | None = None) -> ExecutionPlan:
        calls = dict(self.calls)
        calls[call] = placement
        return ExecutionPlan(calls, self.name if name is None else name, self.offload)

    def table(self) -> str:
        """Per call: model, allocation and (dp, tp, pp), as ReaLHF's Table 6."""
        zero = any(self.calls[c].strategy.zero for c in CALLS)
        rows = [("call", "model", "allocation", "GPUs", "dp", "tp", "pp") + (("zero",) * zero)]
        for c in CALLS:
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
                          **self.calls[c].strategy.to_dict()} for c in CALLS}
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
                                 f"{FORMAT!r}); write one with `rlhf-fusion plan`")
        if d.get("version") != VERSION:
            raise PlacementError(f"plan version {d.get('version')!r} is not {VERSION}; "
                                 "re-run `rlhf-fusion plan` to write a current plan")
        calls = {}
        for c in CALLS:
            if c not in d.get("calls", {}):
                raise PlacementError(f"plan: call {c!r} missing; every call needs a placement")
            e = d["calls"][c]
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
