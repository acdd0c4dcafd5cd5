"""GRPO with TRL, made faster by rlhf-fusion: the only change is the trainer's import.

    python examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/trl_grpo.py --model ./my-local-model --max-steps 2
    python examples/trl_grpo.py --model ./my-local-model --algo rloo   # RLOO, same arguments

The reward prefers answers of about 20 words that end a sentence; replace ``reward_len`` with
your own reward functions (or reward model ids), as with TRL.
"""

from __future__ import annotations

import argparse
import hashlib

from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, RLOOConfig

from rlhf_fusion.integrations.trl import FusedGRPOTrainer as GRPOTrainer
from rlhf_fusion.integrations.trl import FusedRLOOTrainer as RLOOTrainer
from rlhf_fusion.integrations.trl import FusionConfig
from rlhf_fusion.launch import exit_promptly

PROMPTS = [
    "Write a short sentence about the sea:",
    "Describe a cat in a few words:",
    "What is the capital of France?",
    "Give me one tip for writing clearly:",
    "Name a color and say why you like it:",
    "Say something kind about mornings:",
    "How do plants drink water?",
    "Tell a one-line story about a dog:",
]


def reward_len(prompts, completions, **kwargs):
    """About 20 words, ending a sentence."""
    out = []
    for c in completions:
        words = len(c.split())
        out.append(1.0 - min(abs(words - 20), 20) / 20 + (0.5 if c.strip().endswith(".") else 0.0))
    return out


class StepCounter(TrainerCallback):
    """The optimizer steps this launch trains (a resumed run trains only the remaining ones)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hub id or local directory")
    ap.add_argument("--output-dir", default="trl-grpo-run")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="per-device train batch size")
    ap.add_argument("--max-completion-length", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (float32)")
    ap.add_argument("--algo", choices=["grpo", "rloo"], default="grpo",
                    help="grpo: (Fused)GRPOTrainer; rloo: (Fused)RLOOTrainer")
    ap.add_argument("--save-steps", type=int, default=0,
                    help="checkpoint every N steps into --output-dir (0: no checkpoints)")
    ap.add_argument("--resume", action="store_true",
                    help="resume from the last checkpoint in --output-dir")
    ap.add_argument("--fusion", choices=["on", "off", "stock"], default="on",
                    help="on: every plugin (R_t 'auto'); off: FusionConfig.off(); stock: TRL's "
                         "own trainer (what 'off' must equal)")
    args = ap.parse_args()

    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    config_cls = GRPOConfig if args.algo == "grpo" else RLOOConfig
    config = config_cls(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        beta=args.beta,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        bf16=not args.cpu,
        use_cpu=args.cpu,
    )
    counter = StepCounter()
    if args.fusion == "stock":
        import trl

        stock = trl.GRPOTrainer if args.algo == "grpo" else trl.RLOOTrainer
        trainer = stock(model=args.model, reward_funcs=reward_len, args=config,
                        train_dataset=dataset, callbacks=[counter])
    else:
        fusion = FusionConfig() if args.fusion == "on" else FusionConfig.off()
        fused = GRPOTrainer if args.algo == "grpo" else RLOOTrainer
        trainer = fused(model=args.model, reward_funcs=reward_len, args=config,
                        train_dataset=dataset, callbacks=[counter], fusion=fusion)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    # The trained weights, gathered whole under ZeRO-3 / FSDP (a collective): a run with
    # --fusion off must print the same digest as --fusion stock.
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if trainer.accelerator.is_main_process:
        digest = hashlib.sha256()
        for k in sorted(state):
            digest.update(k.encode() + state[k].detach().float().cpu().numpy().tobytes())
        print(f"done: {trainer.state.global_step} steps ({counter.steps} in this launch), "
              f"reward {rewards[0]:.3f} -> "
              f"{rewards[-1]:.3f}, weights sha256 {digest.hexdigest()[:16]}")
    # Tear the process group down, then leave without the C++ teardown. DeepSpeed's engine and
    # DDP's reducer keep their process groups, and gloo's threads, alive past
    # destroy_process_group, and torch's static destructors at interpreter exit then abort a
    # finished run now and then ("terminate called without an active exception": rank 1 of
    # a ZeRO-2 launch in CI). Python's exit handlers still run.
    trainer.accelerator.end_training()
    exit_promptly(0)


if __name__ == "__main__":
    main()
