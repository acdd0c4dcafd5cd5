"""Run under ``accelerate launch`` by ``tests/test_trl_launch.py``: ``FusedPPOTrainer`` with
every plugin (``rt="auto"``) on the tiny model, checking every streamed rollout:

- every sample of this process comes back exactly once, in order, behind its own query row;
- the generation copy is whole (no ZeRO-3 partition) and holds exactly the training policy's
  gathered weights of that iteration (so it was refreshed after the last optimizer step),
  and those weights change from one rollout to the next;
- the generation logprobs equal the live (sharded under ZeRO-3) policy's teacher-forced ones.

Rank 0 prints ``checks: <json>`` with every process's records.
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    set_seed,
)

from rlhf_fusion.integrations.trl import FusedPPOTrainer, FusionConfig, PPOConfig
from rlhf_fusion.integrations.trl.rollout import left_pad, lm_forward
from rlhf_fusion.integrations.trl.sharded import full_state_dict, sharding
from rlhf_fusion.launch import exit_promptly


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=0)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    set_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    ref = None if args.lora_r else AutoModelForCausalLM.from_pretrained(args.model)
    value = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    for m in (policy, ref, value, reward):
        if m is not None:
            m.config.pad_token_id = tok.pad_token_id
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=8, lora_dropout=0.0,
                                 init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    prompts = ["the cat sings", "a dog runs", "hello there", "go on now", "blue sky", "say it"]
    ds = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts * 4]})
    batch = 4
    config = PPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_ppo_epochs=2, num_mini_batches=1,
        total_episodes=args.iterations * 2 * batch, response_length=16, stop_token="eos",
        learning_rate=1e-3, report_to=[], save_strategy="no", num_sample_generations=0,
        bf16=False, use_cpu=True, logging_steps=1, seed=0, disable_tqdm=True)
    trainer = FusedPPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref,
                              reward_model=reward, value_model=value, train_dataset=ds,
                              peft_config=peft_config, fusion=FusionConfig())
    pad = tok.pad_token_id
    records: list[dict] = []
    real = trainer._streamed_rollout

    def checked(queries: torch.Tensor, update: int, unwrapped: object):
        out = real(queries, update, unwrapped)
        live = unwrapped.policy  # type: ignore[attr-defined]
        rows = left_pad(queries, pad)
        ctx = rows.shape[1]
        copy = trainer._backend.model
        full = full_state_dict(live)  # collective under ZeRO-3
        mine = copy.state_dict()
        copy_diff = max((mine[k].float() - v.float()).abs().max().item() for k, v in full.items())
        with torch.no_grad():
            logits = lm_forward(live, out.query_responses, pad).logits[:, ctx - 1: -1]
            logits = logits / (config.temperature + 1e-7)
            lp = torch.log_softmax(logits, -1).gather(2, out.responses[..., None])[..., 0]
        lengths = (out.responses != pad).cumprod(1).sum(1).tolist()
        lp_diff = max((lp[i, :g] - out.logprobs[i, :g]).abs().max().item()
                      for i, g in enumerate(lengths) if g)
        records.append({
            "update": update, "rank": trainer.accelerator.process_index,
            "rows": out.query_responses.shape[0], "queries": queries.shape[0],
            "same_queries": bool(torch.equal(out.query_responses[:, :ctx].cpu(), rows.cpu())),
            "policy_sharded": sharding(live), "copy_sharded": sharding(copy),
            "copy_diff": copy_diff, "lp_diff": lp_diff,
            "copy_sum": float(sum(v.double().sum() for v in mine.values())),
            "rt": out.stats.get("fusion/rt")})
        return out

    trainer._streamed_rollout = checked  # type: ignore[method-assign]
    trainer.train()
    everyone = gather_object(records)
    if trainer.accelerator.is_main_process:
        print("checks: " + json.dumps(everyone))
    # As examples/trl_ppo.py: no C++ teardown while DeepSpeed still holds its process groups.
    trainer.accelerator.end_training()
    exit_promptly(0)


if __name__ == "__main__":
    main()
