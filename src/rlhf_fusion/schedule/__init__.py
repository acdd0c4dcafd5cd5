"""Fused pipeline schedule planning (pure Python: imports no torch)."""

from .actions import Action, lower, lower_all, parse_stream
from .baselines import concatenated_1f1b, one_f_one_b, serial_1f1b, single_model_problem
from .bounds import lower_bound
from .evaluate import CapacityError, DeadlockError, Evaluation, ScheduleError, validate
from .greedy import greedy
from .policy import SearchPolicy
from .problem import InfeasibleError, ModelSpec, Problem, ProblemError, Task, fused_problem
from .result import Schedule
from .solve import SOLVERS, solve

__all__ = [
    "SOLVERS",
    "Action",
    "CapacityError",
    "DeadlockError",
    "Evaluation",
    "InfeasibleError",
    "ModelSpec",
    "Problem",
    "ProblemError",
    "Schedule",
    "ScheduleError",
    "SearchPolicy",
    "Task",
    "concatenated_1f1b",
    "fused_problem",
    "greedy",
    "lower",
    "lower_all",
    "lower_bound",
    "one_f_one_b",
    "parse_stream",
    "serial_1f1b",
    "single_model_problem",
    "solve",
    "validate",
]
