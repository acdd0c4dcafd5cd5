"""Parallel strategies (dp, tp, pp) of one call on one mesh, and where each rank's shard lies.

Rank order inside a mesh is Megatron's: tensor-parallel fastest, then data-parallel, then
pipeline stages, so a tensor-parallel group never leaves a node (the mesh rules guarantee the
node is at least tp GPUs wide) and a pipeline stage is a contiguous block of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlacementError
from .mesh import DeviceMesh
from .models import ModelShape


@dataclass(frozen=True, order=True)
class ParallelStrategy:
    dp: int
    tp: int
    pp: int

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, index: int) -> tuple[int, int, int]:
        """(dp, tp, pp) coordinates of the ``index``-th rank of the mesh."""
        return (index // self.tp) % self.dp, index % self.tp, index // (self.tp * self.dp)

    def __str__(self) -> str:
        return f"(dp={self.dp}, tp={self.tp}, pp={self.pp})"

    def to_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_strategy(s: ParallelStrategy, mesh: DeviceMesh, model: ModelShape) -> None:
    """Raises a PlacementError naming the fix when ``s`` does not fit ``mesh``."""
    if min(s.dp, s.tp, s.pp) < 1:
        raise PlacementError(f"{s}: every degree must be >= 1")
    if s.size != mesh.size:
        raise PlacementError(f"{s} uses dp*tp*pp = {s.size} GPUs but mesh {mesh} has "
                             f"{mesh.size}; choose degrees whose product is {mesh.size}")
    if mesh.n_gpus % s.tp:
        raise PlacementError(f"{s}: tp={s.tp} must divide the {mesh.n_gpus} GPUs per node of "
                             f"mesh {mesh} so tensor parallelism stays inside NVLink")
    if s.pp > model.layers:
        raise PlacementError(f"{s}: pp={s.pp} exceeds the model's {model.layers} layers")


def strategies_for(mesh: DeviceMesh, model: ModelShape, *, max_tp: int = 8,
                   max_pp: int | None = None) -> list[ParallelStrategy]:
    """Every (dp, tp, pp) that fits ``mesh``: tp divides the node slice (and at most
    ``max_tp``), pp at most the layer count (and ``max_pp``)."""
    out = []
    for tp in _divisors(mesh.n_gpus):
        if tp > max_tp:
            continue
        rest = mesh.size // tp
        for pp in _divisors(rest):
            if pp > model.layers or (max_pp is not None and pp > max_pp):
                continue
            out.append(ParallelStrategy(rest // pp, tp, pp))
    return out
