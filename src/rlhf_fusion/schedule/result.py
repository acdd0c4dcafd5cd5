"""The schedule a solver returns, its JSON form, and its per-rank instruction streams."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .actions import Action, format_stream, lower_all
from .evaluate import ScheduleError, validate
from .problem import Problem, Task, task_from_json, task_to_json


@dataclass
class Schedule:
    problem: Problem
    order: list[list[Task]]
    solver: str
    seconds: float
    makespan: float
    peak_activation: float
    lower_bound: float
    baselines: dict[str, dict[str, float]] = field(default_factory=dict)
    # True when the makespan is proven minimal (it meets the lower bound, or the exact solver
    # closed the search).
    optimal: bool = False
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """Relative distance from the lower bound (0.0 means provably optimal)."""
        return (self.makespan - self.lower_bound) / self.lower_bound if self.lower_bound else 0.0

    def speedup(self, baseline: str = "serial_1f1b") -> float:
        return self.baselines[baseline]["makespan"] / self.makespan

    def peak_ratio(self, baseline: str = "serial_1f1b") -> float:
        base = self.baselines[baseline]["peak_activation"]
        return self.peak_activation / base if base else float("nan")

    def instruction_streams(self) -> list[list[Action]]:
        """One lowered stream per stage group (the rank of that group in each pipeline replica)."""
        return lower_all(self.problem, self.order)

    def to_dict(self) -> dict[str, Any]:
        p = self.problem
        return {
            "problem": p.to_dict(),
            "solver": self.solver,
            "seconds": round(self.seconds, 3),
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "peak_activation": round(self.peak_activation, 6),
            "baselines": self.baselines,
            "stats": self.stats,
            "order": [[task_to_json(p, t) for t in tasks] for tasks in self.order],
        }

    def save(self, path: str | Path, *, streams: bool = True) -> None:
        data = self.to_dict()
        if streams:
            data["instruction_streams"] = [format_stream(s) for s in self.instruction_streams()]
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Load and re-check a schedule: the order is re-validated and re-simulated."""
        if "problem" not in data or "order" not in data:
            raise ScheduleError("schedule: needs 'problem' and 'order' (write it with Schedule.save)")
        problem = Problem.from_dict(data["problem"])
        order = [[task_from_json(problem, t) for t in tasks] for tasks in data["order"]]
        ev = validate(problem, order)
        stored = data.get("makespan")
        if stored is not None and abs(float(stored) - ev.makespan) > 1e-6 * max(1.0, ev.makespan):
            raise ScheduleError(
                f"schedule: stored makespan {stored} differs from the simulated {ev.makespan}; "
                "the order or the problem was edited, re-run the planner"
            )
        from .bounds import lower_bound

        return cls(
            problem=problem,
            order=order,
            solver=str(data.get("solver", "file")),
            seconds=float(data.get("seconds", 0.0)),
            makespan=ev.makespan,
            peak_activation=ev.peak_activation,
            lower_bound=lower_bound(problem),
            baselines=dict(data.get("baselines", {})),
            optimal=bool(data.get("optimal", False)),
            stats=dict(data.get("stats", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ScheduleError(f"{path}: no such schedule file") from None
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data)
