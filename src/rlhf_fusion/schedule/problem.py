"""The fused pipeline problem: N stage groups shared by two (or more) pipelined models.

Pure data and validation; no torch. The JSON form is the contract in docs/architecture.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import RLHFFusionError

DIRECTIONS = ("forward", "reverse")


class ProblemError(RLHFFusionError, ValueError):
    """A problem description that cannot be scheduled; the message names the field and the fix."""


class InfeasibleError(ProblemError):
    """No schedule fits the memory capacity (or none was found within the time budget)."""


class Task(NamedTuple):
    """One unit of work: a forward or backward of one micro-batch on one stage of one model copy.

    ``model`` is the index into ``Problem.models``.
    """

    model: int
    copy: int
    op: str  # "F" or "B"
    stage: int
    micro_batch: int


def _per_stage(value: Any, stages: int, where: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = (float(value),) * stages
    elif isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != stages:
            raise ProblemError(
                f"{where}: has {len(value)} entries but pipeline_stages is {stages}; "
                f"give one number per stage or a single number for all stages"
            )
        values = tuple(float(v) for v in value)
    else:
        raise ProblemError(f"{where}: expected a number or a list of {stages} numbers, got {value!r}")
    if any(v < 0 for v in values):
        raise ProblemError(f"{where}: values must be >= 0, got {list(values)}")
    return values


@dataclass(frozen=True)
class ModelSpec:
    """One pipelined model: S stages, K copies (data-parallel replicas inside the fused pipeline)."""

    name: str
    pipeline_stages: int
    copies: int
    micro_batches: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation: tuple[float, ...]
    direction: str = "forward"
    # Optional parameter count; decides which model is "larger" for the greedy tie rule.
    size: float | None = None

    @property
    def S(self) -> int:  # noqa: N802 - the paper's notation
        return self.pipeline_stages

    def group_of(self, copy: int, stage: int) -> int:
        """Stage group that runs ``stage`` of ``copy``."""
        base = copy * self.pipeline_stages
        if self.direction == "forward":
            return base + stage
        return base + self.pipeline_stages - 1 - stage

    def duration(self, op: str, stage: int) -> float:
        return self.forward[stage] if op == "F" else self.backward[stage]

    def work_per_micro_batch(self) -> float:
        return sum(self.forward) + sum(self.backward)

    def arrival(self, stage: int) -> float:
        """Earliest time a forward can reach ``stage`` (the forwards of all earlier stages)."""
        return sum(self.forward[:stage])

    def tail(self, stage: int) -> float:
        """Backward work that still follows a backward of ``stage`` (the earlier stages' backwards)."""
        return sum(self.backward[:stage])

    def to_dict(self) -> dict[str, Any]:
        def compact(values: tuple[float, ...]) -> Any:
            one = values[0]
            if all(v == one for v in values):
                return int(one) if float(one).is_integer() else one
            return [int(v) if float(v).is_integer() else v for v in values]

        out: dict[str, Any] = {
            "name": self.name,
            "pipeline_stages": self.pipeline_stages,
            "copies": self.copies,
            "micro_batches": self.micro_batches,
            "forward": compact(self.forward),
            "backward": compact(self.backward),
            "activation": compact(self.activation),
            "direction": self.direction,
        }
        if self.size is not None:
            out["size"] = self.size
        return out


@dataclass(frozen=True)
class Problem:
    stage_groups: int
    models: tuple[ModelSpec, ...]
    memory_capacity: tuple[float, ...] | None = None
    name: str = ""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        if not isinstance(data, Mapping):
            raise ProblemError(f"problem: expected a JSON object, got {type(data).__name__}")
        if "stage_groups" not in data:
            raise ProblemError("stage_groups: missing; set it to N, the number of rank groups")
        n = data["stage_groups"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ProblemError(f"stage_groups: must be a positive integer, got {n!r}")
        raw_models = data.get("models")
        if not isinstance(raw_models, Sequence) or len(raw_models) < 1:
            raise ProblemError("models: missing or empty; list the models (actor, critic) to fuse")
        models = []
        for i, m in enumerate(raw_models):
            where = f"models[{i}]"
            if not isinstance(m, Mapping):
                raise ProblemError(f"{where}: expected an object")
            name = str(m.get("name", f"model{i}"))
            where = f"models[{i}] ({name})"
            for key in ("pipeline_stages", "micro_batches", "forward", "backward"):
                if key not in m:
                    raise ProblemError(f"{where}.{key}: missing")
            s = m["pipeline_stages"]
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ProblemError(f"{where}.pipeline_stages: must be a positive integer, got {s!r}")
            k = m.get("copies", n // s if s and n % s == 0 else 1)
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ProblemError(f"{where}.copies: must be a positive integer, got {k!r}")
            if k * s != n:
                raise ProblemError(
                    f"{where}: copies x pipeline_stages = {k}x{s} = {k * s} but stage_groups is {n}; "
                    f"each model must span every stage group (set copies to {n}/{s})"
                    if n % s == 0
                    else f"{where}: pipeline_stages={s} does not divide stage_groups={n}; "
                    f"choose pipeline_stages from the divisors of {n}"
                )
            mb = m["micro_batches"]
            if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
                raise ProblemError(f"{where}.micro_batches: must be a positive integer, got {mb!r}")
            direction = m.get("direction", "forward" if i == 0 else "reverse")
            if direction not in DIRECTIONS:
                raise ProblemError(f"{where}.direction: must be 'forward' or 'reverse', got {direction!r}")
            fwd = _per_stage(m["forward"], s, f"{where}.forward")
            bwd = _per_stage(m["backward"], s, f"{where}.backward")
            act = _per_stage(m.get("activation", 0.0), s, f"{where}.activation")
            size = m.get("size")
            models.append(
                ModelSpec(
                    name=name,
                    pipeline_stages=s,
                    copies=k,
                    micro_batches=mb,
                    forward=fwd,
                    backward=bwd,
                    activation=act,
                    direction=direction,
                    size=None if size is None else float(size),
                )
            )
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ProblemError(f"models: names must be unique, got {names}")
        totals = {m.name: m.copies * m.micro_batches for m in models}
        if len(set(totals.values())) != 1:
            detail = ", ".join(f"{k}: copies x micro_batches = {v}" for k, v in totals.items())
            raise ProblemError(
                f"models: every model must process the same global batch (K1*M1 = K2*M2); got {detail}"
            )
        cap = data.get("memory_capacity")
        capacity: tuple[float, ...] | None
        if cap is None:
            capacity = None
        else:
            capacity = _per_stage(cap, n, "memory_capacity")
        return cls(
            stage_groups=n,
            models=tuple(models),
            memory_capacity=capacity,
            name=str(data.get("name", "")),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Problem:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProblemError(f"{path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise ProblemError(f"{path}: not valid JSON ({exc})") from None
        # Accept a bare problem, a {"problem": ...} wrapper (schedule files, table3 instances).
        if isinstance(data, Mapping) and "problem" in data and "stage_groups" not in data:
            data = data["problem"]
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage_groups": self.stage_groups, "models": [m.to_dict() for m in self.models]}
        if self.name:
            out = {"name": self.name, **out}
        out["memory_capacity"] = None if self.memory_capacity is None else list(self.memory_capacity)
        return out

    def with_capacity(self, capacity: float | Sequence[float] | None) -> Problem:
        cap = None if capacity is None else _per_stage(capacity, self.stage_groups, "memory_capacity")
        return Problem(self.stage_groups, self.models, cap, self.name)

    # -- queries ------------------------------------------------------------------------------
    def model_index(self, name: str) -> int:
        if not self._index:
            self._index.update({m.name: i for i, m in enumerate(self.models)})
        try:
            return self._index[name]
        except KeyError:
            raise ProblemError(f"unknown model {name!r}; known: {[m.name for m in self.models]}") from None

    def group_of(self, task: Task) -> int:
        return self.models[task.model].group_of(task.copy, task.stage)

    def duration(self, task: Task) -> float:
        return self.models[task.model].duration(task.op, task.stage)

    def tasks(self) -> list[Task]:
        out = []
        for mi, m in enumerate(self.models):
            for c in range(m.copies):
                for s in range(m.pipeline_stages):
                    for mb in range(m.micro_batches):
                        out.append(Task(mi, c, "F", s, mb))
                        out.append(Task(mi, c, "B", s, mb))
        return out

    def num_tasks(self) -> int:
        return sum(2 * m.copies * m.pipeline_stages * m.micro_batches for m in self.models)

    def residents(self, group: int) -> list[tuple[int, int, int]]:
        """(model, copy, stage) triples that live on ``group``, in model order."""
        out = []
        for mi, m in enumerate(self.models):
            c = group // m.pipeline_stages
            for stage in range(m.pipeline_stages):
                if m.group_of(c, stage) == group:
                    out.append((mi, c, stage))
                    break
        return out

    def predecessor(self, task: Task) -> Task | None:
        """The previous task of the micro-batch chain: F 0..S-1 then B S-1..0."""
        m = self.models[task.model]
        if task.op == "F":
            return None if task.stage == 0 else task._replace(stage=task.stage - 1)
        if task.stage == m.pipeline_stages - 1:
            return task._replace(op="F")
        return task._replace(stage=task.stage + 1)

    def larger_than(self, a: int, b: int) -> bool:
        """Whether model ``a`` counts as larger than model ``b`` (explicit size, else compute)."""
        ma, mb = self.models[a], self.models[b]
        if ma.size is not None and mb.size is not None:
            return ma.size > mb.size
        return ma.work_per_micro_batch() > mb.work_per_micro_batch()


def task_to_json(problem: Problem, task: Task) -> dict[str, Any]:
    return {
        "model": problem.models[task.model].name,
        "copy": task.copy,
        "op": task.op,
        "stage": task.stage,
        "micro_batch": task.micro_batch,
    }


def task_from_json(problem: Problem, data: Mapping[str, Any]) -> Task:
    op = data.get("op")
    if op not in ("F", "B"):
        raise ProblemError(f"task {dict(data)}: op must be 'F' or 'B'")
    return Task(
        problem.model_index(str(data["model"])),
        int(data.get("copy", 0)),
        op,
        int(data["stage"]),
        int(data["micro_batch"]),
    )


def fused_problem(
    *,
    stage_groups: int,
    micro_batches: int,
    actor_stages: int | None = None,
    critic_stages: int | None = None,
    actor_times: tuple[Any, Any] = (1.0, 2.0),
    critic_times: tuple[Any, Any] = (1.0, 2.0),
    actor_activation: Any = 1.0,
    critic_activation: Any = 1.0,
    actor_size: float | None = None,
    critic_size: float | None = None,
) -> Problem:
    """The fused PPO training problem: Actor forward over groups 0..N-1, Critic reversed.

    ``micro_batches`` is per pipeline replica per step (the loop's ``ppo.micro_batches``);
    each model's copies share it (``copies = N / stages``), so a :class:`ModelSpec` holds
    ``micro_batches / copies`` per copy. ``*_times`` are (forward, backward) per stage: a
    number or a list of one number per stage.
    """
    n = stage_groups
    models = []
    for name, stages, times, act, size, direction in (
        ("actor", actor_stages or n, actor_times, actor_activation, actor_size, "forward"),
        ("critic", critic_stages or n, critic_times, critic_activation, critic_size, "reverse"),
    ):
        if n % stages:
            raise ProblemError(
                f"{name}_stages: {stages} does not divide stage_groups={n}; choose a divisor of {n}"
            )
        copies = n // stages
        if micro_batches % copies:
            raise ProblemError(
                f"micro_batches: {micro_batches} cannot be shared by the {copies} copies of the "
                f"{name}; use a multiple of {copies}"
            )
        spec: dict[str, Any] = {
            "name": name,
            "pipeline_stages": stages,
            "copies": copies,
            "micro_batches": micro_batches // copies,
            "forward": list(times[0]) if isinstance(times[0], Sequence) else times[0],
            "backward": list(times[1]) if isinstance(times[1], Sequence) else times[1],
            "activation": list(act) if isinstance(act, Sequence) else act,
            "direction": direction,
        }
        if size is not None:
            spec["size"] = size
        models.append(spec)
    return Problem.from_dict({"stage_groups": n, "models": models})
