"""``examples/trl_grpo.py`` under ``accelerate launch --num_processes 2`` on the CPU (gloo),
with each of ``examples/accelerate/*_cpu.yaml``: multi-process DDP and DeepSpeed ZeRO-1, 2
and 3 (DeepSpeed's CPU accelerator); GRPO, RLOO (``--algo rloo``) and PPO.

- ``test_grpo_launch_runs_with_rt_auto`` / ``test_rloo_launch_runs_with_rt_auto``: the fused
  trainer (every plugin, ``rt="auto"``) trains the requested steps without error. Every step
  checks that each sample of the batch came back exactly once (``_fused_rollout`` raises
  otherwise); under ZeRO-3 the generation copy is built from the gathered weights (a copy of
  the partitioned model fails at its first decode step).
- ``test_grpo_launch_off_equals_stock`` / ``test_rloo_launch_off_equals_stock``: with
  ``FusionConfig.off()`` the trained weights (gathered whole) have the same SHA-256 as TRL's
  own trainer under the same config: bit for bit.
- ``test_launch_resume_equals_the_uninterrupted_run``: GRPO and RLOO resumed from a
  checkpoint end with the uninterrupted run's weights.
- PPO (``examples/trl_ppo.py``, ``tests/_ppo_launch_check.py``): the fused trainer runs under
  DDP (default selection); under ZeRO-3 every streamed rollout is checked (every sample once,
  generation logprobs equal the sharded policy's teacher-forced ones, the generation copy
  whole and equal to that iteration's gathered weights; default selection); the same checks
  under DDP, ZeRO-1 and ZeRO-2, with and without a LoRA adapter, and ``FusionConfig.off()``
  against trl 1.12's ``PPOTrainer`` (weights digest) under every config, are ``slow``.

``ddp_cpu.yaml`` says ``MULTI_GPU`` with ``use_cpu``: accelerate 1.15 launches a single
process for ``MULTI_CPU`` (the PPO tests assert 2 processes through the episode count).

One launch takes 30 s on an idle 2-core machine and several minutes on a loaded one. The
default selection holds the DDP runs of the fused trainers and, where deepspeed is installed
(CI installs it for trl 1.12), four DeepSpeed cases: GRPO ``FusionConfig.off()`` against stock
under ZeRO-2, GRPO resume under ZeRO-3, RLOO resume under ZeRO-2 and PPO's streamed rollouts
under ZeRO-3; the rest of the matrix is ``slow``. The first ZeRO launch on a machine JIT-builds
DeepSpeed's CPU shared-memory communication op (cached under ``~/.cache/torch_extensions``; a
C++ compiler is needed). FSDP is not in it: accelerate 1.15 turns ``distributed_type: FSDP``
into FSDP only from a multi-accelerator type (``AcceleratorState.__init__``,
``accelerate/state.py``: the promotion to ``DistributedType.FSDP`` sits under
``MULTI_GPU``/``MULTI_NPU``/..., never ``MULTI_CPU``), so with ``use_cpu: true`` it runs plain
DDP and no parameter is a DTensor. ``tests/test_trl_fsdp2.py`` runs the fused GRPO trainer
through accelerate's own FSDP2 preparation on the CPU instead (the shared state switched to
FSDP); ``examples/accelerate/fsdp2.yaml`` is for GPUs.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "accelerate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


class Launch(NamedTuple):
    digest: str    # SHA-256 of the trained weights, gathered whole
    trained: int   # optimizer steps this launch ran (fewer than ``steps`` when resumed)


def launch(config: str, model: str, out: Path, *extra: str, steps: int = 10) -> Launch:
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
    m = re.search(rf"done: {steps} steps \((\d+) in this launch\), .* weights sha256 (\w+)",
                  proc.stdout)
    assert m, proc.stdout[-2000:]
    return Launch(m.group(2), int(m.group(1)))


CONFIG_NAMES = ["ddp", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("config", [
    c if c == "ddp" else pytest.param(c, marks=pytest.mark.slow) for c in CONFIG_NAMES])
def test_grpo_launch_runs_with_rt_auto(config, model_dir, tmp_path):
    launch(config, model_dir, tmp_path / "run", "--fusion", "on",
           steps=10 if config != "ddp" else 4)


@pytest.mark.parametrize("config", [
    c if c == "zero2" else pytest.param(c, marks=pytest.mark.slow) for c in CONFIG_NAMES])
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


RESUME_CASES = [(algo, config, fusion) for config in ("ddp", "zero2", "zero3")
                for algo in ("grpo", "rloo") for fusion in ("on", "stock")]
# In CI (deepspeed installed): ZeRO-3 GRPO (the gathered generation copy, resumed) and
# ZeRO-2 RLOO; every other case, TRL's own resume among them, is ``slow``.
FAST_RESUME = {("grpo", "zero3", "on"), ("rloo", "zero2", "on")}


@pytest.mark.parametrize(("algo", "config", "fusion"), [
    c if c in FAST_RESUME else pytest.param(*c, marks=pytest.mark.slow) for c in RESUME_CASES])
def test_launch_resume_equals_the_uninterrupted_run(algo, config, fusion, model_dir, tmp_path):
    """Every plugin on (migration, ``rt="auto"``; under ZeRO-3 the gathered generation copy),
    or TRL's own trainer (``stock``, what the fused run is held to): 4 steps checkpointed at
    2, and a second launch resuming from that checkpoint, end with the same weights (SHA-256).
    Under DeepSpeed the checkpoint is DeepSpeed's (``global_step2/``: partitioned optimizer
    states, loaded by its engine), and ``rlhf_fusion_state.json`` sits beside it."""
    import shutil

    full = launch(config, model_dir, tmp_path / "full", "--algo", algo, "--fusion", fusion,
                  "--save-steps", "2", steps=4)
    ckpt = tmp_path / "full" / "checkpoint-2"
    if config.startswith("zero"):
        assert (ckpt / "global_step2").is_dir(), sorted(os.listdir(ckpt))
    if fusion == "on":
        assert (ckpt / "rlhf_fusion_state.json").is_file(), sorted(os.listdir(ckpt))
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoint-2")
    resumed = launch(config, model_dir, tmp_path / "resumed", "--algo", algo, "--fusion",
                     fusion, "--save-steps", "2", "--resume", steps=4)
    assert (full.trained, resumed.trained) == (4, 2)  # the second launch did resume
    assert resumed.digest == full.digest


def launch_script(script: Path, config: str, *args: str, timeout: int = 900
                  ) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file examples/accelerate/<config>_cpu.yaml script args``
    on a free port, cut after ``timeout`` seconds; asserts a clean exit."""
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(CONFIGS / f"{config}_cpu.yaml"), "--main_process_port", str(port), str(script),
         *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
             "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def ppo_example(config: str, model: str, out: Path, *extra: str, episodes: int = 16) -> str:
    """``examples/trl_ppo.py`` under ``config``: the digest of the trained Actor and Critic."""
    needs_ppo(extra)
    proc = launch_script(ROOT / "examples" / "trl_ppo.py", config, "--model", model, "--cpu",
                         "--episodes", str(episodes), "--batch-size", "4",
                         "--response-length", "16", "--output-dir", str(out), *extra)
    m = re.search(rf"done: (\d+) iterations, episode {episodes}, .* weights sha256 (\w+)",
                  proc.stdout)
    assert m and int(m.group(1)) == episodes // 8, proc.stdout[-2000:]
    return m.group(2)


