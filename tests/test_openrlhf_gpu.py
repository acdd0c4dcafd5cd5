"""OpenRLHF integration end to end on one GPU: two PPO steps of a 0.5B model through
``python -m rlhf_fusion.integrations.openrlhf`` (every --fusion plugin that is wired on).
Needs CUDA with openrlhf 0.11.2, vllm, deepspeed and flash_attn installed, and the model in the
Hugging Face cache or reachable (RLHF_FUSION_OPENRLHF_MODEL overrides the id)."""

from __future__ import annotations

import json
import os
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


def test_two_ppo_steps_of_a_05b_model_on_one_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for mod in ("openrlhf", "ray", "vllm", "deepspeed", "flash_attn"):
        pytest.importorskip(mod)
    model = os.environ.get("RLHF_FUSION_OPENRLHF_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"Count from {i} to {i + 5}:"}) + "\n"
                            for i in range(16)))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FUNC)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rlhf_fusion.integrations.openrlhf",
           "--actor.model_name_or_path", model, "--critic.model_name_or_path", model,
           "--reward.remote_url", str(reward),
           "--ref.num_gpus_per_node", "1", "--actor.num_gpus_per_node", "1",
           "--critic.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
           "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.3",
           "--vllm.enable_sleep", "--ds.enable_sleep", "--train.colocate_all",
           "--vllm.enforce_eager",
           "--data.prompt_dataset", str(data), "--data.input_key", "input",
           "--data.max_samples", "16", "--data.max_len", "256",
           "--rollout.max_new_tokens", "64", "--rollout.batch_size", "8",
           "--rollout.micro_batch_size", "4", "--train.batch_size", "8",
           "--train.micro_batch_size", "4", "--train.num_episodes", "1",
           "--train.max_epochs", "1", "--algo.advantage.estimator", "gae",
           "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa",
           "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpt"),
           "--logger.logging_steps", "1",
           "--fusion.gae", "--fusion.stream", "--fusion.rt", "0.5",
           # one GPU means colocate_all: the stock make_experience path, through the wrapped
           # BasePPOTrainer.__init__ of the real PPOTrainer
           "--fusion.stream_scoring"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert out.exists(), tail  # the stock train saved the actor after its two steps
    assert "--fusion.stream_scoring falls back to stock" in proc.stdout + proc.stderr, tail
