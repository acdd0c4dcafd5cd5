"""Where everything runs: the schedule's stage groups mapped onto ranks.

With ``replicas`` data-parallel copies of the whole fused pipeline, ``world = replicas * N`` and
``rank = replica * N + group``. A model with K copies inside one pipeline has K data-parallel
replicas of every stage inside the pipeline too, so stage ``s`` of a model is held by
``replicas * K`` ranks that all-reduce its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import Action, Problem, Schedule
from ..schedule.actions import check_streams_match
from .errors import PlanError


@dataclass(frozen=True)
class Resident:
    """One model stage hosted by a rank."""

    model: str
    model_idx: int
    copy: int
    stage: int
    num_stages: int


class PipelinePlan:
    """A validated schedule plus the rank layout it runs on."""

    def __init__(self, schedule: Schedule, replicas: int = 1):
        if replicas < 1:
            raise PlanError(f"replicas: must be >= 1, got {replicas}")
        self.schedule = schedule
        self.problem: Problem = schedule.problem
        self.replicas = replicas
        self.stage_groups = self.problem.stage_groups
        self.world_size = replicas * self.stage_groups
        self.streams: list[list[Action]] = schedule.instruction_streams()
        check_streams_match(self.streams)
        totals = {m.copies * m.micro_batches for m in self.problem.models}
        if len(totals) != 1:
            raise PlanError("models: every model must see the same batch (K1*M1 = K2*M2)")
        #: micro-batches one pipeline replica processes per step (K * M of any model)
        self.micro_batches = totals.pop()

    # -- layout --------------------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.problem.models]

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage group) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the plan's world of {self.world_size}")
        return divmod(rank, self.stage_groups)

    def rank_of(self, replica: int, group: int) -> int:
        return replica * self.stage_groups + group

    def residents(self, rank: int) -> dict[str, Resident]:
        _, group = self.coords(rank)
        out = {}
        for mi, copy, stage in self.problem.residents(group):
            m = self.problem.models[mi]
            out[m.name] = Resident(m.name, mi, copy, stage, m.pipeline_stages)
        return out

    def stream(self, rank: int) -> list[Action]:
        return self.streams[self.coords(rank)[1]]

    def peer_rank(self, rank: int, peer_group: int) -> int:
        replica, _ = self.coords(rank)
        return self.rank_of(replica, peer_group)

    def global_micro_batch(self, model: str, copy: int, micro_batch: int) -> int:
        """Index into the replica's list of micro-batches (copy j takes a contiguous block)."""
        m = self.problem.models[self.problem.model_index(model)]
        return copy * m.micro_batches + micro_batch

    def stage_ranks(self, model_idx: int, stage: int) -> list[int]:
        """All ranks holding ``stage`` of a model: every copy in every replica."""
        m = self.problem.models[model_idx]
        return sorted(
            self.rank_of(r, m.group_of(c, stage))
            for r in range(self.replicas)
            for c in range(m.copies)
        )

    def tied_ranks(self, model_idx: int) -> list[int]:
        """Ranks holding the first or the last stage of a model (for tied embeddings)."""
        m = self.problem.models[model_idx]
        return sorted(
            set(self.stage_ranks(model_idx, 0)) | set(self.stage_ranks(model_idx, m.S - 1))
        )

    def is_canonical(self, rank: int, model: str) -> bool:
        """Whether this rank's copy of its stage of ``model`` is the one that counts once
        (replica 0, copy 0) in norms and gathered checkpoints."""
        replica, _ = self.coords(rank)
        res = self.residents(rank)[model]
        return replica == 0 and res.copy == 0

    def describe(self) -> str:
        lines = [f"{self.replicas} replica(s) x {self.stage_groups} stage groups"]
        for rank in range(self.world_size):
            res = ", ".join(
                f"{r.model} copy {r.copy} stage {r.stage}/{r.num_stages}"
                for r in self.residents(rank).values()
            )
            lines.append(f"  rank {rank}: {res}")
        return "\n".join(lines)