def needs_ppo(extra: tuple[str, ...]) -> None:
    from rlhf_fusion.integrations.trl.ppo_config import TRL_HAS_PPO

    if "stock" in extra and not TRL_HAS_PPO:
        pytest.skip("stock PPOTrainer exists in trl<=1.12")
    if any(a.startswith("--lora") for a in extra):
        pytest.importorskip("peft")


def test_ppo_launch_runs_under_ddp(model_dir, tmp_path):
    """``examples/trl_ppo.py`` (FusedPPOTrainer, every plugin, ``rt="auto"``) under
    ``ddp_cpu.yaml``: 4 iterations over 2 processes, the policy saved."""
    ppo_example("ddp", model_dir, tmp_path / "ppo", "--fusion", "on", episodes=32)
    assert (tmp_path / "ppo" / "model.safetensors").exists()


PPO_MATRIX = [(c, lora) for c in CONFIG_NAMES for lora in ("0", "4")]


@pytest.mark.slow
@pytest.mark.parametrize(("config", "lora"), PPO_MATRIX)
def test_ppo_launch_off_equals_stock(config, lora, model_dir, tmp_path):
    """``FusionConfig.off()`` against trl 1.12's PPOTrainer under each config, with and
    without a LoRA adapter: the same SHA-256 of the trained Actor and Critic (gathered whole),
    bit for bit. Not with PEFT under DDP: trl 1.12's PPOTrainer fails there itself (its Ref
    pass reads ``model.policy`` from the DDP wrapper: AttributeError)."""
    if (config, lora) == ("ddp", "4"):
        pytest.skip("trl 1.12's PPOTrainer fails with peft_config under DDP")
    off = ppo_example(config, model_dir, tmp_path / "off", "--fusion", "off", "--lora-r", lora)
    stock = ppo_example(config, model_dir, tmp_path / "stock", "--fusion", "stock",
                        "--lora-r", lora)
    assert off == stock


def ppo_checks(config: str, model: str, out: Path, *extra: str) -> list[dict]:
    import json

    proc = launch_script(Path(__file__).with_name("_ppo_launch_check.py"), config,
                         "--model", model, "--output-dir", str(out), "--iterations", "3",
                         *extra)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("checks: "))
    return json.loads(line[len("checks: "):])


@pytest.mark.parametrize(("config", "lora"), [
    ("zero3", "0"),
    *(pytest.param(c, lora, marks=pytest.mark.slow) for c, lora in PPO_MATRIX
      if (c, lora) != ("zero3", "0"))])
def test_ppo_launch_streams_from_the_current_whole_weights(config, lora, model_dir, tmp_path):
    """FusedPPOTrainer, every plugin on, ``rt="auto"``, 3 iterations on 2 processes
    (``tests/_ppo_launch_check.py``): every sample once, generation logprobs equal the live
    policy's teacher-forced ones, and the generation copy is whole and holds exactly the
    gathered training weights of each iteration (they change every iteration). ZeRO-3 without
    PEFT is in the default selection (the gathered copy); the other configs are ``slow``."""
    if lora != "0":
        pytest.importorskip("peft")
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    records = ppo_checks(config, model_dir, tmp_path / "run", "--lora-r", lora)
    assert sorted((r["rank"], r["update"]) for r in records) == [
        (rank, u) for rank in (0, 1) for u in (1, 2, 3)]
    for r in records:
        assert r["rows"] == r["queries"] == 4 and r["same_queries"], r
        assert r["copy_sharded"] is None and r["copy_diff"] == 0.0, r
        assert r["lp_diff"] <= 1e-4, r
        assert r["policy_sharded"] == ("zero3" if config == "zero3" else None), r
    for rank in (0, 1):
        sums = [r["copy_sum"] for r in sorted(records, key=lambda r: r["update"])
                if r["rank"] == rank]
        assert len(set(sums)) == 3  # refreshed after every iteration's optimizer steps
