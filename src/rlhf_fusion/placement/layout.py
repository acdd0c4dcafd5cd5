"""One model call's layout on its ranks: the one type for (ranks, dp, tp, pp, ZeRO).

The planner's strategies (a mesh's ``(dp, tp, pp, zero)`` before ranks are given), the loop's
calls and the runtime's training layouts are all a :class:`Layout`; it is checked once, here,
when it is made (as torchtitan's ``ParallelDims``), and its :attr:`Layout.kind` names which
training engine runs it (:mod:`rlhf_fusion.runtime.engine_kinds`).

Rank order inside a layout is Megatron's: tensor-parallel fastest, then data-parallel, then
pipeline stages, so a tensor-parallel group never leaves a node and a pipeline stage is a
contiguous block of ranks.

``zero=3`` is ZeRO stage 3 / FSDP over the data-parallel ranks (DeepSpeed-Chat's and
OpenRLHF's default, FlexRLHF's baseline): each data-parallel rank keeps only a 1/dp share of
its (tp, pp) shard's weights, gradients and optimizer state, and gathers the weights of each
layer for every forward and backward pass. ``zero=2`` (DeepSpeed-Chat's choice for 7B,
FlexRLHF V-B) keeps whole weights on every replica and shards gradients and optimizer state.
``zero=0`` is Megatron's layout: every replica holds its whole shard (with the optimizer state
sharded over dp, as Megatron's distributed optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .errors import PlacementError

# How a call's model is trained on its ranks; each kind is one training engine
# (rlhf_fusion.runtime.engine_kinds.ENGINES). A new kind is a new value here and one class.
DATA_PARALLEL = "data_parallel"     # whole copies; training all-reduces their gradients
FUSED_PIPELINE = "fused_pipeline"   # the fused Actor/Critic pipeline (pp stages)
TENSOR_PARALLEL = "tensor_parallel"   # dp groups of tp ranks, DTensor Megatron plans
ZERO3 = "zero3"                       # FSDP2 fully_shard over the call's ranks
KINDS = (DATA_PARALLEL, FUSED_PIPELINE, TENSOR_PARALLEL, ZERO3)


@dataclass(frozen=True, order=True)
class Layout:
    """``dp * tp * pp`` ranks (``ranks``, in mesh order; empty while only the degrees are
    chosen, as in the planner's search) and ZeRO stage ``zero`` (0, 2 or 3).

    ``kind``: which training engine runs it (:data:`KINDS`), derived from the degrees when
    not given: ``fused_pipeline`` for ``pp > 1``, else ``tensor_parallel`` for ``tp > 1``,
    else ``zero3`` for ``zero = 3``, else ``data_parallel``. Given, it is kept only where the
    degrees leave a choice: ``fused_pipeline`` with one stage per replica (the loop's default
    with ``fusion.pipeline_stages: 1``), or a kind outside :data:`KINDS` (a new engine's,
    refused by whoever has no engine for it); a known kind is otherwise re-derived, so
    ``dataclasses.replace`` of the degrees never leaves a stale kind."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0   # 0; 2: gradients and optimizer state sharded over dp; 3: weights too
    ranks: tuple[int, ...] = ()
    kind: str = ""

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp) < 1:
            raise PlacementError(f"{self}: every degree must be >= 1")
        if self.zero not in (0, 2, 3):
            raise PlacementError(
                f"{self}: zero={self.zero} is not modelled; use 0 (Megatron layout), 2 (ZeRO-2: "
                "gradients and optimizer state sharded over dp) or 3 (ZeRO-3 / FSDP over the "
                "data-parallel ranks)")
        if self.ranks and len(self.ranks) != self.size:
            raise PlacementError(f"{self}: dp*tp*pp = {self.size} on {len(self.ranks)} ranks "
                                 f"{list(self.ranks)}; dp*tp*pp must equal the rank count")
        if len(set(self.ranks)) != len(self.ranks):
            raise PlacementError(f"{self}: ranks {list(self.ranks)} repeat a rank")
        if self.dp == 1 and self.zero:
            object.__setattr__(self, "zero", 0)   # sharding over one rank is no sharding
        derived = (FUSED_PIPELINE if self.pp > 1 else TENSOR_PARALLEL if self.tp > 1
                   else ZERO3 if self.zero == 3 else DATA_PARALLEL)
        if self.kind in KINDS and self.kind != FUSED_PIPELINE or not self.kind:
            object.__setattr__(self, "kind", derived)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def zero3(self) -> bool:
        """ZeRO-3: a rank holds 1/dp of its (tp, pp) shard between passes."""
        return self.zero == 3

    @property
    def dtensor(self) -> bool:
        """Parameters are DTensor shards when trained (tensor parallel or ZeRO-3)."""
        return self.tp > 1 or self.zero == 3

    def on(self, ranks: tuple[int, ...] | list[int]) -> Layout:
        """These degrees on ``ranks``."""
        return Layout(self.dp, self.tp, self.pp, self.zero, tuple(ranks), self.kind)

    def degrees(self) -> Layout:
        """These degrees without ranks (what the planner compares)."""
        return Layout(self.dp, self.tp, self.pp, self.zero)

    def coords(self, index: int) -> tuple[int, int, int]:
        """(dp, tp, pp) coordinates of the ``index``-th rank of the mesh."""
        return (index // self.tp) % self.dp, index % self.tp, index // (self.tp * self.dp)

    # -- ranks -------------------------------------------------------------------------------
    def index(self, rank: int) -> int:
        """``rank``'s position in the layout (its data-parallel index with tp = pp = 1)."""
        return self.ranks.index(rank)

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        """The tensor-parallel group of ``rank`` (consecutive in the mesh)."""
        i = self.ranks.index(rank) // self.tp * self.tp
        return self.ranks[i: i + self.tp]

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank``'s gradients are summed with (equal tp index; pp = 1)."""
        return self.ranks[self.ranks.index(rank) % self.tp:: self.tp]

    def dp_index(self, rank: int) -> int:
        return self.ranks.index(rank) // self.tp

    def groups(self) -> list[tuple[int, ...]]:
        """Every rank set a data-parallel, tensor-parallel or ZeRO-3 layout communicates over:
        its ranks, its tp and dp groups."""
        out = {self.ranks}
        for r in self.ranks:
            out.add(self.tp_ranks(r))
            out.add(self.dp_ranks(r))
        return sorted(out)

    # -- shards (parameter reallocation) ------------------------------------------------------
    def stage_layers(self, stage: int, layers: int) -> tuple[int, int]:
        return stage * layers // self.pp, (stage + 1) * layers // self.pp

    def shards(self, layers: int) -> dict[int, tuple[int, int, Fraction, Fraction]]:
        """rank -> (first layer, end layer, first column, end column)."""
        out = {}
        for i, r in enumerate(self.ranks):
            d, t, st = self.coords(i)
            l0, l1 = self.stage_layers(st, layers)
            if self.zero3:
                l0, l1 = (l0 + Fraction((l1 - l0) * d, self.dp),
                          l0 + Fraction((l1 - l0) * (d + 1), self.dp))
            out[r] = (l0, l1, Fraction(t, self.tp), Fraction(t + 1, self.tp))
        return out

    def __str__(self) -> str:
        zero = f", zero={self.zero}" if self.zero else ""
        return f"(dp={self.dp}, tp={self.tp}, pp={self.pp}{zero})"

    def to_dict(self) -> dict[str, int]:
        d = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        if self.zero:
            d["zero"] = self.zero
        return d
