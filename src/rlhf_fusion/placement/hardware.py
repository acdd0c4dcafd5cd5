"""Hardware presets and clusters made of device groups.

Figures are vendor datasheet numbers (dense bf16, no sparsity); the ``*_efficiency`` factors
turn peaks into what a well-tuned kernel reaches and are assumptions of this cost model, not
measurements. Bandwidths are per GPU and per direction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import PlacementError


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float            # dense bf16 FLOP/s per GPU
    hbm_bytes: float        # memory per GPU
    hbm_bw: float           # bytes/s
    nvlink_bw: float        # bytes/s per GPU per direction, inside a node
    ib_bw: float            # bytes/s per GPU per direction, between nodes
    pcie_bw: float          # host <-> GPU bytes/s (offload and prefetch)
    gpus_per_node: int = 8
    train_mfu: float = 0.45     # share of peak FLOPs a training step reaches
    infer_mfu: float = 0.5      # share of peak for prefill / inference forwards
    hbm_efficiency: float = 0.7  # share of HBM bandwidth a decode step reaches
    comm_efficiency: float = 0.8
    link_latency_s: float = 1e-5  # per collective (TP all-reduce, PP send)
    memory_reserve: float = 0.1   # share of HBM the allocator and the runtime keep

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GB = 1e9
# A100-SXM4-80GB: 312 TFLOP/s bf16, HBM2e 2.04 TB/s, NVLink3 600 GB/s total (300 per
# direction), one HDR 200 Gb/s (25 GB/s) NIC per GPU as in DGX A100, PCIe 4.0 x16.
A100_80G = Hardware("a100-80g", flops=312e12, hbm_bytes=80 * GB, hbm_bw=2.039e12,
                    nvlink_bw=300 * GB, ib_bw=25 * GB, pcie_bw=25 * GB)
# H100-SXM5-80GB: 989 TFLOP/s bf16, HBM3 3.35 TB/s, NVLink4 900 GB/s total (450 per direction),
# one NDR 400 Gb/s (50 GB/s) NIC per GPU as in DGX H100, PCIe 5.0 x16.
H100_80G = Hardware("h100-80g", flops=989e12, hbm_bytes=80 * GB, hbm_bw=3.35e12,
                    nvlink_bw=450 * GB, ib_bw=50 * GB, pcie_bw=50 * GB)

# V100-SXM2-32GB: 125 TFLOP/s fp16 tensor cores (no bf16; same bytes), HBM2 900 GB/s, NVLink2
# 300 GB/s total (150 per direction), 4 EDR 100 Gb/s NICs per 8 GPUs as in DGX-1, PCIe 3.0 x16.
V100_32G = Hardware("v100-32g", flops=125e12, hbm_bytes=32 * GB, hbm_bw=0.9e12,
                    nvlink_bw=150 * GB, ib_bw=6.25 * GB, pcie_bw=16 * GB)

HARDWARE: dict[str, Hardware] = {h.name: h for h in (A100_80G, H100_80G, V100_32G)}


def hardware(name: str | Hardware | dict[str, Any]) -> Hardware:
    """A preset by name (``a100-80g``, ``h100-80g``, ``v100-32g``), or a custom dict of the
    fields."""
    if isinstance(name, Hardware):
        return name
    if isinstance(name, dict):
        base = HARDWARE.get(str(name.get("base", "")).lower())
        fields = {k: v for k, v in name.items() if k != "base"}
        try:
            return replace(base, **fields) if base else Hardware(**fields)
        except TypeError as exc:
            raise PlacementError(f"hardware {name!r}: {exc}; give 'base' (one of "
                                 f"{sorted(HARDWARE)}) and the fields to override") from None
    key = str(name).lower().replace("_", "-")
    if key in HARDWARE:
        return HARDWARE[key]
    raise PlacementError(f"hardware {name!r} is not a preset; use one of {sorted(HARDWARE)} or "
                         "a dict with 'base' and the fields to override")


@dataclass(frozen=True)
class DeviceGroup:
    """Nodes of one kind. ``inference_only`` groups (extra serving devices) take generation
    and inference calls but never a training call."""

    name: str
    nodes: int
    hardware: Hardware
    gpus_per_node: int = 0   # 0: the hardware's
    inference_only: bool = False

    def __post_init__(self) -> None:
        if not self.gpus_per_node:
            object.__setattr__(self, "gpus_per_node", self.hardware.gpus_per_node)
        g = self.gpus_per_node
        if self.nodes < 1 or g < 1 or g & (g - 1):
            raise PlacementError(f"group {self.name!r}: nodes must be >= 1 and gpus_per_node a "
                                 f"power of two (got {self.nodes} x {g})")

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cluster:
    """Device groups; global ranks run group by group, node by node, GPU by GPU."""

    groups: tuple[DeviceGroup, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.groups:
            raise PlacementError("a cluster needs at least one device group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise PlacementError(f"device group names must be unique, got {names}")
        if all(g.inference_only for g in self.groups):
            raise PlacementError("every group is inference_only: training needs one group "
                                 "with inference_only: false")

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int = 8, hw: str | Hardware = "a100-80g") -> Cluster:
        return cls((DeviceGroup("main", nodes, hardware(hw), gpus_per_node),))

    @property
    def size(self) -> int:
        return sum(g.size for g in self.groups)

    def offset(self, group: str) -> int:
        off = 0
        for g in self.groups:
            if g.name == group:
                return off
            off += g.size
        raise PlacementError(f"no device group {group!r}; groups are {[g.name for g in self.groups]}")

    def group(self, name: str) -> DeviceGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise PlacementError(f"no device group {name!r}; groups are {[g.name for g in self.groups]}")

    @property
    def train_group(self) -> DeviceGroup:
        return next(g for g in self.groups if not g.inference_only)

    def node_of(self, rank: int) -> tuple[str, int]:
        """(group name, node index within the cluster) of a global rank."""
        off = node_base = 0
        for g in self.groups:
            if rank < off + g.size:
                return g.name, node_base + (rank - off) // g.gpus_per_node
            off += g.size
            node_base += g.nodes
        raise PlacementError(f"rank {rank} is outside the cluster of {self.size} GPUs")

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [{"name": g.name, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
                            "hardware": g.hardware.to_dict(), "inference_only": g.inference_only}
                           for g in self.groups]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        """``{nodes, gpus_per_node, hardware}`` or ``{groups: [{name, nodes, gpus_per_node,
        hardware, inference_only}, ...]}``."""
        if not isinstance(d, dict):
            raise PlacementError("cluster: give a mapping such as {nodes: 8, gpus_per_node: 8, "
                                 "hardware: a100-80g}")
        if "groups" in d:
            groups = []
            for i, g in enumerate(d["groups"]):
                try:
                    hw = hardware(g.get("hardware", "a100-80g"))
                    groups.append(DeviceGroup(str(g.get("name", f"group{i}")), int(g["nodes"]), hw,
                                              int(g.get("gpus_per_node", 0)),
                                              bool(g.get("inference_only", False))))
                except KeyError:
                    raise PlacementError(f"cluster.groups[{i}]: 'nodes' is required") from None
            return cls(tuple(groups))
        unknown = set(d) - {"nodes", "gpus_per_node", "hardware"}
        if unknown:
            raise PlacementError(f"cluster: unknown keys {sorted(unknown)}; use nodes, "
                                 "gpus_per_node, hardware (or groups)")
        hw = hardware(d.get("hardware", "a100-80g"))
        return cls((DeviceGroup("main", int(d.get("nodes", 1)), hw,
                                int(d.get("gpus_per_node", 0))),))
