"""The dataflow graph of PPO's six model function calls over consecutive iterations.

Data edges inside an iteration: generation feeds the three inference calls; both training
calls need the advantages, hence every inference output and the generated sequences.
Parameter-version edges between iterations: the Actor generates iteration t+1 with the weights
its training of iteration t produced, the Critic scores iteration t+1 with its own; nothing
else crosses iterations, so the Actor's generation of t+1 may overlap the Critic's training of
t (ReaLHF §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def index(self, call: str, iteration: int) -> int:
        return iteration * len(CALLS) + CALLS.index(call)


def build_graph(iterations: int = 2) -> DataflowGraph:
    """Nodes in topological order: iteration by iteration, CALLS order inside one."""
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    nodes = [Node(c, t) for t in range(iterations) for c in CALLS]
    g = DataflowGraph(nodes, [], iterations)
    for t in range(iterations):
        for a, b in DATA_EDGES:
            g.edges.append((g.index(a, t), g.index(b, t), "data"))
        if t:
            for a, b in PARAM_EDGES:
                g.edges.append((g.index(a, t - 1), g.index(b, t), "param"))
    for p, c, _ in g.edges:
        nodes[p].children.append(c)
        nodes[c].parents.append(p)
    return g
