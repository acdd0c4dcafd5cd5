#!/usr/bin/env bash
# The GPU paths in one go (issue 35), under 8 minutes on one H100/H200:
#   a. the gpu-marked tests (pytest -m gpu)
#   b. the loop under torchrun --nproc-per-node 1 on CUDA: 3 iterations, a Qwen2.5-0.5B-shaped
#      randomly initialised model (one process, so fusion off)
#   c. FusedPPOModule under lightning.Trainer on one GPU (0.5B-shaped Actor and Critic, bf16-mixed)
#   d. HostOffload's prefetch on a 1.5B-shaped model (3.1 GB in bf16)
#   e. (if trl imports, or .whl/ holds its wheels) benchmarks/trl.py --cuda --steps 4 (3 timed
#      steps, to fit the budget): stock vs fused, GRPO and PPO, 0.5B-shaped, bf16; writes
#      benchmarks/results/trl_<gpu>.{json,md} (copied to the output folder)
#
#   bash benchmarks/gpu_check.sh          # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --cpu    # the same steps with tiny shapes on the CPU (~2 min)
#
# Each step runs whatever the others did, under its own time limit and within the whole run's
# budget (GPU_CHECK_BUDGET seconds, default 560, --cpu 1200: a step that would start past it is skipped, so
# the summary is written before a 10-minute limit). Its log, and the summary table (summary.md,
# rewritten after every step), go to $OUT if set, else ./gpu_check_out. The exit status is the
# number of failed steps (0: all passed). The package need not be installed: src/ goes on
# PYTHONPATH. PYTHON (default python3) picks the interpreter.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
OUTDIR=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1 WANDB_DISABLED=true
SUMMARY="$OUTDIR/summary.md"
T_ALL=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-$([ $CPU = 1 ] && echo 1200 || echo 560)}
FAILED=0
ROWS=()

step() {   # step NAME LIMIT_S COMMAND...: run one step, log it, record its row
    local name=$1 limit=$2
    shift 2
    local log="$OUTDIR/$name.log" t0 rc left
    t0=$(date +%s)
    left=$(( T_ALL + BUDGET - t0 - 5 ))
    if [ $left -lt 30 ]; then
        ROWS+=("| $name | SKIPPED | 0 | no time left in the ${BUDGET} s budget |")
        FAILED=$((FAILED + 1))
        write_summary
        return
    fi
    [ $left -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee "$log"
    timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 ))
    local status=passed
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMED OUT"; FAILED=$((FAILED + 1))
    elif [ $rc -ne 0 ]; then status="FAILED (rc $rc)"; FAILED=$((FAILED + 1)); fi
    # The step's last lines that say what it measured (or why it failed).
    local note
    note=$(grep -E '^(loop|lightning|offload|sampling|grpo|ppo|wrote|[0-9]+ (passed|failed|skipped)|=+ .*(passed|failed|skipped|error))' "$log" \
           | tail -n 6 | tr '\n' ' ' | sed 's/|/\\|/g' | cut -c1-600)
    [ $rc -ne 0 ] && note="$note $(tail -n 3 "$log" | tr '\n' ' ' | sed 's/|/\\|/g' | cut -c1-400)"
    echo "   -> $status in ${took}s"
    ROWS+=("| $name | $status | ${took} | $note |")
    write_summary
}

write_summary() {
    local total=$(( $(date +%s) - T_ALL ))
    {
        echo "# gpu_check on $DEV"
        echo
        head -n 2 "$OUTDIR/env.txt" | tr '\n' ' '
        echo
        echo
        echo "| step | status | seconds | what it measured |"
        echo "|---|---|---|---|"
        printf '%s\n' "${ROWS[@]}"
        echo
        echo "Total: ${total} s, $FAILED failed step(s). Logs: one per step beside this file."
    } >"$SUMMARY"
}

if [ $CPU = 1 ]; then
    DEV=cpu
else
    DEV=$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")' 2>&1 | tail -n 1)
fi
{
    echo "gpu_check: $DEV; $($PY -c 'import sys, torch, transformers, lightning; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, lightning {lightning.__version__}")' 2>&1 | tail -n 1)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} | tee "$OUTDIR/env.txt"
[ $CPU = 1 ] || nvidia-smi >>"$OUTDIR/env.txt" 2>&1 || true

# a. The gpu-marked tests (on the CPU they are collected and skipped: conftest skips them).
GPU_TESTS=$(grep -l -E 'mark\.gpu|pytest\.mark\.gpu' tests/*.py | tr '\n' ' ')
step a_gpu_tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu -o addopts="" $GPU_TESTS

# b. The loop under torchrun, one process: 3 iterations.
CPUFLAG=$([ $CPU = 1 ] && echo --cpu)
step s_sampling 60 $PY benchmarks/gpu_check_steps.py sampling $CPUFLAG
step c_lightning 150 $PY benchmarks/gpu_check_steps.py lightning $CPUFLAG

LOOP_CFG="$OUTDIR/loop.yaml"
if [ $CPU = 1 ]; then
    ACTOR='{family: qwen2, layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate_size: 128, vocab_size: 512, tie: true}'
    GEN='{prompts_per_iteration: 8, max_new_tokens: 16}'
else
    ACTOR='{family: qwen2, layers: 24, hidden: 896, heads: 14, kv_heads: 2, intermediate_size: 4864, vocab_size: 151936, tie: true}'
    GEN='{prompts_per_iteration: 64, max_new_tokens: 128}'
fi
cat >"$LOOP_CFG" <<EOF
world_size: 1
iterations: 3
prompts: $ROOT/examples/configs/prompts.jsonl
models:
  actor: $ACTOR
  reward: vowels
generation: $GEN
ppo: {learning_rate: 1.0e-6, num_mini_batches: 2, micro_batches: 2}
fusion: {inter: false, intra: false}
EOF
step b_loop_torchrun 150 bash -c "$PY -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m rlhf_fusion.cli train '$LOOP_CFG' --out '$OUTDIR/loop-run' --overwrite \
    --checkpoint-every 0 && $PY benchmarks/gpu_check_steps.py loop-metrics '$OUTDIR/loop-run' 3 \
    && if [ $CPU = 0 ]; then grep -q 'one process, on cuda' '$OUTDIR/b_loop_torchrun.log' \
       || { echo 'loop: the run did not use the GPU'; exit 1; }; fi"

# c. FusedPPOModule with Lightning on one device.

# d. The offload prefetch path.
step d_offload 120 $PY benchmarks/gpu_check_steps.py offload $CPUFLAG

# e. TRL stock vs fused (optional: needs trl and datasets; .whl/ brings them).
if ! $PY -c 'import trl, datasets' >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
    SITE=${TMPDIR:-/tmp}/gpu_check_site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .whl/*.whl >"$OUTDIR/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if $PY -c 'import trl, datasets' >/dev/null 2>&1; then
    if [ $CPU = 1 ]; then
        step e_trl 300 $PY benchmarks/trl.py --quick --family qwen2 --hidden 64 --layers 2 \
            --no-write
    else
        step e_trl 400 $PY benchmarks/trl.py --cuda --steps 4 --algos grpo ppo
        # The results file comes back with $OUT.
        find benchmarks/results -name 'trl_*' -newer "$OUTDIR/env.txt" -exec cp {} "$OUTDIR/" \;
    fi
else
    ROWS+=("| e_trl | skipped | 0 | trl or datasets not importable, and no .whl/ |")
fi

write_summary
cat "$SUMMARY"
exit $FAILED
