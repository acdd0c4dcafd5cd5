"""FusedPPOTrainer's PPO update on the fused Actor/Critic pipeline (RLHFuse §5).

With ``FusionConfig(pipeline_stages=P)`` the processes form ``world / P`` pipeline replicas
instead of ``world`` data-parallel copies: each rank keeps one stage of the Actor and one of
the Critic, the Actor's forward runs stage 0 -> P-1 and the Critic's in reverse on one fused
schedule (profiled stage times, solved once). The arithmetic is TRL's: every process's
micro-batches of a mini-batch go through its replica's pipeline, each loss divided by
``world x gradient_accumulation_steps`` and summed over replicas, which is the gradient DDP
averages. Generation and scoring keep whole copies of both models, refreshed after every PPO
round by parameter reallocation (each stage broadcast once from its canonical owner).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...placement.layout import Layout
from ...runtime.fused import ROLES, FusedRank, forward_backward, optimizer_step
from ...runtime.ppo import PPOConfig
from ...runtime.training_engine import EngineSpec, FusedPipelineEngine
from ...runtime.weight_sync import full_state
from .experience import PPOExperience, policy_stats, policy_terms, value_terms
from .fusion import FusionConfigError
from .rollout import PPORollout


@dataclass
class ProcessBatch:
    """One process's experience, as the pipeline's micro-batches read it (CPU tensors)."""

    query_responses: Tensor
    context_length: int
    responses: Tensor
    logprobs: Tensor
    values: Tensor
    advantages: Tensor
    returns: Tensor
    padding_mask: Tensor
    padding_mask_p1: Tensor
    sequence_lengths: Tensor

    @classmethod
    def of(cls, rollout: PPORollout, exp: PPOExperience) -> ProcessBatch:
        return cls(rollout.query_responses.cpu(), rollout.context_length,
                   exp.responses.cpu(), exp.logprobs.cpu(), exp.values.cpu(),
                   exp.advantages.cpu(), exp.returns.cpu(), exp.padding_mask.cpu(),
                   exp.padding_mask_p1.cpu(), exp.sequence_lengths.cpu())

    def micro_batch(self, inds: Sequence[int], pad_id: int, trim: bool) -> dict[str, Tensor]:
        """Rows ``inds`` as a pipeline micro-batch; columns past every row's Critic position
        are cut when ``trim`` (every loss term masks them)."""
        full = self.responses.shape[1]
        r = min(full, int(self.sequence_lengths[list(inds)].max()) + 2) if trim else full
        ctx = self.context_length
        qr = self.query_responses[list(inds), : ctx + r]
        mask = qr != pad_id
        return {
            "input_ids": torch.masked_fill(qr, ~mask, 0),
            "attention_mask": mask,
            "position_ids": mask.cumsum(1) - mask.long(),
            "context_length": torch.tensor(ctx),
            "width_scale": torch.tensor(r / full),
            **{k: getattr(self, k)[list(inds), :r] for k in (
                "responses", "logprobs", "values", "advantages", "returns", "padding_mask",
                "padding_mask_p1")},
        }


def _ppo_loss_fns(args: Any) -> dict[str, Callable[[Tensor, Mapping[str, Tensor]], Any]]:
    """TRL's policy and value losses as the pipeline's last-stage loss functions."""

    def actor(logits: Tensor, mb: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        ctx = int(mb["context_length"])
        pol = policy_terms(logits=logits[:, ctx - 1: -1], responses=mb["responses"],
                           old_logprobs=mb["logprobs"], advantages=mb["advantages"],
                           padding_mask=mb["padding_mask"], temperature=args.temperature,
                           cliprange=args.cliprange)
        stats = policy_stats(pol, float(mb["width_scale"]))
        return pol.pg_loss, stats

    def critic(values: Tensor, mb: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        ctx = int(mb["context_length"])
        val = value_terms(vpred=values[:, ctx - 1: -1], old_values=mb["values"],
                          returns=mb["returns"], padding_mask_p1=mb["padding_mask_p1"],
                          cliprange_value=args.cliprange_value)
        return args.vf_coef * val.vf_loss, {"vf_loss": val.vf_loss,
                                            "vf_clipfrac": val.vf_clipfrac}

    return {"actor": actor, "critic": critic}


class PipelinedPPO:
    """The pipeline side of one rank: the fused pipeline engine
    (:class:`~rlhf_fusion.runtime.training_engine.FusedPipelineEngine`: its stages, plan and
    reallocation) with TRL's losses, and the whole copies it refreshes."""

    def __init__(self, policy: nn.Module, value_model: nn.Module, *, args: Any, stages: int,
                 world: int, rank: int, device: torch.device, solver: str,
                 time_limit: float) -> None:
        if stages < 2 or world % stages:
            raise FusionConfigError(
                f"pipeline_stages={stages} with {world} process(es): the processes must form "
                f"whole pipelines (world a multiple of pipeline_stages >= 2); launch "
                f"{stages} x k processes (accelerate launch --num_processes) or set "
                "pipeline_stages=1")
        self.args = args
        self.stages = stages
        self.world = world
        self.rank_id = rank
        self.replicas = world // stages
        self.device = device
        self.solver = solver
        self.time_limit = time_limit
        # Whole copies for generation and scoring; training owns the originals, cut in place.
        self.whole = {"actor": copy.deepcopy(policy), "critic": copy.deepcopy(value_model)}
        # Every process's micro-batches of one mini-batch go through its replica's pipeline.
        micro = stages * (args.local_mini_batch_size // args.per_device_train_batch_size)
        every = tuple(range(world))
        self.engine = FusedPipelineEngine(EngineSpec(
            layouts={r: Layout(self.replicas, pp=stages, ranks=every) for r in ROLES},
            targets={r: Layout(world, ranks=every) for r in ROLES},
            rank=rank, world=world, ppo=PPOConfig(), make_optimizers=lambda _params: {},
            device=device, distributed=True, replicas=self.replicas, stage_groups=stages,
            solver=solver, solver_time_limit=time_limit, timeout_s=300.0,
            loss_fns=_ppo_loss_fns(args), micro_batches=micro, trace=False))
        self.engine.setup({"actor": policy, "critic": value_model})
        self.fused: FusedRank = self.engine.fused

    @property
    def replica(self) -> int:
        return self.rank_id // self.stages

    def gather(self, mine: ProcessBatch) -> list[ProcessBatch]:
        """Every process's batch, in rank order (each replica reads its own processes')."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def step(self, micro_batches: Sequence[Mapping[str, Tensor]], optimizer: Any, *,
             loss_denominator: float) -> dict[str, dict[str, float]]:
        """Forward and backward of this replica's micro-batches (each loss divided by
        ``loss_denominator``); with ``optimizer``, then sync the gradients and step. Returns
        the loss statistics summed over micro-batches and replicas, each divided by the
        denominator."""
        if self.fused.engine is None:   # the first step plans the pipeline
            self.engine.prepare(micro_batches)
            for stage in self.fused.stages.values():  # profiling ran real backwards
                for p in stage.parameters():
                    p.grad = None
        forward_backward(self.fused, micro_batches, loss_denominator=loss_denominator)
        stats = self.fused._engine().reduced_stats()
        if optimizer is not None:
            optimizer_step(self.fused, None, max_grad_norm=None)  # gradient sync only
            optimizer.step()
            optimizer.zero_grad()
        return stats

    @torch.no_grad()
    def sync_whole_copies(self) -> None:
        """Training layout -> the whole copies (ReaLHF §6 reallocation)."""
        for role, whole in self.whole.items():
            whole.load_state_dict(full_state(whole, self.engine.whole_weights(role)))

    def close(self) -> None:
        self.engine.close()
