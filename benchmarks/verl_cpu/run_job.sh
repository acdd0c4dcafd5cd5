#!/usr/bin/env bash
# A tiny verl 0.9.1 PPO/GAE job (v1 trainer, sync mode) on CPU. Usage: run_job.sh ASSETS [overrides]
set -euo pipefail
A=$1; shift
# every line of every process (Ray folds repeated lines by default)
export RAY_DEDUP_LOGS=0
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}
export VERL_USE_EXTERNAL_MODULES=verl_cpu_platform,verl_gae_record VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda
"${PYTHON:-python}" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=gae \
  hydra.run.dir=$A/hydra/\${now:%Y-%m-%d_%H-%M-%S} \
  data.train_files=$A/train.parquet data.val_files=$A/val.parquet \
  data.train_batch_size=4 data.max_prompt_length=32 data.max_response_length=16 \
  actor_rollout_ref.model.path=$A/model critic.model.path=$A/model \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
  critic.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.n=1 actor_rollout_ref.rollout.enforce_eager=true \
  actor_rollout_ref.rollout.agent.num_workers=2 \
  actor_rollout_ref.rollout.load_format=auto \
  +actor_rollout_ref.rollout.enable_sleep_mode=false actor_rollout_ref.rollout.free_cache_engine=false \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.9 \
  trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.logger='[console]' \
  trainer.total_training_steps=1 trainer.val_before_train=false trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  algorithm.gamma=0.99 algorithm.lam=0.95 \
  reward.num_workers=1 reward.custom_reward_function.path=$HERE/reward.py \
  +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=16 \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
  trainer.device=cpu actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2 \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa +critic.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.model.use_remove_padding=false critic.model.use_remove_padding=false \
  "$@"
