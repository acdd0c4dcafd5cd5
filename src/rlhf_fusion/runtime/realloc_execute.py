"""Execution of parameter reallocation between two layouts of one model (ReaLHF §6).

:func:`rlhf_fusion.placement.plan_realloc` plans how a model goes from a source
:class:`~rlhf_fusion.placement.MeshLayout` (mesh + (dp, tp, pp)) to a destination one: a list of
``Transfer(src, dst, layers, columns)`` rectangles in (layer, tensor-column) space, each from
the cheapest holder, so that every destination rank ends up with its shard and each byte it
lacks arrives exactly once. This module runs that list on ``torch.distributed`` with real
tensors of a Hugging Face Actor or Critic, bit for bit:

* **Layers.** Every parameter belongs to one layer index in ``[0, L)`` (``L`` decoder layers):
  decoder layer ``k`` to ``k``; embeddings, and anything registered before the decoder layers,
  to ``0`` (they live on the first pipeline stage); the final norm and the LM / value head, and
  anything after the layers, to ``L - 1`` (the last stage). A tensor tied under two names
  (LM head and token embedding) is moved once, under its first name (the embedding, layer 0);
  :func:`rlhf_fusion.runtime.weight_sync.full_state` restores the alias on a whole model.
* **Columns.** The tensor-parallel column ``[c0, c1)`` (``Fraction`` bounds) of a parameter with
  ``n`` rows in dim 0 is rows ``[floor(c0 n), floor(c1 n))`` of dim 0, for 1-D tensors too.
  ``floor`` is monotone, so the pieces of any tiling of ``[0, 1)`` tile the rows exactly and the
  intersection of two columns maps to the intersection of their rows: a piece the planner cuts
  is always a contiguous row block of every source and destination shard, and round trips are
  exact. (Rows may be empty when ``n < tp``, e.g. a value head of one row.)

Our runtime computes with tp = 1: the tp shards here are *storage* shards, what reallocation
moves and what a tensor-parallel engine would hold; they are not split along the dimension a
Megatron column/row-parallel layer would choose (dim 0 is the rows of ``nn.Linear.weight`` and
GPT-2's ``Conv1D`` stores the transpose), which changes which bytes sit where but not how many.

Layer ranges per stage are the planner's (:meth:`Layout.stage_layers`: ``stage * L // pp``),
so the planner and the runtime agree on every rectangle; they equal
:func:`~rlhf_fusion.runtime.partition.split_layers`' whenever ``pp`` divides ``L``.

Transport: one flat byte buffer per transfer (pieces of every parameter in the rectangle,
concatenated in name order), all sends and receives of a call posted at once in plan order with
``batch_isend_irecv`` (NCCL groups them, so two ranks sending to each other cannot block each
other), every wait bounded by ``timeout``. Gloo on CPU; NCCL with tensors on ``device``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..placement.hardware import Cluster
from ..placement.models import ModelShape
from ..placement.realloc_plan import (
    MeshLayout,
    ReallocPlan,
    Rect,
    Transfer,
    intersect,
    plan_realloc,
)
from .errors import PeerError, PipelineTimeoutError
from .partition import _layers, _layout, num_layers

__all__ = [
    "ParamTable",
    "ReallocResult",
    "assemble",
    "column_rows",
    "execute",
    "layer_of",
    "local_shard",
    "param_table",
    "realloc_model_shape",
    "shard",
    "shard_bytes",
]


# -- which layer, which rows ----------------------------------------------------------------------
def layer_of(model: nn.Module, role: str) -> dict[str, int]:
    """Parameter name -> layer index in ``[0, L)``, every tensor once (tied ones under their
    first name), in ``named_parameters`` order.

    ``model`` may be on the meta device (only names and order are read); build the map (and
    :func:`param_table`) from the whole model, not a pipeline stage: on a stage that dropped the
    embedding a tied LM head shows up under its own name (layer ``L - 1``). ``role`` is
    ``"actor"`` or ``"critic"`` (:class:`~rlhf_fusion.runtime.partition.CriticModel` or a
    ``*ForSequenceClassification``).
    """
    lay = _layout(model, role)
    L = num_layers(model, role)
    base = getattr(model, lay.base_attr)
    container = _layers(base, lay.family)
    # The decoder layers' own prefix, found by identity so wrappers with other attribute names
    # (``backbone``, ``transformer``) need no special case.
    prefix = _container_prefix(model, container)
    out: dict[str, int] = {}
    seen_layers = False
    for name, _ in model.named_parameters():  # remove_duplicate: a tied tensor once
        if name.startswith(prefix):
            out[name] = int(name[len(prefix):].split(".", 1)[0])
            seen_layers = True
        else:
            # Registration order is forward order in the supported families: what comes
            # before the decoder layers runs on the first stage, what comes after on the last.
            out[name] = L - 1 if seen_layers else 0
    return out


def _container_prefix(model: nn.Module, container: nn.Module) -> str:
    for n, m in model.named_modules():
        if m is container:
            return f"{n}."
    raise ValueError(f"{type(model).__name__}: decoder layers are not a submodule of the model")


def column_rows(n: int, columns: tuple[Fraction, Fraction]) -> tuple[int, int]:
    """Rows ``[floor(c0 n), floor(c1 n))`` of a dim 0 of size ``n`` for column ``[c0, c1)``."""
    c0, c1 = Fraction(columns[0]), Fraction(columns[1])
    return c0.numerator * n // c0.denominator, c1.numerator * n // c1.denominator


def _rows_of(t_shape: torch.Size, columns: tuple[Fraction, Fraction]) -> tuple[int, int]:
    if len(t_shape) == 0:
        raise ValueError("reallocation: 0-d parameters have no rows to shard; reshape to (1,)")
    return column_rows(t_shape[0], columns)


def shard(state: Mapping[str, Tensor], layer_of: Mapping[str, int],
          layers_range: tuple[int, int], cols: tuple[Fraction, Fraction]) -> dict[str, Tensor]:
    """The shard of whole tensors ``state`` for layers ``[l0, l1)`` and column ``cols``.

    Returns ``{name: state[name][r0:r1]}`` (views, detached; shape ``[r1 - r0, *rest]``, possibly
    0 rows) for every name of ``layer_of`` whose layer is in the range, in ``layer_of``'s order.
    """
    l0, l1 = layers_range
    out: dict[str, Tensor] = {}
    for name, layer in layer_of.items():
        if l0 <= layer < l1:
            t = state[name]
            r0, r1 = _rows_of(t.shape, cols)
            out[name] = t.detach()[r0:r1]
    return out


# -- what every rank knows about the model ---------------------------------------------------------
@dataclass(frozen=True)
class ParamTable:
    """What every rank knows about a model without its weights: all :func:`execute` needs
    besides the local shard. Build it with :func:`param_table` from the model or from a
    meta-device copy of it (``with torch.device("meta"): ...``).

    ``names``: moved parameters in ``named_parameters`` order (the order of every transfer
    buffer); ``layer``: name -> layer in ``[0, num_layers)``; ``shapes`` / ``dtypes``: the
    whole tensor's (a shard of column ``[c0, c1)`` is ``[floor(c1 n) - floor(c0 n), *shape[1:]]``
    with ``n = shape[0]``); ``hidden``: only for the planner's :class:`ModelShape`.
    """

    names: tuple[str, ...]
    layer: dict[str, int]
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    num_layers: int
    hidden: int = 1

    def nbytes(self, name: str, rows: int) -> int:
        shape = self.shapes[name]
        per_row = _itemsize(self.dtypes[name])
        for d in shape[1:]:
            per_row *= d
        return rows * per_row


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def param_table(model: nn.Module, role: str) -> ParamTable:
    """The :class:`ParamTable` of an Actor (``role="actor"``) or Critic model (meta is fine)."""
    lay = layer_of(model, role)
    params = dict(model.named_parameters())
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 1) or 1)
    return ParamTable(
        names=tuple(lay),
        layer=lay,
        shapes={n: params[n].shape for n in lay},
        dtypes={n: params[n].dtype for n in lay},
        num_layers=num_layers(model, role),
        hidden=hidden,
    )


def realloc_model_shape(table: ParamTable) -> ModelShape:
    """The planner's :class:`ModelShape` for this model: its real parameter count and layers
    (its bytes assume bf16 and spread embeddings over layers; :func:`execute` counts real ones).

    Which rank sends which rectangle depends only on ``layers`` (the rectangles) and on byte
    loads that are all proportional to ``params``, so any shape with ``L`` layers gives the same
    transfer list. We still pass the real count so the plan's own ``seconds`` and byte estimate
    (embeddings spread over layers) are on the model's scale next to the real bytes we count.
    """
    params = sum(table.shapes[n].numel() for n in table.names)
    return ModelShape(float(max(params, 1)), table.num_layers, max(table.hidden, 1),
                      name="realloc")


def shard_bytes(table: ParamTable, rect: Rect, within: Rect | None = None) -> int:
    """Real bytes of rectangle ``rect`` (intersected with ``within`` when given)."""
    if within is not None:
        r = intersect(rect, within)
        if r is None:
            return 0
        rect = r
    total = 0
    for n in table.names:
        if rect[0] <= table.layer[n] < rect[1]:
            r0, r1 = _rows_of(table.shapes[n], (rect[2], rect[3]))
            total += table.nbytes(n, r1 - r0)
    return total


# -- building and assembling shards ----------------------------------------------------------------
def local_shard(model: nn.Module, role: str, layout: MeshLayout, rank: int) -> dict[str, Tensor] | None:
    """``rank``'s shard of a whole ``model`` in ``layout`` (copies, so the model can be freed),
    or ``None`` when ``rank`` is not in the layout's mesh."""
    lay = layer_of(model, role)
    rect = layout.shards(num_layers(model, role)).get(rank)
    if rect is None:
        return None
    params = dict(model.named_parameters())
    return {n: t.clone() for n, t in shard(params, lay, (rect[0], rect[1]),
                                          (rect[2], rect[3])).items()}


