"""Device meshes: where a call runs. As ReaLHF's, a mesh is either whole consecutive nodes of
one device group or an aligned slice of one node whose size divides the node (1, 2, 4, ... GPUs
starting at a multiple of the size), so tensor parallelism stays inside NVLink and two meshes
either nest or are disjoint."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from .errors import PlacementError
from .hardware import Cluster


@dataclass(frozen=True)
class DeviceMesh:
    group: str
    node_start: int      # node index inside the group
    n_nodes: int         # > 1 only for whole-node meshes
    gpu_start: int       # first GPU inside the node (0 for whole nodes)
    n_gpus: int          # GPUs per node used
    gpus_per_node: int
    rank_offset: int     # global rank of the group's first GPU

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        base = self.rank_offset + self.node_start * self.gpus_per_node
        return tuple(base + n * self.gpus_per_node + self.gpu_start + g
                     for n in range(self.n_nodes) for g in range(self.n_gpus))

    @cached_property
    def rank_set(self) -> frozenset[int]:
        return frozenset(self.ranks)

    @property
    def size(self) -> int:
        return self.n_nodes * self.n_gpus

    @property
    def whole_nodes(self) -> bool:
        return self.n_gpus == self.gpus_per_node

    def contains(self, other: DeviceMesh) -> bool:
        return other.rank_set <= self.rank_set

    @property
    def name(self) -> str:
        if self.whole_nodes:
            nodes = (f"node{self.node_start}" if self.n_nodes == 1
                     else f"node{self.node_start}-{self.node_start + self.n_nodes - 1}")
            return f"{self.group}:{nodes}"
        return (f"{self.group}:node{self.node_start}"
                f"[{self.gpu_start}:{self.gpu_start + self.n_gpus}]")

    def __str__(self) -> str:
        return self.name

    def to_dict(self) -> dict:
        return {"group": self.group, "nodes": [self.node_start, self.n_nodes],
                "gpus": [self.gpu_start, self.n_gpus], "ranks": list(self.ranks)}


def make_mesh(cluster: Cluster, group: str, node_start: int, n_nodes: int,
              gpu_start: int = 0, n_gpus: int | None = None) -> DeviceMesh:
    """A mesh, checked against the node topology."""
    g = cluster.group(group)
    gpn = g.gpus_per_node
    n_gpus = gpn if n_gpus is None else n_gpus
    if n_nodes < 1 or node_start < 0 or node_start + n_nodes > g.nodes:
        raise PlacementError(f"mesh nodes [{node_start}, {node_start + n_nodes}) are outside "
                             f"group {group!r} of {g.nodes} nodes")
    if n_nodes > 1 and n_gpus != gpn:
        raise PlacementError(f"a mesh over {n_nodes} nodes must use whole nodes ({gpn} GPUs "
                             f"each), not {n_gpus}; use one node for a slice")
    if n_gpus < 1 or gpn % n_gpus or gpu_start % n_gpus or gpu_start + n_gpus > gpn:
        raise PlacementError(f"a node slice of {n_gpus} GPUs from GPU {gpu_start} does not divide "
                             f"the {gpn}-GPU node; use a power of two dividing {gpn} starting "
                             f"at a multiple of it")
    return DeviceMesh(group, node_start, n_nodes, gpu_start, n_gpus, gpn, cluster.offset(group))


def mesh_from_ranks(cluster: Cluster, ranks: Iterable[int]) -> DeviceMesh:
    """The mesh holding exactly ``ranks``, or an error naming the nearest legal one."""
    rs = sorted(set(ranks))
    if not rs:
        raise PlacementError("an empty rank set; give at least one rank")
    group, _ = cluster.node_of(rs[0])
    g = cluster.group(group)
    off = cluster.offset(group)
    gpn = g.gpus_per_node
    local = [r - off for r in rs]
    first_node = (local[0]) // gpn
    if len(rs) >= gpn:
        if len(rs) % gpn or local[0] % gpn or local != list(range(local[0], local[0] + len(rs))):
            raise PlacementError(
                f"ranks {rs[0]}..{rs[-1]} ({len(rs)} GPUs) are not whole consecutive nodes of "
                f"{gpn} GPUs; a mesh of more than one node's GPUs must be whole nodes")
        if local[-1] >= g.size:
            raise PlacementError(f"ranks {rs} span more than device group {group!r}")
        return make_mesh(cluster, group, first_node, len(rs) // gpn)
    start = local[0] % gpn
    if local != list(range(local[0], local[0] + len(rs))) or local[-1] // gpn != first_node:
        raise PlacementError(f"ranks {rs} are not a contiguous slice of one node")
    return make_mesh(cluster, group, first_node, 1, start, len(rs))


def enumerate_meshes(cluster: Cluster, min_gpus: int = 1, *, include_inference_only: bool = True
                     ) -> list[DeviceMesh]:
    """Every legal mesh with at least ``min_gpus`` GPUs (ReaLHF searches with 4 by default on
    8-GPU nodes, which keeps the space small without losing the good plans)."""
    out: list[DeviceMesh] = []
    for g in cluster.groups:
        if g.inference_only and not include_inference_only:
            continue
        gpn = g.gpus_per_node
        size = max(1, min_gpus)
        while size < gpn:
            if size >= min_gpus:
                for node in range(g.nodes):
                    for start in range(0, gpn, size):
                        out.append(make_mesh(cluster, g.name, node, 1, start, size))
            size *= 2
        for n in range(1, g.nodes + 1):
            if n * gpn < min_gpus:
                continue
            for start in range(0, g.nodes - n + 1):
                out.append(make_mesh(cluster, g.name, start, n))
    return out
