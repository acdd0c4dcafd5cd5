"""The action IR: what one rank executes, in order.

A compute action is written ``actor0:2F5`` (model ``actor``, copy 0, stage 2, forward of
micro-batch 5); a communication action adds the peer stage group, ``actor0:2SEND_F5@3``
(send the stage-2 output activation of micro-batch 5 to group 3). Planners produce per-group
orders of compute actions; :func:`lower` inserts the sends and receives those orders imply.
The runtime executes the lowered stream and never invents an order of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .problem import Problem, ProblemError, Task

COMPUTE_OPS = ("F", "B")
# SEND_F / RECV_F move a forward activation (stage s -> s+1); SEND_B / RECV_B move the gradient
# of that activation back (stage s+1 -> s).
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION_RE = re.compile(
    r"^(?P<model>[A-Za-z_][\w.-]*?)(?P<copy>\d+):(?P<stage>\d+)"
    r"(?P<op>SEND_F|RECV_F|SEND_B|RECV_B|F|B)(?P<mb>\d+)(?:@(?P<peer>\d+))?$"
)


@dataclass(frozen=True)
class Action:
    op: str
    model: str
    copy: int
    stage: int
    micro_batch: int
    peer: int | None = None  # stage group on the other end of a SEND/RECV

    def __post_init__(self) -> None:
        if self.op not in COMPUTE_OPS + COMM_OPS:
            raise ValueError(f"unknown action op {self.op!r}")
        if (self.op in COMM_OPS) != (self.peer is not None):
            raise ValueError(f"{self.op} actions {'need' if self.op in COMM_OPS else 'take no'} a peer")

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.model}{self.copy}:{self.stage}{self.op}{self.micro_batch}{peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(
                f"cannot parse action {text!r}; expected e.g. 'actor0:2F5' or 'critic1:0SEND_B3@4'"
            )
        peer = m.group("peer")
        return cls(
            op=m.group("op"),
            model=m.group("model"),
            copy=int(m.group("copy")),
            stage=int(m.group("stage")),
            micro_batch=int(m.group("mb")),
            peer=None if peer is None else int(peer),
        )

    @classmethod
    def from_task(cls, problem: Problem, task: Task) -> Action:
        return cls(task.op, problem.models[task.model].name, task.copy, task.stage, task.micro_batch)


def lower(problem: Problem, group: int, order: Sequence[Task]) -> list[Action]:
    """Lower one group's compute order to its instruction stream.

    Each forward is preceded by the receive of its input (unless it is stage 0) and followed by
    the send of its output (unless it is the last stage, where the loss is computed and the
    backward follows on the same group); backwards mirror that. Receives sit right before the
    compute that needs them: a runtime may post them earlier, but must not reorder compute.
    """
    out: list[Action] = []
    for task in order:
        m = problem.models[task.model]
        if m.group_of(task.copy, task.stage) != group:
            raise ProblemError(f"task {Action.from_task(problem, task)} does not run on group {group}")
        name, c, s, mb = m.name, task.copy, task.stage, task.micro_batch
        last = m.pipeline_stages - 1
        if task.op == "F":
            if s > 0:
                out.append(Action("RECV_F", name, c, s, mb, m.group_of(c, s - 1)))
            out.append(Action("F", name, c, s, mb))
            if s < last:
                out.append(Action("SEND_F", name, c, s, mb, m.group_of(c, s + 1)))
        else:
            if s < last:
                out.append(Action("RECV_B", name, c, s, mb, m.group_of(c, s + 1)))
            out.append(Action("B", name, c, s, mb))
            if s > 0:
                out.append(Action("SEND_B", name, c, s, mb, m.group_of(c, s - 1)))
    return out


def lower_all(problem: Problem, order: Sequence[Sequence[Task]]) -> list[list[Action]]:
    if len(order) != problem.stage_groups:
        raise ProblemError(f"order has {len(order)} groups but the problem has {problem.stage_groups}")
    return [lower(problem, g, tasks) for g, tasks in enumerate(order)]


def format_stream(actions: Iterable[Action]) -> list[str]:
    return [str(a) for a in actions]


def parse_stream(lines: Iterable[str]) -> list[Action]:
    return [Action.parse(line) for line in lines]


def check_streams_match(streams: Sequence[Sequence[Action]]) -> None:
    """Every send has exactly one matching receive on its peer, in a consistent order per channel.

    Channels are (model, copy, direction-of-traffic, src, dst); per channel the sender's order of
    micro-batches must equal the receiver's, or a FIFO transport would deliver the wrong tensor.
    """
    sends: dict[tuple, list[int]] = {}
    recvs: dict[tuple, list[int]] = {}
    for g, stream in enumerate(streams):
        for a in stream:
            if a.op == "SEND_F":
                sends.setdefault((a.model, a.copy, "F", g, a.peer), []).append(a.micro_batch)
            elif a.op == "RECV_F":
                recvs.setdefault((a.model, a.copy, "F", a.peer, g), []).append(a.micro_batch)
            elif a.op == "SEND_B":
                sends.setdefault((a.model, a.copy, "B", g, a.peer), []).append(a.micro_batch)
            elif a.op == "RECV_B":
                recvs.setdefault((a.model, a.copy, "B", a.peer, g), []).append(a.micro_batch)
    for key in sends.keys() | recvs.keys():
        if sorted(sends.get(key, [])) != sorted(recvs.get(key, [])):
            model, copy, kind, src, dst = key
            raise ProblemError(
                f"{model}{copy}: group {src} sends {kind} micro-batches {sorted(sends.get(key, []))} "
                f"to group {dst}, which receives {sorted(recvs.get(key, []))}"
            )
