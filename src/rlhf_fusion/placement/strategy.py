"""Parallel strategies (dp, tp, pp) of one call on one mesh, and where each rank's shard lies.

Rank order inside a mesh is Megatron's: tensor-parallel fastest, then data-parallel, then
pipeline stages, so a tensor-parallel group never leaves a node (the mesh rules guarantee the
node is at least tp GPUs wide) and a pipeline stage is a contiguous block of ranks.

``zero=3`` is ZeRO stage 3 / FSDP over the data-parallel ranks (DeepSpeed-Chat's and OpenRLHF's
default, FlexRLHF's baseline): each data-parallel rank keeps only a 1/dp share of its (tp, pp)
shard's weights, gradients and optimizer state, and gathers the weights of each layer for every
forward and backward pass. ``zero=2`` (DeepSpeed-Chat's choice for 7B, FlexRLHF V-B) keeps
whole weights on every replica and shards gradients and optimizer state. ``zero=0`` is
Megatron's layout: every replica holds its whole shard
(with the optimizer state sharded over dp, as Megatron's distributed optimizer).
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
    zero: int = 0   # 0; 2: gradients and optimizer state sharded over dp; 3: weights too

    def __post_init__(self) -> None:
        if self.dp == 1 and self.zero:
            object.__setattr__(self, "zero", 0)   # sharding over one rank is no sharding

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, index: int) -> tuple[int, int, int]:
        """(dp, tp, pp) coordinates of the ``index``-th rank of the mesh."""
        return (index // self.tp) % self.dp, index % self.tp, index // (self.tp * self.dp)

    @property
    def sharded(self) -> bool:
        """ZeRO-3: a rank holds 1/dp of its (tp, pp) shard between passes."""
        return self.zero == 3

    def __str__(self) -> str:
        zero = f", zero={self.zero}" if self.zero else ""
        return f"(dp={self.dp}, tp={self.tp}, pp={self.pp}{zero})"

    def to_dict(self) -> dict[str, int]:
        d = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        if self.zero:
            d["zero"] = self.zero
        return d


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_strategy(s: ParallelStrategy, mesh: DeviceMesh, model: ModelShape) -> None:
    """Raises a PlacementError naming the fix when ``s`` does not fit ``mesh``."""
    if min(s.dp, s.tp, s.pp) < 1:
        raise PlacementError(f"{s}: every degree must be >= 1")
    if s.zero not in (0, 2, 3):
        raise PlacementError(f"{s}: zero={s.zero} is not modelled; use 0 (Megatron layout), 2 "
                             "(ZeRO-2: gradients and optimizer state sharded over dp) or 3 "
                             "(ZeRO-3 / FSDP over the data-parallel ranks)")
    if s.size != mesh.size:
        raise PlacementError(f"{s} uses dp*tp*pp = {s.size} GPUs but mesh {mesh} has "
                             f"{mesh.size}; choose degrees whose product is {mesh.size}")
    if mesh.n_gpus % s.tp:
        raise PlacementError(f"{s}: tp={s.tp} must divide the {mesh.n_gpus} GPUs per node of "
                             f"mesh {mesh} so tensor parallelism stays inside NVLink")
    if s.pp > model.layers:
        raise PlacementError(f"{s}: pp={s.pp} exceeds the model's {model.layers} layers")


def strategies_for(mesh: DeviceMesh, model: ModelShape, *, max_tp: int = 8,
                   max_pp: int | None = None, zero3: bool = False) -> list[ParallelStrategy]:
    """Every (dp, tp, pp) that fits ``mesh``: tp divides the node slice (and at most
    ``max_tp``), pp at most the layer count (and ``max_pp``); with ``zero3`` also the ZeRO-3
    variant of each one with dp > 1."""
    out = []
    for tp in _divisors(mesh.n_gpus):
        if tp > max_tp:
            continue
        rest = mesh.size // tp
        for pp in _divisors(rest):
            if pp > model.layers or (max_pp is not None and pp > max_pp):
                continue
            out.append(ParallelStrategy(rest // pp, tp, pp))
            if zero3 and rest // pp > 1:
                out.append(ParallelStrategy(rest // pp, tp, pp, 3))
    return out
