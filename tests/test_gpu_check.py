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


# Slow (about a minute): run it before a device session; the steps' own code is tested in CI.
@pytest.mark.slow
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
    assert re.search(r"^loop: samples_per_s .*objective/scores", loop, re.M), loop[-2000:]
    assert "logits bit-identical" in (tmp_path / "d_offload.log").read_text()
    assert re.search(r"^Total: \d+ s, 0 failed", summary, re.M), summary


def test_trl_benchmark_qwen2_model_keeps_the_eos_probability_of_the_tiny_model(tmp_path):
    """benchmarks/trl.py --cuda's model: tied embeddings, and a per-step EOS probability equal
    to the 36-token tiny model's for the same --eos-bias, whatever the vocabulary."""
    import importlib.util
    import math

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("bench_trl", ROOT / "benchmarks" / "trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = bench.qwen2_model_dir(str(tmp_path), 0, eos_bias=0.5, hidden=64, layers=2, heads=4,
                                 kv_heads=2, intermediate=128, vocab=4096, max_positions=64,
                                 dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 9, 2, 700, 3000, 14, 1, 8]])
    with torch.no_grad():
        p_eos = model(input_ids=ids).logits.softmax(-1)[0, :, 1]
    want = math.exp(0.5) / (math.exp(0.5) + 35)   # the tiny model: 36 tokens
    # Within 15%: the constant feature is about, not exactly, sqrt(hidden) after the final norm
    # (without the construction p_eos is about 1 / 4096).
    assert torch.allclose(p_eos, torch.full_like(p_eos, want), rtol=0.15), (p_eos, want)
