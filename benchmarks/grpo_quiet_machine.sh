#!/usr/bin/env bash
# Issue 37's GRPO speed measurements in one go, for a machine with cores to spare (the device
# machine's 16 CPU cores: no GPU is used). On the 2-core development VM the two ranks, the
# launcher and the OS share two cores; here each rank has a core of its own.
#   1. benchmarks/demo_compare.py --algo grpo --pairs PAIRS  (rlhf-fusion demo --algo grpo --compare)
#   2. benchmarks/grpo_simulator_check.py --iterations 40     (simulator vs measured, per stage)
#   3. benchmarks/grpo_interleaved.py --iterations 16 --workload tail
#   4. benchmarks/grpo_simulator_check.py --workload tail --iterations 16 --skip 4
#
#   bash benchmarks/grpo_quiet_machine.sh            # from the repository root; PAIRS=5 default
#
# The package need not be installed: src/ goes on PYTHONPATH. Results land in
# benchmarks/results/ as usual and are copied to $OUT when it is set. PYTHON picks the
# interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
PAIRS=${PAIRS:-5}
echo "== $(date -u +%FT%TZ) $(nproc --all) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -m1 'model name' /proc/cpuinfo
$PY -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
rc=0
t=$(date +%s)
$PY benchmarks/demo_compare.py --algo grpo --pairs "$PAIRS" || rc=$((rc + 1))
echo "== demo_compare grpo: $(( $(date +%s) - t )) s"; t=$(date +%s)
$PY benchmarks/grpo_simulator_check.py --iterations 40 || rc=$((rc + 1))
echo "== grpo_simulator_check: $(( $(date +%s) - t )) s"; t=$(date +%s)
$PY benchmarks/grpo_interleaved.py --iterations 16 --workload tail || rc=$((rc + 1))
echo "== grpo_interleaved tail: $(( $(date +%s) - t )) s"; t=$(date +%s)
$PY benchmarks/grpo_simulator_check.py --workload tail --iterations 16 --skip 4 || rc=$((rc + 1))
echo "== grpo_simulator_check tail: $(( $(date +%s) - t )) s"
if [ -n "${OUT:-}" ]; then
    # (the device tool brings back 8 files: the simulator checks' tables are in the log)
    cp benchmarks/results/demo_compare_grpo.{json,md,png} benchmarks/results/grpo_simulator_check.json \
       benchmarks/results/grpo_simulator_check_tail.json benchmarks/results/grpo_interleaved_tail.{json,md} \
       "$OUT"/ 2>/dev/null
fi
exit $rc
