"""The dataflow graph of the RLHF model function calls over consecutive iterations.

PPO has six calls on four models. A critic-free algorithm (GRPO, RLOO, REINFORCE++) has no
Critic, and a rule or function reward no reward model: the graph of a run holds the calls of
the models it has (:func:`calls_of`), Actor and Ref always.

Data edges inside an iteration: generation feeds the three inference calls; both training
calls need the advantages, hence every inference output and the generated sequences.
Parameter-version edges between iterations: the Actor generates iteration t+1 with the weights
its training of iteration t produced, the Critic scores iteration t+1 with its own; nothing
else crosses iterations, so the Actor's generation of t+1 may overlap the Critic's training of
t (ReaLHF §4).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import PlacementError

CALLS: tuple[str, ...] = ("actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train",
                          "critic_train")
MODELS: tuple[str, ...] = ("actor", "critic", "ref", "reward")

CALL_MODEL = {"actor_gen": "actor", "ref_inf": "ref", "reward_inf": "reward",
              "critic_inf": "critic", "actor_train": "actor", "critic_train": "critic"}
CALL_KIND = {"actor_gen": "generate", "ref_inf": "inference", "reward_inf": "inference",
             "critic_inf": "inference", "actor_train": "train", "critic_train": "train"}
# The call whose layout holds a trainable model's master weights (and optimizer state).
TRAIN_CALL = {"actor": "actor_train", "critic": "critic_train"}

DATA_EDGES: tuple[tuple[str, str], ...] = (
    ("actor_gen", "ref_inf"), ("actor_gen", "reward_inf"), ("actor_gen", "critic_inf"),
    ("actor_gen", "actor_train"), ("actor_gen", "critic_train"),
    ("ref_inf", "actor_train"), ("ref_inf", "critic_train"),
    ("reward_inf", "actor_train"), ("reward_inf", "critic_train"),
    ("critic_inf", "actor_train"), ("critic_inf", "critic_train"),
)
PARAM_EDGES: tuple[tuple[str, str], ...] = (("actor_train", "actor_gen"),
                                            ("critic_train", "critic_inf"))

REQUIRED_MODELS: tuple[str, ...] = ("actor", "ref")
"""Every run has these; the Critic (PPO) and the reward model (not a rule) are optional."""


def check_models(models: Iterable[str], where: str = "models") -> tuple[str, ...]:
    """``models`` in :data:`MODELS` order, or a :class:`PlacementError` naming what is
    missing or unknown."""
    given = set(models)
    bad = sorted(given - set(MODELS))
    if bad:
        raise PlacementError(f"{where}: unknown roles {bad}; use {list(MODELS)}")
    missing = [m for m in REQUIRED_MODELS if m not in given]
    if missing:
        raise PlacementError(
            f"{where}: {missing} missing; every run has an actor and a ref (the critic is "
            "optional: critic-free algorithms such as GRPO have none; the reward model is "
            "optional: a rule or function reward has none)")
    return tuple(m for m in MODELS if m in given)


def calls_of(models: Iterable[str]) -> tuple[str, ...]:
    """The calls of ``models``, in :data:`CALLS` order."""
    have = set(check_models(models))
    return tuple(c for c in CALLS if CALL_MODEL[c] in have)


def models_of_calls(calls: Iterable[str], where: str = "plan") -> tuple[str, ...]:
    """The models whose calls ``calls`` are, checked to be every call of those models."""
    calls = set(calls)
    bad = sorted(calls - set(CALLS))
    if bad:
        raise PlacementError(f"{where}: unknown calls {bad}; use {list(CALLS)}")
    models = check_models({CALL_MODEL[c] for c in calls}, where)
    missing = [c for c in calls_of(models) if c not in calls]
    if missing:
        raise PlacementError(f"{where}: no placement for {missing}; every call of the models "
                             f"{list(models)} needs a mesh and (dp, tp, pp)")
    return models


_CALL_SETS: dict[frozenset[str], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def plan_calls(calls: Iterable[str], where: str = "plan"
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(models, calls in CALLS order)`` of a plan's call set (:func:`models_of_calls`'s
    check), cached: the search builds a plan per step."""
    key = frozenset(calls)
    hit = _CALL_SETS.get(key)
    if hit is None:
        models = models_of_calls(key, where)
        hit = _CALL_SETS[key] = (models, calls_of(models))
    return hit


def train_calls(models: Iterable[str]) -> dict[str, str]:
    """:data:`TRAIN_CALL` restricted to ``models`` (the trainable ones present)."""
    have = set(models)
    return {m: c for m, c in TRAIN_CALL.items() if m in have}


def data_edges(calls: Iterable[str]) -> tuple[tuple[str, str], ...]:
    have = set(calls)
    return tuple((a, b) for a, b in DATA_EDGES if a in have and b in have)


def param_edges(calls: Iterable[str]) -> tuple[tuple[str, str], ...]:
    have = set(calls)
    return tuple((a, b) for a, b in PARAM_EDGES if a in have and b in have)


@dataclass
class Node:
    call: str
    iteration: int
    parents: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.call}@{self.iteration}"


@dataclass
class DataflowGraph:
    nodes: list[Node]
    edges: list[tuple[int, int, str]]   # (parent, child, "data" | "param")
    iterations: int
    calls: tuple[str, ...] = CALLS

    def index(self, call: str, iteration: int) -> int:
        return iteration * len(self.calls) + self.calls.index(call)


def build_graph(iterations: int = 2, models: Iterable[str] = MODELS) -> DataflowGraph:
    """Nodes in topological order: iteration by iteration, CALLS order inside one; only the
    calls of ``models`` (Actor and Ref at least)."""
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    calls = calls_of(models)
    nodes = [Node(c, t) for t in range(iterations) for c in calls]
    g = DataflowGraph(nodes, [], iterations, calls)
    for t in range(iterations):
        for a, b in data_edges(calls):
            g.edges.append((g.index(a, t), g.index(b, t), "data"))
        if t:
            for a, b in param_edges(calls):
                g.edges.append((g.index(a, t - 1), g.index(b, t), "param"))
    for p, c, _ in g.edges:
        nodes[p].children.append(c)
        nodes[c].parents.append(p)
    return g
