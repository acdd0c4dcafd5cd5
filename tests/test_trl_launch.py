"""``examples/trl_grpo.py`` under ``accelerate launch --num_processes 2`` on the CPU (gloo),
with each of ``examples/accelerate/*_cpu.yaml``: multi-process DDP and DeepSpeed ZeRO-1, 2
and 3 (DeepSpeed's CPU accelerator); GRPO, and RLOO (``--algo rloo``).

- ``test_grpo_launch_runs_with_rt_auto`` / ``test_rloo_launch_runs_with_rt_auto``: the fused
  trainer (every plugin, ``rt="auto"``) trains the requested steps without error. Every step
  checks that each sample of the batch came back exactly once (``_fused_rollout`` raises
  otherwise); under ZeRO-3 the generation copy is built from the gathered weights (a copy of
  the partitioned model fails at its first decode step).
- ``test_grpo_launch_off_equals_stock`` / ``test_rloo_launch_off_equals_stock``: with
  ``FusionConfig.off()`` the trained weights (gathered whole) have the same SHA-256 as TRL's
  own trainer under the same config: bit for bit.

One launch takes 30 s on an idle 2-core machine and several minutes on a loaded one, so only
the DDP run of the fused GRPO trainer is in the default selection; the rest of the matrix is
``slow``. The first ZeRO launch on a machine JIT-builds DeepSpeed's CPU shared-memory
communication op (cached under ``~/.cache/torch_extensions``; a C++ compiler is needed). FSDP
is not in it: accelerate 1.15 turns ``distributed_type: FSDP`` into FSDP only
from a multi-accelerator type (``AcceleratorState.__init__``, ``accelerate/state.py``: the
promotion to ``DistributedType.FSDP`` sits under ``MULTI_GPU``/``MULTI_NPU``/..., never
``MULTI_CPU``), so with ``use_cpu: true`` it runs plain DDP and no parameter is a DTensor.
The FSDP2 generation copy is tested on CPU through torch's ``fully_shard`` over gloo
(``tests/test_trl_rt_zero.py``); ``examples/accelerate/fsdp2.yaml`` is for GPUs.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "accelerate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


def launch(config: str, model: str, out: Path, *extra: str, steps: int = 10) -> str:
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:   # other launches may hold accelerate's default port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(CONFIGS / f"{config}_cpu.yaml"), "--main_process_port", str(port),
         str(ROOT / "examples" / "trl_grpo.py"), "--model", model, "--cpu",
         "--max-steps", str(steps), "--max-completion-length", "16", "--batch-size", "4",
         "--output-dir", str(out), *extra],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    m = re.search(rf"done: {steps} steps, .* weights sha256 (\w+)", proc.stdout)
    assert m, proc.stdout[-2000:]
    return m.group(1)


CONFIG_NAMES = ["ddp", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("config", [
    c if c == "ddp" else pytest.param(c, marks=pytest.mark.slow) for c in CONFIG_NAMES])
def test_grpo_launch_runs_with_rt_auto(config, model_dir, tmp_path):
    launch(config, model_dir, tmp_path / "run", "--fusion", "on",
           steps=10 if config != "ddp" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_grpo_launch_off_equals_stock(config, model_dir, tmp_path):
    off = launch(config, model_dir, tmp_path / "off", "--fusion", "off", steps=3)
    stock = launch(config, model_dir, tmp_path / "stock", "--fusion", "stock", steps=3)
    assert off == stock


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_rloo_launch_runs_with_rt_auto(config, model_dir, tmp_path):
    launch(config, model_dir, tmp_path / "run", "--algo", "rloo", "--fusion", "on",
           steps=10 if config != "ddp" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_rloo_launch_off_equals_stock(config, model_dir, tmp_path):
    off = launch(config, model_dir, tmp_path / "off", "--algo", "rloo", "--fusion", "off",
                 steps=3)
    stock = launch(config, model_dir, tmp_path / "stock", "--algo", "rloo", "--fusion", "stock",
                   steps=3)
    assert off == stock


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_launch_resume_equals_the_uninterrupted_run(algo, model_dir, tmp_path):
    """DDP, every plugin (migration, ``rt="auto"``): 4 steps checkpointed at 2, and a second
    launch resuming from that checkpoint, end with the same weights (SHA-256)."""
    import shutil

    full = launch("ddp", model_dir, tmp_path / "full", "--algo", algo, "--save-steps", "2",
                  steps=4)
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = launch("ddp", model_dir, tmp_path / "resumed", "--algo", algo, "--save-steps",
                     "2", "--resume", steps=4)
    assert resumed == full


def test_ppo_launch_runs_under_ddp(model_dir, tmp_path):
    """``examples/trl_ppo.py`` (FusedPPOTrainer, every plugin, ``rt="auto"``) under
    ``ddp_cpu.yaml``: 4 iterations over 2 processes. DeepSpeed and PEFT are still refused by
    FusedPPOTrainer (docs/trl.md)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(CONFIGS / "ddp_cpu.yaml"), "--main_process_port", str(port),
         str(ROOT / "examples" / "trl_ppo.py"), "--model", model_dir, "--episodes", "32",
         "--batch-size", "4", "--response-length", "16", "--output-dir", str(tmp_path / "ppo")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done: objective/scores" in proc.stdout
    assert "'episode': 32" in proc.stdout or "'episode': '32'" in proc.stdout, proc.stdout[-2000:]
