"""Pure planning for inter-stage fusion (numpy only, no torch): length distributions, the
migration decision rules, and the generation + inference simulator that picks R_t."""

from .lengths import LengthDistribution, lognormal_quantile_lengths
from .planner import (
    MigrationAssignment,
    MovingSample,
    assign_migration,
    choose_destinations,
    choose_mechanism,
    destination_at_trigger,
    migration_costs,
    required_instances,
    validate_fusion,
)
from .simulate import (
    ClusterModel,
    IterationResult,
    MigrationPlan,
    SweepPoint,
    SweepResult,
    plan_migration,
    rt_grid,
    simulate_fused,
    simulate_serial,
    sweep_rt,
)

__all__ = [
    "ClusterModel",
    "IterationResult",
    "LengthDistribution",
    "MigrationAssignment",
    "MigrationPlan",
    "MovingSample",
    "SweepPoint",
    "SweepResult",
    "assign_migration",
    "choose_destinations",
    "choose_mechanism",
    "destination_at_trigger",
    "lognormal_quantile_lengths",
    "migration_costs",
    "plan_migration",
    "required_instances",
    "rt_grid",
    "simulate_fused",
    "simulate_serial",
    "sweep_rt",
    "validate_fusion",
]