def assemble(table: ParamTable, layout: MeshLayout, shards: Mapping[int, Mapping[str, Tensor]],
             device: torch.device | str | None = None) -> dict[str, Tensor]:
    """Whole tensors from shards of one layout (rank -> shard); a data-parallel replica is read
    from its lowest rank. Raises ``KeyError`` naming what no given shard covers."""
    rects = layout.shards(table.num_layers)
    out: dict[str, Tensor] = {}
    covered: dict[str, int] = {n: 0 for n in table.names}
    done: set[Rect] = set()
    for r in sorted(shards):
        rect = rects[r]
        if rect in done:
            continue
        done.add(rect)
        for n, piece in shards[r].items():
            shape = table.shapes[n]
            if n not in out:
                dev = device if device is not None else piece.device
                out[n] = torch.empty(shape, dtype=table.dtypes[n], device=dev)
            r0, r1 = _rows_of(shape, (rect[2], rect[3]))
            out[n][r0:r1].copy_(piece)
            covered[n] += r1 - r0
    missing = [n for n in table.names if covered[n] != table.shapes[n][0]]
    if missing:
        raise KeyError(f"assemble: shards of ranks {sorted(shards)} do not cover "
                       f"{missing[:3]} ({len(missing)} parameters); give one shard of every "
                       f"(stage, tp) position of {layout.strategy}")
    return out


