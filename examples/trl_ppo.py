"""A TRL PPO script with one changed import: rlhf-fusion's drop-in trainer.

    python examples/trl_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/trl_ppo.py --model ./my-local-model --reward-model ./my-reward-model
    accelerate launch --config_file examples/accelerate/zero3_cpu.yaml examples/trl_ppo.py \\
        --model ./my-local-model --cpu

Written as trl 1.12's PPO example is (policy, Ref, value and reward models from paths, a prompt
dataset tokenized with left padding, ``PPOConfig`` + ``PPOTrainer``); the import below is the
only change, and it runs on trl 1.12-1.16 (TRL itself has no PPO after 1.12).

What DeepSpeed needs, for stock and fused alike (both were tried under each
``examples/accelerate/*_cpu.yaml``):

- an explicit Ref model (loaded from ``--model``, as TRL's own PPO example does; ``--lora-r``
  uses the adapter-free policy instead): TRL's ``create_reference_model`` refuses ZeRO-3;
- on the CPU, ``PPOConfig(use_cpu=True)`` (``--cpu``): without it transformers sizes
  DeepSpeed's ``train_batch_size`` for one process and DeepSpeed's batch check fails
  (``4 != 4 * 1 * 2`` with two processes).

``--fusion``: ``on`` (every plugin), ``off`` (``FusionConfig.off()``) or ``stock`` (TRL's own
``PPOTrainer``, trl 1.12 only; what ``off`` must equal).
"""

from __future__ import annotations

import argparse
import hashlib

from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    set_seed,
)

# The one changed import (was: from trl.experimental.ppo import PPOConfig, PPOTrainer).
from rlhf_fusion.integrations.trl import FusedPPOTrainer as PPOTrainer
from rlhf_fusion.integrations.trl import FusionConfig, PPOConfig
from rlhf_fusion.launch import exit_promptly

PROMPTS = [
    "Write one sentence about the sea.", "Name three colours.", "What is a cat?",
    "Say something kind.", "Describe rain in a few words.", "Why is the sky blue?",
    "Give me a short greeting.", "Tell me a fact about trees.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="policy: Hub id or local directory")
    ap.add_argument("--reward-model", default=None, help="default: --model with a value head")
    ap.add_argument("--output-dir", default="trl-ppo-run")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="per-process rollout batch")
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=0, help="train a LoRA adapter of this rank "
                    "(peft_config); the Ref is then the policy without it")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (float32)")
    ap.add_argument("--fusion", choices=["on", "off", "stock"], default="on")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Value heads missing from the checkpoint are initialised at random: seeded, so every
    # process and every run starts from the same ones.
    set_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    ref_policy = None if args.lora_r else AutoModelForCausalLM.from_pretrained(args.model)
    reward_path = args.reward_model or args.model
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    for m in (policy, ref_policy, value_model, reward_model):
        if m is not None:
            m.config.pad_token_id = tokenizer.pad_token_id
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def tokenize(row: dict) -> dict:
        return {"input_ids": tokenizer(row["prompt"])["input_ids"]}

    dataset = Dataset.from_dict({"prompt": PROMPTS * 4}).map(tokenize, remove_columns=["prompt"])
    training_args = PPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_ppo_epochs=2, num_mini_batches=1,
        total_episodes=args.episodes, response_length=args.response_length, stop_token="eos",
        learning_rate=3e-6, report_to=[], save_strategy="no", num_sample_generations=0,
        bf16=not args.cpu, use_cpu=args.cpu, logging_steps=1, seed=0)
    models = dict(args=training_args, processing_class=tokenizer, model=policy,
                  ref_model=ref_policy, reward_model=reward_model, value_model=value_model,
                  train_dataset=dataset, peft_config=peft_config)
    if args.fusion == "stock":
        from trl.experimental.ppo import PPOTrainer as StockPPOTrainer

        trainer = StockPPOTrainer(**models)
    else:
        trainer = PPOTrainer(**models, fusion=FusionConfig() if args.fusion == "on"
                             else FusionConfig.off())
    trainer.train()
    # The trained Actor and Critic, gathered whole under ZeRO-3 (a collective): a run with
    # --fusion off must print the same digest as --fusion stock.
    state = trainer.accelerator.get_state_dict(trainer.model)
    if args.fusion != "stock" or trainer.accelerator.num_processes == 1:
        # (trl 1.12's own save_model fails with several processes: under DDP it saves the
        # DDP wrapper, whose shared tensors safetensors refuses; under DeepSpeed with
        # transformers 5 it hands Trainer the policy as its DeepSpeed engine.)
        trainer.save_model(args.output_dir)
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    if trainer.accelerator.is_main_process:
        digest = hashlib.sha256()
        for k in sorted(state):
            digest.update(k.encode() + state[k].detach().float().cpu().numpy().tobytes())
        last = logs[-1]
        rate = f"{last['samples_per_s']:.1f} samples/s, " if "samples_per_s" in last else ""
        print(f"done: {len(logs)} iterations, episode {last['episode']}, objective/scores "
              f"{last['objective/scores']:.4f}, {rate}weights sha256 {digest.hexdigest()[:16]}, "
              f"saved to {args.output_dir}")
    # Tear the process group down, then leave without the C++ teardown. DeepSpeed's engine and
    # DDP's reducer keep their process groups, and gloo's threads, alive past
    # destroy_process_group, and torch's static destructors at interpreter exit then abort a
    # finished run now and then ("terminate called without an active exception": rank 1 of
    # a ZeRO-2 launch in CI). Python's exit handlers still run.
    trainer.accelerator.end_training()
    exit_promptly(0)


if __name__ == "__main__":
    main()
