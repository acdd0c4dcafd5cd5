"""Execution of fused pipeline instruction streams on torch.distributed.

Stage partitioning of Hugging Face decoders (:mod:`.partition`), PPO losses (:mod:`.ppo`),
point-to-point transport with shape headers and timeouts (:mod:`.comm`), the stream executor
(:mod:`.engine`), the profiling pass that feeds the planner (:mod:`.profile`) and the one way to
assemble a fused PPO step (:mod:`.fused`: ``partition_rank`` -> ``FusedRank.plan`` ->
``forward_backward`` / ``optimizer_step``). Gloo on CPU, NCCL on GPU.
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
    ROLES,
    FusedRank,
    canonical_state_dict,
    check_models_against_problem,
    default_loss_fns,
    forward_backward,
    fused_problem,
    model_outputs,
    optimizer_step,
    partition_rank,
    pipelined_step,
    plan_from,
    problem_from_profiles,
    reference_step,
    setup_rank,
    solve_or_greedy,
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
from .profile import SavedTensorMeter, StageProfile, profile_runner
from .realloc_execute import ParamTable, ReallocResult, local_shard, param_table

__all__ = [
    "ROLES",
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
    "ParamTable",
    "PlanError",
    "ReallocResult",
    "Resident",
    "SavedTensorMeter",
    "StageProfile",
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
    "forward_backward",
    "fused_problem",
    "kl_estimate",
    "kl_penalized_rewards",
    "local_shard",
    "logprobs_from_logits",
    "masked_mean",
    "model_outputs",
    "num_layers",
    "optimizer_step",
    "param_table",
    "partition_",
    "partition_rank",
    "pipelined_step",
    "plan_from",
    "policy_loss",
    "position_ids_from_mask",
    "problem_from_profiles",
    "profile_runner",
    "reference_step",
    "scale_loss",
    "setup_rank",
    "solve_or_greedy",
    "split_layers",
    "split_micro_batches",
    "value_loss",
    "values_from_head",
]
