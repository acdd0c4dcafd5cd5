"""Parameter reallocation between two layouts of one model (ReaLHF §6, Figure 7).

A layout is a mesh with a (dp, tp, pp): rank i of the mesh holds the layers of its pipeline
stage and the 1/tp column of its tensor-parallel index (every data-parallel replica holds the
same shards; under ZeRO-3 each data-parallel rank holds a 1/dp run of that shard's layers, the
bytes a flat partition gives it). Reallocation gives every destination rank its shard: what it already holds in
the source layout stays, every other piece comes from the cheapest source that holds it (the
same node over NVLink before another node over InfiniBand; among equals the least loaded, then
the lowest rank), so each byte a destination lacks arrives exactly once. ``min_bytes`` is that
lower bound; ``min_ib_bytes`` counts, per destination node, the bytes no GPU of that node
holds, which any scheme must bring in over InfiniBand at least once.

Shards are exact rectangles in (layer, tensor-column) space with rational column bounds, so
the transfers tile each destination shard exactly: the precondition for a bit-exact runtime.
Embeddings and the head are spread over layers here (the runtime moves them with the first
and last stage).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from .hardware import Cluster
from .layout import Layout
from .mesh import DeviceMesh
from .models import ModelShape


@dataclass(frozen=True)
class MeshLayout:
    """A :class:`~rlhf_fusion.placement.layout.Layout` on a mesh of the cluster (the mesh's
    ranks are the layout's, and its nodes price the transfers)."""

    mesh: DeviceMesh
    strategy: Layout

    @property
    def placed(self) -> Layout:
        return self.strategy.on(self.mesh.ranks)

    def stage_layers(self, stage: int, layers: int) -> tuple[int, int]:
        return self.strategy.stage_layers(stage, layers)

    def shards(self, layers: int) -> dict[int, tuple[int, int, Fraction, Fraction]]:
        """rank -> (first layer, end layer, first column, end column)."""
        return self.placed.shards(layers)


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    layers: tuple[int, int]
    columns: tuple[Fraction, Fraction]
    nbytes: float
    link: str        # "nvlink" | "ib"


@dataclass
class ReallocPlan:
    transfers: list[Transfer]
    bytes: float
    min_bytes: float
    ib_bytes: float
    min_ib_bytes: float
    seconds: float

    def summary(self) -> dict[str, float]:
        return {"bytes": self.bytes, "min_bytes": self.min_bytes, "ib_bytes": self.ib_bytes,
                "min_ib_bytes": self.min_ib_bytes, "seconds": self.seconds,
                "transfers": len(self.transfers)}


# A shard: (first layer, end layer, first column, end column).
Rect = tuple[int, int, Fraction, Fraction]


def intersect(a: Rect, b: Rect) -> Rect | None:
    """The rectangle two shards share, or None when they share nothing."""
    l0, l1 = max(a[0], b[0]), min(a[1], b[1])
    c0, c1 = max(a[2], b[2]), min(a[3], b[3])
    if l0 >= l1 or c0 >= c1:
        return None
    return l0, l1, c0, c1


def plan_realloc(model: ModelShape, src: MeshLayout, dst: MeshLayout, cluster: Cluster, *,
                 detail: bool = True) -> ReallocPlan:
    """Transfers that take ``model`` from layout ``src`` to ``dst`` and their time.
    ``detail=False`` skips the InfiniBand lower bound (the search needs only the time)."""
    L = model.layers
    per_cell = model.param_bytes / L     # bytes of one layer's full width

    def nbytes(rect: tuple) -> float:
        return float(per_cell * (rect[1] - rect[0]) * (rect[3] - rect[2]))

    src_sh = src.shards(L)
    holders: dict[tuple, list[int]] = defaultdict(list)   # shard rect -> ranks holding it
    for r, rect in src_sh.items():
        holders[rect].append(r)
    node = {r: cluster.node_of(r)[1] for r in set(src_sh) | set(dst.mesh.ranks)}
    load: dict[int, float] = defaultdict(float)
    transfers: list[Transfer] = []
    min_ib = 0.0
    dst_sh = dst.shards(L)
    by_node: dict[int, list[int]] = defaultdict(list)
    for r in dst_sh:
        by_node[node[r]].append(r)
    for dnode, ranks in sorted(by_node.items()) if detail else ():
        # Bytes this node needs that none of its GPUs holds: the InfiniBand lower bound.
        needed: set[tuple] = set()
        for r in ranks:
            for rect, hs in holders.items():
                if any(node[h] == dnode for h in hs):
                    continue
                piece = intersect(rect, dst_sh[r])
                if piece:
                    needed.add(piece)
        min_ib += _union_bytes(needed, nbytes)
    for r in sorted(dst_sh):
        want = dst_sh[r]
        own = src_sh.get(r)
        for rect in sorted(holders):
            if rect == own:
                continue
            piece = intersect(rect, want)
            if piece is None:
                continue
            hs = holders[rect]
            same = [h for h in hs if node[h] == node[r]]
            pool = same or hs
            h = min(pool, key=lambda x: (load[x], x))
            b = nbytes(piece)
            load[h] += b
            transfers.append(Transfer(h, r, (piece[0], piece[1]), (piece[2], piece[3]), b,
                                      "nvlink" if same else "ib"))
    total = sum(t.nbytes for t in transfers)
    ib = sum(t.nbytes for t in transfers if t.link == "ib")
    min_bytes = 0.0
    for r, want in dst_sh.items():
        own = src_sh.get(r)
        held = intersect(own, want) if own else None
        min_bytes += nbytes(want) - (nbytes(held) if held else 0.0)
    return ReallocPlan(transfers, total, min_bytes, ib, min_ib,
                       _seconds(transfers, cluster, dst.mesh))


def _union_bytes(pieces: set[tuple], nbytes) -> float:
    """Bytes covered by a set of rectangles (pieces of one tiling can overlap across ranks)."""
    if not pieces:
        return 0.0
    ls = sorted({p[0] for p in pieces} | {p[1] for p in pieces})
    cs = sorted({p[2] for p in pieces} | {p[3] for p in pieces})
    total = 0.0
    for i in range(len(ls) - 1):
        for j in range(len(cs) - 1):
            cell = (ls[i], ls[i + 1], cs[j], cs[j + 1])
            if any(p[0] <= cell[0] and cell[1] <= p[1] and p[2] <= cell[2] and cell[3] <= p[3]
                   for p in pieces):
                total += nbytes(cell)
    return total


def _seconds(transfers: list[Transfer], cluster: Cluster, mesh: DeviceMesh) -> float:
    """Link-bound time: each transfer goes straight from one holder to one destination, so a
    rank's NVLink and InfiniBand links carry everything it sends and everything it receives;
    the busiest link in either direction sets the time, plus one latency per transfer round
    (the most transfers any rank takes part in)."""
    if not transfers:
        return 0.0
    hw = cluster.group(mesh.group).hardware
    eff = hw.comm_efficiency
    load: dict[tuple[int, str, str], float] = defaultdict(float)
    rounds: dict[tuple[int, str], int] = defaultdict(int)
    for t in transfers:
        load[(t.src, t.link, "out")] += t.nbytes
        load[(t.dst, t.link, "in")] += t.nbytes
        rounds[(t.src, "out")] += 1
        rounds[(t.dst, "in")] += 1
    worst = max(b / ((hw.nvlink_bw if link == "nvlink" else hw.ib_bw) * eff)
                for (_r, link, _d), b in load.items())
    return worst + max(rounds.values()) * hw.link_latency_s
