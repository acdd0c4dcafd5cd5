"""The layouts (dp, tp, pp, zero) a call may take on a mesh, and the check that one fits.

The type itself is :class:`~rlhf_fusion.placement.layout.Layout` (rank order and ZeRO stages
are described there).
"""

from __future__ import annotations

from .errors import PlacementError
from .layout import Layout
from .mesh import DeviceMesh
from .models import ModelShape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_strategy(s: Layout, mesh: DeviceMesh, model: ModelShape) -> None:
    """Raises a PlacementError naming the fix when ``s`` does not fit ``mesh``."""
    # Degrees and ZeRO stage were checked when the Layout was made.
    if s.size != mesh.size:
        raise PlacementError(f"{s} uses dp*tp*pp = {s.size} GPUs but mesh {mesh} has "
                             f"{mesh.size}; choose degrees whose product is {mesh.size}")
    if mesh.n_gpus % s.tp:
        raise PlacementError(f"{s}: tp={s.tp} must divide the {mesh.n_gpus} GPUs per node of "
                             f"mesh {mesh} so tensor parallelism stays inside NVLink")
    if s.pp > model.layers:
        raise PlacementError(f"{s}: pp={s.pp} exceeds the model's {model.layers} layers")


def strategies_for(mesh: DeviceMesh, model: ModelShape, *, max_tp: int = 8,
                   max_pp: int | None = None, zero3: bool = False) -> list[Layout]:
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
            out.append(Layout(rest // pp, tp, pp))
            if zero3 and rest // pp > 1:
                out.append(Layout(rest // pp, tp, pp, 3))
    return out
