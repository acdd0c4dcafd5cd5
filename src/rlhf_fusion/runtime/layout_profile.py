"""A training call's costs in a parallel layout, measured as the loop runs it.

ReaLHF's estimator profiles "the cost of forward, backward, and associated communication
(e.g., all-reduce) of individual layers" (ReaLHF, Sec. 5.1). :func:`~rlhf_fusion.runtime.
layer_profile.profile_layers` times one device's layers; this times a layout on its ranks, with
the engines the loop trains on (:func:`~rlhf_fusion.runtime.sharded_train.shard_for_training`:
DTensor for tp, FSDP2 for ZeRO-3, whole copies for data parallel), so the figures include the
tensor-parallel all-reduces, FSDP's gathers and reduce-scatters, the engines' per-layer
Python and the ranks sharing one machine. The cost model reads them in place of its analytic
communication terms (:meth:`rlhf_fusion.placement.profile.Profile.layout`).

Method: hooks cannot bracket FSDP2's work (its pre-forward hook is prepended to the layer's,
its backward work hangs off autograd hooks on the inputs and outputs), so whole passes of a
micro-batch are timed: the loop's forward (``model_outputs``), its PPO loss, backward. Each
pass runs on the model built at two depths ``d1 < d2`` (1 and the model's own, by default),
the two alternating pass by pass: a layer costs ``(T(d2) - T(d1)) / (d2 - d1)``, the rest of a
pass (embeddings, head, loss) ``T(d1) - d1 * layer``. What a mini-batch step adds to its passes
(the data-parallel gradient all-reduce, the statistics' all-reduce, gradient clipping, AdamW,
``zero_grad``) is timed inside the loop's own
:func:`~rlhf_fusion.runtime.sharded_train.data_parallel_step`, around its passes, at both
depths: seconds at two parameter counts, which the cost model extends linearly; so is a
sharded layout's ``gather`` (``full_state_dict``: the whole weights on every rank, where the
loop's weight sync starts from a tp or ZeRO-3 layout). Every figure
is the median of ``repeats`` timed passes (after one warm-up); a pass the slowest rank's, a
step's extra the fastest rank's (the others' includes waiting for the slowest in the step's
all-reduce).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..placement.layout import Layout
from ..placement.profile import FORMAT, layout_key
from .fused import default_loss_fns, model_outputs
from .microbatch import split_micro_batches
from .ppo import PPOConfig
from .sharded_state import full_state_dict
from .sharded_train import data_parallel_step, layout_groups, shard_for_training

__all__ = ["check_layouts", "default_depths", "median_layouts", "profile_layouts"]

MAX_DEPTH = 8


def _micro_batch(rows: int, length: int, vocab: int, gen: torch.Generator) -> dict[str, Tensor]:
    """A micro-batch with every key the PPO losses read: a prompt half, a response half, and
    left padding on every row but the first (as the loop's batches of prompts of different
    lengths have: attention then runs with a real mask, not the causal shortcut)."""
    ids = torch.randint(2, vocab, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    for i in range(1, rows):
        mask[i, : (i % 4) * length // 16] = 0
    act = torch.zeros(rows, length, dtype=torch.long)
    act[:, length // 2:] = 1
    small = {k: 0.1 * torch.randn(rows, length, generator=gen)
             for k in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")}
    small["old_logprobs"] = small["old_logprobs"] - 2.0
    batch = {"input_ids": ids, "attention_mask": mask, "action_mask": act, **small}
    return dict(split_micro_batches(batch, 1)[0])


def _timed_pass(role: str, model: Any, mb: dict[str, Tensor], loss_fn: Callable
                ) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss, _ = loss_fn(model_outputs(role, model, mb), mb)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _over_ranks(x: float, op: Any) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def _layout_rank(rank: int, world: int, config: Any, role: str, build: Callable[[Any], Any],
                 layouts: Sequence[tuple[int, int, int]], tokens: Sequence[int], seq_len: int,
                 repeats: int, lr: float, depths: tuple[int, int]) -> dict[str, Any]:
    import copy

    loss_fn = default_loss_fns(PPOConfig())[role]
    vocab = int(config.vocab_size)
    out: dict[str, Any] = {}
    groups: dict[tuple[int, ...], Any] = {}
    for dp, tp, zero in layouts:
        lay = Layout(dp, tp, 1, zero, tuple(range(dp * tp)))
        for g in layout_groups(lay):   # collective: every rank, in one order
            if g not in groups:
                groups[g] = (dist.group.WORLD if len(g) == world
                             else dist.new_group(list(g)))
        holds = rank in lay.ranks
        models, opts, params = {}, {}, {}
        for depth in depths:
            conf = copy.deepcopy(config)
            conf.num_hidden_layers = depth
            models[depth] = build(conf).train()
            params[depth] = sum(p.numel() for p in models[depth].parameters())
            if holds:
                shard_for_training(models[depth], role, lay, rank, groups, torch.device("cpu"))
            opts[depth] = torch.optim.AdamW(models[depth].parameters(), lr=lr, eps=1e-5)
        gen = torch.Generator().manual_seed(0)
        # The depths alternate pass by pass: a drift in the machine's speed meets both.
        passes: dict[int, dict[int, tuple[float, float]]] = {d: {} for d in depths}
        for n in sorted(set(tokens)):
            rows, length = (max(1, n // seq_len), seq_len) if n >= seq_len else (1, n)
            mb = _micro_batch(rows, length, vocab, gen)
            runs: dict[int, list[tuple[float, float]]] = {d: [] for d in depths}
            for r in range(repeats + 1):
                for depth in depths:
                    fb = (_timed_pass(role, models[depth], mb, loss_fn) if holds
                          else (0.0, 0.0))
                    if r:
                        runs[depth].append(fb)
            for depth in depths:
                passes[depth][rows * length] = (statistics.median(f for f, _ in runs[depth]),
                                                statistics.median(b for _, b in runs[depth]))
        # One mini-batch step of one micro-batch per data-parallel replica, as the loop runs
        # it; what it adds to its passes is timed around them in the same call.
        n = min(passes[depths[0]])
        rows, length = (max(1, n // seq_len), seq_len) if n >= seq_len else (1, n)
        mbs = [_micro_batch(rows, length, vocab, gen) for _ in range(dp)]
        extra: dict[int, list[float]] = {d: [] for d in depths}
        for r in range(repeats + 1):
            for depth in depths:
                t0 = time.perf_counter()
                inner: dict[str, float] = {}
                if holds:
                    data_parallel_step(models[depth], role, lay, rank, mbs, {role: loss_fn},
                                       opts[depth], groups, 1.0, timings=inner)
                if r:
                    extra[depth].append(time.perf_counter() - t0 - inner.get("passes_s", 0.0))
        steps = {params[d]: statistics.median(extra[d]) for d in depths}
        # A sharded layout's weight sync starts by gathering whole weights on every rank
        # (full_state_dict: a collective per parameter), as the loop's does.
        gathers: dict[int, float] = {}
        if lay.dtensor:
            for depth in depths:
                ts = []
                for r in range(repeats + 1):
                    t0 = time.perf_counter()
                    if holds:
                        full_state_dict(models[depth])
                    if r:
                        ts.append(time.perf_counter() - t0)
                gathers[params[depth]] = statistics.median(ts)
        del models, opts
        d1, d2 = depths
        table: dict[str, Any] = {"forward": {}, "backward": {}, "rest_forward": {},
                                 "rest_backward": {}, "step": {}}
        for n in passes[d1]:
            for i, (key, rest) in enumerate((("forward", "rest_forward"),
                                             ("backward", "rest_backward"))):
                t1 = _over_ranks(passes[d1][n][i], dist.ReduceOp.MAX)
                t2 = _over_ranks(passes[d2][n][i], dist.ReduceOp.MAX)
                # at least a microsecond: a layer is never free (noise can say so at small n)
                layer = max((t2 - t1) / (d2 - d1), 1e-6)
                table[key][str(n)] = layer
                table[rest][str(n)] = max(0.0, t1 - d1 * layer)
        # A data-parallel rank that finished its pass first waits for the others inside the
        # step's all-reduce: the fastest rank's extra is the step's own.
        # (A rank outside the layout times nothing: it takes no part in the minimum.)
        table["step"] = {str(p): _over_ranks(s if holds else float("inf"), dist.ReduceOp.MIN)
                         for p, s in steps.items()}
        if gathers:
            table["gather"] = {str(p): _over_ranks(s, dist.ReduceOp.MAX)
                               for p, s in gathers.items()}
        out[layout_key(dp, tp, zero)] = table
    return out


def check_layouts(layouts: Sequence[tuple[int, int, int]], world: int) -> None:
    """Raise ``ValueError`` naming the first layout ``(dp, tp, zero)`` with more ranks than
    ``world``."""
    for dp, tp, _ in layouts:
        if dp * tp > world:
            raise ValueError(f"layout dp={dp} tp={tp} needs {dp * tp} ranks; world is {world}")


def median_layouts(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several measurements of the same layouts (``{layout_key: tables}``, from separate
    launches) as one: the median of each figure. Each launch's processes land differently in
    memory and caches: on a CPU the same pass differs by up to a fifth from one launch to
    the next."""
    first = runs[0]
    for run in runs[1:]:
        if set(run) != set(first):
            raise ValueError(f"layouts differ between runs: {sorted(first)} vs {sorted(run)}")
    return {key: {name: {n: statistics.median(run[key][name][n] for run in runs)
                         for n in table}
                  for name, table in first[key].items()}
            for key in first}


