"""A TRL PPO script with one changed import: rlhf-fusion's drop-in trainer.

    python examples/trl_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/trl_ppo.py --model ./my-local-model --reward-model ./my-reward-model

Written as trl 1.12's PPO example is (policy, value and reward models from paths, a prompt
dataset tokenized with left padding, ``PPOConfig`` + ``PPOTrainer``); the import below is the
only change, and it runs on trl 1.12-1.16 (TRL itself has no PPO after 1.12). ``--stock`` uses
every plugin off (``FusionConfig.off()``: TRL's behaviour step for step).
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

# The one changed import (was: from trl.experimental.ppo import PPOConfig, PPOTrainer).
from rlhf_fusion.integrations.trl import FusedPPOTrainer as PPOTrainer
from rlhf_fusion.integrations.trl import FusionConfig, PPOConfig

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
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--stock", action="store_true", help="every plugin off")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    reward_path = args.reward_model or args.model
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    for m in (policy, value_model, reward_model):
        m.config.pad_token_id = tokenizer.pad_token_id

    def tokenize(row: dict) -> dict:
        return {"input_ids": tokenizer(row["prompt"])["input_ids"]}

    dataset = Dataset.from_dict({"prompt": PROMPTS * 4}).map(tokenize, remove_columns=["prompt"])
    training_args = PPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_ppo_epochs=2, num_mini_batches=1,
        total_episodes=args.episodes, response_length=args.response_length, stop_token="eos",
        learning_rate=3e-6, report_to=[], save_strategy="no", num_sample_generations=0,
        bf16=False, logging_steps=1)
    trainer = PPOTrainer(
        args=training_args, processing_class=tokenizer, model=policy, ref_model=None,
        reward_model=reward_model, value_model=value_model, train_dataset=dataset,
        fusion=FusionConfig.off() if args.stock else FusionConfig())
    trainer.train()
    trainer.save_model(args.output_dir)
    last = [h for h in trainer.state.log_history if "objective/scores" in h][-1]
    print(f"done: objective/scores {last['objective/scores']:.4f}, "
          f"{last['samples_per_s']:.1f} samples/s, saved to {args.output_dir}")


if __name__ == "__main__":
    main()
