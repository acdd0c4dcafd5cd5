"""benchmarks/gpu_check.sh --cpu: every step of the GPU check runs on the CPU with tiny shapes
(the loop under torchrun, FusedPPOModule under Lightning, the offload round trip, TRL when it
is installed), so the script the GPU machine runs once is known to work before it gets there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_gpu_check_script_runs_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    summary = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \| ([^|]+) \|", summary,
                                                         re.M)}
    for step in ("a_gpu_tests", "b_loop_torchrun", "c_lightning", "d_offload"):
        assert rows.get(step) == "passed", (step, summary)
    assert rows.get("e_trl") in ("passed", "skipped"), summary
    # Each step says what it measured, in its log and the summary.
    loop = (tmp_path / "b_loop_torchrun.log").read_text()
    assert re.search(r"^loop: .*reward", loop, re.M), loop[-2000:]
    assert "logits bit-identical" in (tmp_path / "d_offload.log").read_text()
    assert re.search(r"^Total: \d+ s, 0 failed", summary, re.M), summary
