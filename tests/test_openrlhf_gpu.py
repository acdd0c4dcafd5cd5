"""OpenRLHF integration end to end on a GPU: two PPO steps of a 0.5B model through the launcher
with every wired --fusion plugin, on a topology where they really run: 2 vLLM engines (so
long-tail migration has somewhere to move samples) and Actor, Critic and Ref groups of their
own, not colocated (so the Critic/Ref/Actor forwards stream while generation runs, instead of
falling back to stock).

That topology asks Ray for 5 GPUs. On a machine with fewer, Ray is told there are 5 whose ids
all map to physical GPU 0 (``CUDA_VISIBLE_DEVICES=0,0,0,0,0``: Ray hands each actor
``original_ids[i]``, i.e. "0"); every DeepSpeed group has one rank, so no NCCL communicator
holds two ranks on one device, and the DeepSpeed -> vLLM weight sync, which would (one rank per
engine plus the Actor's), goes through Ray's gloo collective (``--vllm.sync_with_ray
--vllm.sync_backend gloo``) instead of NCCL. Needs CUDA with openrlhf 0.11.2, vllm 0.29,
deepspeed and flash_attn installed, and the model in the Hugging Face cache or reachable
(RLHF_FUSION_OPENRLHF_MODEL overrides the id)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

REWARD_FUNC = '''
import torch

def reward_func(queries, prompts, labels):
    # a length-free toy reward: the share of digits in the response
    r = [sum(c.isdigit() for c in q[len(p):]) / max(len(q) - len(p), 1)
         for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(r), "scores": torch.tensor(r), "extra_logs": {}}
'''

# The launcher's run() with Ray's GPU count given (the stock train's ray.init gets it merged).
DRIVER = '''
import sys
from rlhf_fusion.integrations.openrlhf.launch import run
from rlhf_fusion.integrations.openrlhf.options import split_argv

if __name__ == "__main__":
    stock, options = split_argv(sys.argv[2:])
    run(stock, options, ray_init_kwargs={"num_gpus": int(sys.argv[1])})
'''

LOGICAL_GPUS = 5  # vLLM engines 2, Actor 1, Critic 1, Ref 1


def _steps(log: str) -> list[dict[str, float]]:
    """The fusion/* entries of each step's status, as OpenRLHF's PPOTrainer.fit logs it (the
    dict wandb and tensorboard get)."""
    return [{k: float(v) for k, v in re.findall(r"'(fusion/\w+)': ([-+\d.eE]+)", line)}
            for line in re.findall(r"Global step \d+: .*", log)]


def test_two_ppo_steps_with_migration_and_streamed_scoring(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for mod in ("openrlhf", "ray", "vllm", "deepspeed", "flash_attn"):
        pytest.importorskip(mod)
    model = os.environ.get("RLHF_FUSION_OPENRLHF_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"Count from {i} to {i * 7 + 5}:"}) + "\n"
                            for i in range(16)))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FUNC)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "out"
    env = dict(os.environ)
    if torch.cuda.device_count() < LOGICAL_GPUS:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(["0"] * LOGICAL_GPUS)
    cmd = [sys.executable, str(driver), str(LOGICAL_GPUS),
           "--actor.model_name_or_path", model, "--critic.model_name_or_path", model,
           "--reward.remote_url", str(reward),
           "--actor.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1",
           "--ref.num_gpus_per_node", "1",
           "--vllm.num_engines", "2", "--vllm.gpu_memory_utilization", "0.15",
           "--vllm.enforce_eager", "--vllm.sync_with_ray", "--vllm.sync_backend", "gloo",
           "--data.prompt_dataset", str(data), "--data.input_key", "input",
           "--data.max_samples", "16", "--data.max_len", "512",
           "--rollout.max_new_tokens", "256", "--rollout.batch_size", "8",
           "--rollout.n_samples_per_prompt", "2", "--rollout.temperature", "1.0",
           "--rollout.micro_batch_size", "4", "--train.batch_size", "16",
           "--train.micro_batch_size", "4", "--train.num_episodes", "1",
           "--train.max_epochs", "1", "--algo.advantage.estimator", "gae",
           "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa",
           "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpt"),
           "--logger.logging_steps", "1",
           "--fusion.gae", "--fusion.stream", "--fusion.rt", "0.5", "--fusion.stream_scoring"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    log = proc.stdout + proc.stderr
    tail = log[-6000:]
    assert proc.returncode == 0, tail
    assert out.exists(), tail  # the stock train saved the actor after its two steps
    assert "falls back to stock" not in log, tail  # scoring streamed: nothing colocated
    assert "rlhf_fusion: OpenRLHF plugins gae, migrate, stream, stream_scoring" in log, tail
    steps = _steps(log)
    assert len(steps) == 2, tail
    for status in steps:
        assert status["fusion/samples"] == 16
        assert status["fusion/scoring_waves"] > 0  # forwards dispatched during generation
        assert status["fusion/scoring_lead_s"] > 0
        # every sample once: each request beyond the 16 samples is one migration
        assert status["fusion/requests"] == 16 + status["fusion/migrated_samples"]
    assert sum(s["fusion/migrated_samples"] for s in steps) > 0, tail  # migration ran