def default_depths(config: Any) -> tuple[int, int]:
    """One layer, and the model's own depth (at most ``MAX_DEPTH``): the second pass is the
    model itself, so its prediction does not lean on the split into layer and rest."""
    layers = int(config.num_hidden_layers)
    return 1, max(2, min(layers, MAX_DEPTH))


def profile_layouts(config: Any, role: str, build: Callable[[Any], Any],
                    layouts: Sequence[tuple[int, int, int]], *, world: int,
                    tokens: Sequence[int], seq_len: int, repeats: int = 7, lr: float = 1e-5,
                    depths: tuple[int, int] | None = None, launches: int = 1,
                    timeout: float = 900.0) -> dict[str, Any]:
    """Per-layer forward and backward seconds, the rest of a pass, and a step's extra seconds
    of ``role`` (``"actor"`` or ``"critic"``, built by ``build(config)``, a module-level
    function) in each layout ``(dp, tp, zero)`` on ``world`` local gloo ranks (one thread
    each), as ``{layout_key: tables}`` for a profile's ``layouts`` section. A layout takes the
    first ``dp * tp`` ranks; the others idle while it is timed. ``tokens``: as
    :func:`~rlhf_fusion.runtime.layer_profile.profile_layers`. ``launches``: times to start
    the processes anew; each figure is the median over them."""
    from ..launch import run_ranks

    check_layouts(layouts, world)
    depths = depths or default_depths(config)
    if not 1 <= depths[0] < depths[1]:
        raise ValueError(f"depths: two layer counts d1 < d2, got {depths}")
    runs = [run_ranks(_layout_rank, world, config, role, build, list(layouts), list(tokens),
                      seq_len, repeats, lr, tuple(depths), timeout=timeout,
                      collective_timeout=timeout / 2)[0].value for _ in range(launches)]
    tables = median_layouts(runs)
    return {"format": FORMAT, "version": 1, "role": role, "world": world, "seq_len": seq_len,
            "depths": list(depths), "repeats": repeats, "launches": launches, "device": "cpu",
            "layouts": tables}
