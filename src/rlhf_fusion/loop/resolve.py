"""The run resolved once: :func:`resolve_run` checks a config and gives its placement and its
models' shapes, before any process starts; :func:`~rlhf_fusion.loop.run.train`, every rank
and every :class:`~rlhf_fusion.loop.iteration.PPOWorker` are handed the result and check
nothing again.

The order is the data's own: the config's fields (:meth:`RLHFConfig.validate`), then the
placement they name (:func:`~rlhf_fusion.loop.placement.placement_of`), then the model
sources, read on the meta device, checked against that placement (pipeline stages against
decoder layers, tensor-parallel degrees against heads and widths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import RLHFConfig
from .errors import LoopConfigError
from .models import ModelShapes, check_sources
from .placement import LoopPlacement, placement_of


@dataclass(frozen=True)
class RunHooks:
    """Observers a run's ranks call, injected through the :class:`ResolvedRun` (tests use them
    to kill or fail a rank at a chosen point): ``on_stage(stage, rank, iteration)`` as each
    stage of an iteration starts; ``on_note(text)`` each time the rank enters any stage
    (:func:`rlhf_fusion.launch.note_stage`). Picklable functions: the ranks are spawned."""

    on_stage: Callable[[str, int, int], None] | None = None
    on_note: Callable[[str], None] | None = None


@dataclass(frozen=True)
class ResolvedRun:
    """A checked config with its placement (``None`` while ``placement.search`` is pending:
    the search runs once, then the searched config is resolved) and, when the sources were
    read, its models' shapes; ``hooks``: what its ranks call as they go (none by default)."""

    config: RLHFConfig
    placement: LoopPlacement | None
    shapes: ModelShapes | None = None
    hooks: RunHooks = RunHooks()


def resolve_run(cfg: RLHFConfig | ResolvedRun, *, sources: bool = True) -> ResolvedRun:
    """``cfg`` checked and resolved (see the module); a :class:`ResolvedRun` is returned as
    it is. Raises :class:`LoopConfigError` naming the field and the fix."""
    if isinstance(cfg, ResolvedRun):
        return cfg
    cfg.validate()
    placement = placement_of(cfg)   # the layout checks, ppo.micro_batches's among them
    shapes = None
    if sources:
        shapes = check_sources(cfg)
        given = placement if cfg.placement.given else None
        _check_stages(cfg, given, shapes.layers["models.actor"],
                      shapes.layers.get("models.critic", shapes.layers["models.actor"]))
        if given is not None:
            _check_tensor_parallel(given, shapes.configs["models.actor"],
                                   shapes.configs.get("models.critic",
                                                      shapes.configs["models.actor"]))
    return ResolvedRun(cfg, placement, shapes)


def _check_tensor_parallel(placement: LoopPlacement, actor: Any, critic: Any) -> None:
    """A tensor-parallel training call's tp divides its model's heads, key/value heads and
    MLP width (named, with the fix)."""
    from ..runtime.tensor_parallel import TensorParallelError, check_tensor_parallel

    for role, config in (("actor", actor), ("critic", critic)):
        if f"{role}_train" not in placement.calls:
            continue   # no Critic (a critic-free algorithm)
        tp = placement.calls[f"{role}_train"].tp
        try:
            check_tensor_parallel(config, tp, f"models.{role} (placement {placement.name}, "
                                  f"{role}_train tp={tp})")
        except TensorParallelError as exc:
            raise LoopConfigError(str(exc)) from None


def _check_stages(cfg: RLHFConfig, placement: LoopPlacement | None, actor_layers: int,
                  critic_layers: int) -> None:
    """No pipeline stage without a decoder layer: the stage count of the Actor and of the
    Critic at most their layer counts, named by the field that sets it."""
    if placement is not None:
        layers = {"actor": actor_layers, "critic": critic_layers}
        wants = {role: (placement.calls[f"{role}_train"].pp, have)
                 for role, have in layers.items() if f"{role}_train" in placement.calls}
        for role, (pp, have) in wants.items():
            if pp > have:
                raise LoopConfigError(
                    f"placement: the plan's {role} pipeline has {pp} stages but models.{role} "
                    f"has {have} decoder layers; plan with pp <= {have}")
        return
    if cfg.world_size < 2 or cfg.algorithm.critic_free:   # no pipeline without a Critic
        return
    n, f = cfg.stages(), cfg.fusion
    field = "fusion.pipeline_stages" if f.pipeline_stages is not None else "world_size"
    if n > actor_layers:
        raise LoopConfigError(
            f"{field}: {n} pipeline stages (one per rank unless fusion.pipeline_stages says "
            f"otherwise) but models.actor has {actor_layers} decoder layers; use "
            f"{field} <= {actor_layers}, or a deeper model")
    cs = f.critic_stages or n
    if cs > critic_layers:
        field = "fusion.critic_stages" if f.critic_stages is not None else field
        raise LoopConfigError(
            f"{field}: the Critic's pipeline has {cs} stages but models.critic has "
            f"{critic_layers} decoder layers; set fusion.critic_stages <= {critic_layers} "
            f"(a divisor of {n}), or use a deeper critic")