# -- execution -----------------------------------------------------------------------------------
@dataclass
class ReallocResult:
    """What :func:`execute` did. ``bytes`` and ``min_bytes`` are global (every rank computes
    the same figures from the plan on real tensor sizes); ``sent_bytes`` / ``recv_bytes`` are
    this rank's buffers as actually posted; ``transfers`` counts the plan's transfers this rank
    sends or receives."""

    shard: dict[str, Tensor] | None
    bytes: int
    min_bytes: int
    sent_bytes: int
    recv_bytes: int
    transfers: int
    plan: ReallocPlan


def _pieces(table: ParamTable, t: Transfer) -> list[tuple[str, int, int]]:
    """(name, first row, end row) of the whole tensor for every parameter in ``t``'s rectangle,
    in table order (the buffer layout both ends agree on)."""
    out = []
    for n in table.names:
        if t.layers[0] <= table.layer[n] < t.layers[1]:
            r0, r1 = _rows_of(table.shapes[n], t.columns)
            if r1 > r0:
                out.append((n, r0, r1))
    return out


def _describe(t: Transfer) -> str:
    return (f"layers [{t.layers[0]}, {t.layers[1]}) columns [{t.columns[0]}, {t.columns[1]}) "
            f"from rank {t.src} to rank {t.dst} over {t.link}")


