"""Fused pipeline schedule planning (pure Python: imports no torch)."""

from .actions import Action, lower, lower_all
from .problem import ModelSpec, Problem, ProblemError, Task

__all__ = ["Action", "ModelSpec", "Problem", "ProblemError", "Task", "lower", "lower_all"]
