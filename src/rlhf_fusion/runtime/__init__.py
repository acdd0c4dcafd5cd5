"""Execution of fused pipeline instruction streams on torch.distributed.

Stage partitioning of Hugging Face decoders (:mod:`.partition`), PPO losses (:mod:`.ppo`),
point-to-point transport with shape headers and timeouts (:mod:`.comm`), the stream executor
(:mod:`.engine`) and the PPO glue (:mod:`.fused`). Gloo on CPU, NCCL on GPU.
"""

from .comm import PipelineComm, Transfer
from .engine import (
    EmulatedStageRunner,
    PipelineEngine,
    StageRunner,
    StepTrace,
    TrainStageRunner,
    clip_grad_norm_,
    scale_loss,
)
from .errors import PartitionError, PeerError, PipelineError, PipelineTimeoutError, PlanError
from .fused import (
    FusedRank,
    canonical_state_dict,
    check_models_against_problem,
    default_loss_fns,
    fused_problem,
    model_outputs,
    pipelined_step,
    plan_from,
    reference_step,
    setup_rank,
)
from .microbatch import position_ids_from_mask, split_micro_batches
from .partition import CriticModel, Dropped, PipelineStage, num_layers, partition_, split_layers
from .plan import PipelinePlan, Resident
from .ppo import (
    PPOConfig,
    actor_ppo_loss,
    critic_ppo_loss,
    kl_estimate,
    kl_penalized_rewards,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    value_loss,
    values_from_head,
)

__all__ = [
    "CriticModel",
    "Dropped",
    "EmulatedStageRunner",
    "FusedRank",
    "PPOConfig",
    "PartitionError",
    "PeerError",
    "PipelineComm",
    "PipelineEngine",
    "PipelineError",
    "PipelinePlan",
    "PipelineStage",
    "PipelineTimeoutError",
    "PlanError",
    "Resident",
    "StageRunner",
    "StepTrace",
    "TrainStageRunner",
    "Transfer",
    "actor_ppo_loss",
    "canonical_state_dict",
    "check_models_against_problem",
    "clip_grad_norm_",
    "critic_ppo_loss",
    "default_loss_fns",
    "fused_problem",
    "kl_estimate",
    "kl_penalized_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "model_outputs",
    "num_layers",
    "partition_",
    "pipelined_step",
    "plan_from",
    "policy_loss",
    "position_ids_from_mask",
    "reference_step",
    "scale_loss",
    "setup_rank",
    "split_layers",
    "split_micro_batches",
    "value_loss",
    "values_from_head",
]