def execute(
    table: ParamTable,
    src: MeshLayout,
    dst: MeshLayout,
    local: Mapping[str, Tensor] | None,
    cluster: Cluster,
    *,
    device: torch.device | str | None = None,
    timeout: float = 300.0,
    group: dist.ProcessGroup | None = None,
    plan: ReallocPlan | None = None,
) -> ReallocResult:
    """Reallocate a model from layout ``src`` to ``dst``; returns this rank's new shard.

    Every rank of either mesh calls this with the same ``table``, layouts and cluster (ranks of
    the layouts are global ranks; a rank in neither mesh may call it too, it moves nothing);
    ``local`` is this rank's shard in ``src``
    (``{name: rows of the whole tensor}``, as :func:`local_shard` / :func:`shard` build it) or
    ``None`` when the rank is not in the source mesh. The result's ``shard`` is this rank's
    shard in ``dst`` (new tensors on ``device``; default: the source shard's device, else CPU),
    or ``None`` outside the destination mesh. What a destination rank already holds is copied
    locally, never sent (the planner's rule). ``plan`` may be given when the caller already
    computed ``plan_realloc(realloc_model_shape(table), src, dst, cluster)``; it must be that
    plan. Waits are bounded by ``timeout`` seconds (:class:`PipelineTimeoutError` names the
    transfer). With NCCL the group must already be initialised by a collective on every rank
    (``batch_isend_irecv``'s first-call rule) and ``device`` must be this rank's GPU.
    """
    rank = dist.get_rank()
    L = table.num_layers
    src_sh = src.shards(L)
    dst_sh = dst.shards(L)
    if plan is None:
        plan = plan_realloc(realloc_model_shape(table), src, dst, cluster)
    own = src_sh.get(rank)
    if own is not None:
        if local is None:
            raise ValueError(f"reallocation: rank {rank} is in the source mesh {src.mesh} but "
                             "got no source shard; pass local_shard(...) of this rank")
        _check_shard(table, own, local, rank)
    if device is None:
        first = next(iter(local.values()), None) if local else None
        device = first.device if first is not None else torch.device("cpu")

    # Every rank computes the same real byte counts from the plan.
    total = sum(shard_bytes(table, (*t.layers, *t.columns)) for t in plan.transfers)
    min_bytes = 0
    for r, want in dst_sh.items():
        min_bytes += shard_bytes(table, want) - (shard_bytes(table, want, src_sh[r])
                                                 if r in src_sh else 0)

    want = dst_sh.get(rank)
    out: dict[str, Tensor] | None = None
    filled = 0
    if want is not None:
        out = {}
        for n in table.names:
            if want[0] <= table.layer[n] < want[1]:
                r0, r1 = _rows_of(table.shapes[n], (want[2], want[3]))
                out[n] = torch.empty((r1 - r0, *table.shapes[n][1:]), dtype=table.dtypes[n],
                                     device=device)
        # What this rank already holds stays: a local copy, no message.
        keep = intersect(own, want) if own is not None else None
        if keep is not None:
            assert local is not None
            for n in table.names:
                if keep[0] <= table.layer[n] < keep[1]:
                    k0, k1 = _rows_of(table.shapes[n], (keep[2], keep[3]))
                    o0 = _rows_of(table.shapes[n], (own[2], own[3]))[0]
                    w0 = _rows_of(table.shapes[n], (want[2], want[3]))[0]
                    out[n][k0 - w0:k1 - w0].copy_(local[n][k0 - o0:k1 - o0])
                    filled += table.nbytes(n, k1 - k0)

    ops: list[dist.P2POp] = []
    posted: list[tuple[Transfer, Tensor | None]] = []   # (transfer, receive buffer or None)
    sent = received = 0
    # Plan order on every rank, one tag per transfer: both ends agree on the pairing of the
    # messages between two ranks without any handshake.
    for tag, t in enumerate(plan.transfers):
        if rank not in (t.src, t.dst):
            continue
        pieces = _pieces(table, t)
        nbytes = sum(table.nbytes(n, r1 - r0) for n, r0, r1 in pieces)
        if nbytes == 0:
            continue
        if t.src == rank:
            assert local is not None and own is not None
            parts = []
            for n, r0, r1 in pieces:
                o0 = _rows_of(table.shapes[n], (own[2], own[3]))[0]
                parts.append(_bytes_view(local[n][r0 - o0:r1 - o0]))
            buf = torch.cat(parts).to(device)
            ops.append(dist.P2POp(dist.isend, buf, t.dst, group, tag))
            posted.append((t, None))
            sent += buf.numel()
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, t.src, group, tag))
            posted.append((t, buf))
            received += nbytes
    if ops:
        # Gloo honours the per-wait timeout; NCCL's wait only orders the current stream after
        # the communication (unpacking below stays correct) and a stall surfaces through the
        # process group's own timeout / watchdog.
        works = dist.batch_isend_irecv(ops)
        deadline = time.monotonic() + timeout
        for w, op, (t, _) in zip(works, ops, posted, strict=True):
            what = ("sending" if op.op is dist.isend else "receiving") + " " + _describe(t)
            left = max(deadline - time.monotonic(), 0.001)
            try:
                ok = w.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                raise _fail(exc, rank, what, timeout) from exc
            if ok is False:
                raise PipelineTimeoutError(f"reallocation on rank {rank} timed out after "
                                           f"{timeout:g} s {what}; a peer stalled or died")
    for t, buf in posted:
        if buf is None:
            continue
        assert out is not None and want is not None
        off = 0
        for n, r0, r1 in _pieces(table, t):
            nb = table.nbytes(n, r1 - r0)
            w0 = _rows_of(table.shapes[n], (want[2], want[3]))[0]
            _bytes_view(out[n][r0 - w0:r1 - w0]).copy_(buf[off:off + nb])
            off += nb
            filled += nb
    if want is not None and filled != shard_bytes(table, want):
        # The planner tiles every destination shard exactly; anything else is a bug there.
        raise RuntimeError(f"reallocation: rank {rank} filled {filled} of "
                           f"{shard_bytes(table, want)} bytes of its shard {want}; the plan "
                           "does not tile it")
    return ReallocResult(out, total, min_bytes, sent, received,
                         sum(1 for t in plan.transfers if rank in (t.src, t.dst)), plan)


