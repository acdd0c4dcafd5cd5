"""PPO with every rlhf-fusion plugin on a Hugging Face model (a Hub id or a local directory).

    python examples/ppo_hub.py --model Qwen/Qwen2.5-0.5B-Instruct --world-size 2

The Actor, the Ref (a frozen copy) and the Critic's backbone come from ``--model``; the reward
is a rule on the response text (replace ``reward`` with your reward model's id or your own
function). Prompts: ``--prompts FILE`` (one a line), or the demo's prompt set.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_fusion.cli import run_logged
from rlhf_fusion.loop import (
    FusionLoopConfig,
    GenerationConfig,
    LoopConfigError,
    ModelsConfig,
    PPOLoopConfig,
    RLHFConfig,
    load_prompts,
    train,
)
from rlhf_fusion.loop.demo import demo_prompts


def reward(prompt: str, response: str) -> float:
    """Rewards answers of about 20 words that end a sentence."""
    words = len(response.split())
    return 1.0 - min(abs(words - 20), 20) / 20 + (0.5 if response.strip().endswith(".") else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hub id or local directory")
    ap.add_argument("--prompts", default=None, help="prompt file (default: the demo's)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--prompts-per-iteration", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="ppo-hub-run")
    ap.add_argument("--serial", action="store_true", help="no fusion (the baseline)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out")
    ap.add_argument("--overwrite", action="store_true", help="start over in a non-empty --out")
    args = ap.parse_args()
    cfg = RLHFConfig(
        models=ModelsConfig(actor=args.model, reward=reward),
        generation=GenerationConfig(prompts_per_iteration=args.prompts_per_iteration,
                                    max_new_tokens=args.max_new_tokens),
        ppo=PPOLoopConfig(learning_rate=1e-6, num_mini_batches=2, micro_batches=2),
        fusion=FusionLoopConfig.off() if args.serial else FusionLoopConfig(),
        world_size=args.world_size,
        iterations=args.iterations,
    )
    try:
        cfg.validate()   # a missing model folder, a bad number: one line, before any process
        prompts = load_prompts(args.prompts) if args.prompts else demo_prompts()
    except LoopConfigError as exc:
        print(f"ppo_hub.py: error: {exc}", file=sys.stderr)
        return 2
    # A failure while running: one line here, every traceback in OUT/error.log.
    return run_logged("ppo_hub.py", args.out,
                      lambda: train(cfg, prompts, out_dir=args.out, checkpoint_every=1,
                                    resume=args.resume, overwrite=args.overwrite))


if __name__ == "__main__":
    raise SystemExit(main())
