"""How a distributed rollout runs (:class:`RolloutConfig`) and the checks made before it starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .local import check_specs
from .planning.planner import validate_fusion
from .types import RolloutConfigError, SampleSpec


@dataclass(frozen=True)
class RolloutConfig:
    """How one rollout runs. ``rt`` (samples) or ``rt_fraction`` (of the batch) sets R_t.

    ``fused=False`` is the serial baseline (inference after every rank finished generating).
    ``rt=0`` means no migration: the same serial rollout, the value
    :meth:`~rlhf_fusion.rollout.rt_control.RtPlanner.rt` returns when the simulator predicts
    no gain (so a planner's R_t can be passed through unchanged).
    ``mechanism`` is ``"kv"``, ``"tokens"`` or ``"auto"`` (the planner's rule on
    ``bandwidth_bytes_s`` against ``prefill_s_per_token``). Ranks publish their unfinished
    count every ``report_every`` decode steps; every wait is bounded by ``timeout_s``, and
    destinations heartbeat every ``heartbeat_s`` while they stream.
    ``balance_scoring``: in a rollout that does not migrate, the ranks score through the
    stream after the end-of-generation barrier (each its own micro-batches first, then a
    slower rank's), so ranks that score at unequal speeds end together, as a fused rollout's
    stream makes them. Off (the default), each rank scores its own shard: the static split
    every peer's rollout has. It is the baseline that leaves inter-stage fusion's overlap as the
    only difference from a fused rollout.
    """

    fused: bool = True
    rt: int | None = None
    rt_fraction: float | None = None
    m: int | None = None
    mechanism: str = "kv"
    bandwidth_bytes_s: float = 1e9
    prefill_s_per_token: float = 1e-4
    report_every: int = 4
    timeout_s: float = 60.0
    heartbeat_s: float = 0.25
    kv_capacity_tokens: float | None = None
    balance_scoring: bool = False

    def resolve_rt(self, batch_size: int) -> int:
        if self.rt is not None and self.rt_fraction is not None:
            raise RolloutConfigError("give rt or rt_fraction, not both")
        if self.rt is not None:
            if int(self.rt) < 0:
                raise RolloutConfigError(
                    f"rt={self.rt}: R_t counts samples; use 0 for no migration or "
                    "1..batch size")
            return int(self.rt)
        if self.rt_fraction is not None:
            if not 0 < self.rt_fraction <= 1:
                raise RolloutConfigError(
                    f"rt_fraction={self.rt_fraction} is outside the batch; use a fraction in "
                    "(0, 1], e.g. 0.2")
            return max(1, round(self.rt_fraction * batch_size))
        raise RolloutConfigError("fused rollout needs R_t: set rt (samples) or rt_fraction "
                                 "(or run `rlhf-fusion tune-migration` to choose one)")

    def migrates(self, batch_size: int) -> bool:
        """Whether a rollout of ``batch_size`` samples migrates: fused with R_t >= 1."""
        return self.fused and self.resolve_rt(batch_size) > 0

    def validate(self) -> None:
        if self.report_every < 1:
            raise RolloutConfigError("report_every must be >= 1")
        if self.timeout_s <= 0 or self.heartbeat_s <= 0 or self.heartbeat_s >= self.timeout_s:
            raise RolloutConfigError("need 0 < heartbeat_s < timeout_s")
        if self.mechanism not in ("kv", "tokens", "auto"):
            raise RolloutConfigError(f"mechanism={self.mechanism!r}; use 'kv', 'tokens' or 'auto'")


def check_rollout(specs: Sequence[SampleSpec], config: RolloutConfig, world_size: int,
                  bs_max: int) -> int | None:
    """Validate a rollout before any process starts; returns m (None when nothing migrates:
    ``fused=False`` or R_t = 0).

    ``run_rollout`` runs the same checks on every rank; call this first to fail in the parent.
    """
    config.validate()
    check_specs(specs)
    if not config.migrates(len(specs)):
        return None
    rt = config.resolve_rt(len(specs))
    return validate_fusion(
        batch_size=len(specs), instances=world_size, rt=rt, bs_max=bs_max,
        longest_kv_tokens=max(len(s.prompt_ids) + s.max_new_tokens for s in specs),
        kv_capacity_tokens=config.kv_capacity_tokens, m=config.m)