def _bytes_view(t: Tensor) -> Tensor:
    """A contiguous row block as flat bytes (a view: writes land in ``t``)."""
    if not t.is_contiguous():
        raise ValueError("reallocation: shard tensors must be contiguous row blocks")
    return t.reshape(-1).view(torch.uint8)


def _check_shard(table: ParamTable, rect: Rect, local: Mapping[str, Tensor], rank: int) -> None:
    expected = [n for n in table.names if rect[0] <= table.layer[n] < rect[1]]
    missing = [n for n in expected if n not in local]
    if missing:
        raise ValueError(f"reallocation: rank {rank}'s source shard lacks {missing[:3]} "
                         f"({len(missing)} of {len(expected)} parameters of layers "
                         f"[{rect[0]}, {rect[1]})); build it with local_shard/shard")
    for n in expected:
        r0, r1 = _rows_of(table.shapes[n], (rect[2], rect[3]))
        shape = (r1 - r0, *table.shapes[n][1:])
        if tuple(local[n].shape) != shape or local[n].dtype != table.dtypes[n]:
            raise ValueError(f"reallocation: rank {rank}'s source shard of {n} is "
                             f"{tuple(local[n].shape)} {local[n].dtype}, expected {shape} "
                             f"{table.dtypes[n]} (columns [{rect[2]}, {rect[3]}))")


def _fail(exc: BaseException, rank: int, what: str, timeout: float) -> Exception:
    msg = str(exc)
    if "imed out" in msg or "imeout" in msg:
        return PipelineTimeoutError(f"reallocation on rank {rank} timed out after {timeout:g} s "
                                    f"{what}; a peer stalled or died")
    return PeerError(f"reallocation on rank {rank} failed {what}: {msg}")
