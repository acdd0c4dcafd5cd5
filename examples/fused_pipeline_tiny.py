"""PPO training of a tiny Llama-style Actor and Critic with the fused pipeline on 2 CPU processes.

    python examples/fused_pipeline_tiny.py              # fused pipeline, 2 processes (~30 s)
    python examples/fused_pipeline_tiny.py --single     # the same module on one device
    python examples/fused_pipeline_tiny.py --model ./my-llama   # a local dir or a Hub id

What happens:
1. The Actor and Critic are built from small ``LlamaConfig``s (or loaded with ``--model``).
2. A rollout: the Actor samples responses to random prompts (cut at random lengths so
   micro-batches differ in length), the Reference and Critic score them, a toy reward pays
   for even token ids, the KL penalty goes into the reward and GAE gives advantages/returns.
3. ``lightning.Trainer(strategy="fused_pipeline", devices=2)`` runs PPO epochs on that
   experience: the Actor's stages go 0 -> 1, the Critic's 1 -> 0, with a schedule the planner
   made from a short profiling pass. ``--single`` trains the same module without the strategy.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import rlhf_fusion  # noqa: F401  (registers strategy="fused_pipeline" with Lightning)
from rlhf_fusion.plugins import FusedPipelineStrategy, FusedPPOModule
from rlhf_fusion.runtime import (
    CriticModel,
    PPOConfig,
    kl_penalized_rewards,
    logprobs_from_logits,
    model_outputs,
    position_ids_from_mask,
    values_from_head,
)
from rlhf_fusion.triton_kernels import gae


def build_models(model: str | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    if model:
        return AutoModelForCausalLM.from_pretrained(model), CriticModel.from_pretrained(model)
    actor_cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    # The Critic is smaller than the Actor, as in most RLHF setups.
    critic_cfg = LlamaConfig(**{**actor_cfg.to_dict(), "hidden_size": 32, "intermediate_size": 64})
    return LlamaForCausalLM(actor_cfg), CriticModel.from_config(critic_cfg)


@torch.no_grad()
def rollout(
    actor,
    reference,
    critic,
    *,
    samples: int,
    prompt_len: int,
    max_new: int,
    cfg: PPOConfig,
    seed: int,
) -> dict[str, torch.Tensor]:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    vocab = actor.config.vocab_size
    prompts = torch.randint(1, vocab, (samples, prompt_len), generator=g)
    torch.manual_seed(seed)
    seqs = actor.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        pad_token_id=0,
    )
    # Cut every response at its own random length (what an EOS would do).
    lengths = prompt_len + torch.randint(2, max_new + 1, (samples,), generator=g)
    pos = torch.arange(seqs.shape[1])[None]
    attention_mask = (pos < lengths[:, None]).long()
    input_ids = seqs * attention_mask
    action_mask = ((pos >= prompt_len) & (pos < lengths[:, None])).long()
    mb = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    old_logprobs = logprobs_from_logits(model_outputs("actor", actor, mb), input_ids) * action_mask
    ref_logprobs = (
        logprobs_from_logits(model_outputs("actor", reference, mb), input_ids) * action_mask
    )
    old_values = values_from_head(model_outputs("critic", critic, mb)) * action_mask
    score = ((input_ids % 2 == 0) & action_mask.bool()).float().sum(-1) / action_mask.sum(-1)
    rewards = kl_penalized_rewards(score, old_logprobs, ref_logprobs, action_mask, cfg.kl_coef)
    advantages, returns = gae(rewards, old_values, action_mask, gamma=1.0, lam=0.95)
    adv = advantages.float()
    mean = (adv * action_mask).sum() / action_mask.sum()
    std = (((adv - mean) * action_mask).square().sum() / action_mask.sum()).sqrt()
    print(f"rollout: {samples} samples, mean reward {score.mean():.3f}")
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "old_values": old_values,
        "advantages": ((adv - mean) / (std + 1e-8)) * action_mask,
        "returns": returns.float() * action_mask,
    }


class Experience(Dataset):
    def __init__(self, data: dict[str, torch.Tensor]):
        self.data = data

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=None, help="Hub id or local directory (default: tiny config)"
    )
    ap.add_argument("--single", action="store_true", help="train on one device, no strategy")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--ppo-epochs", type=int, default=2)
    ap.add_argument("--schedule", default=None, help="schedule JSON to run instead of planning")
    ap.add_argument(
        "--schedule-out",
        default=os.path.join(tempfile.gettempdir(), "fused_pipeline_tiny_schedule.json"),
        help="where to write the schedule the planner made from the profiling pass",
    )
    args = ap.parse_args()

    torch.manual_seed(0)
    actor, critic = build_models(args.model)
    cfg = PPOConfig(micro_batches=args.micro_batches, kl_coef=0.05, kl_mode="reward")
    data = rollout(
        actor,
        copy.deepcopy(actor).eval(),
        critic,
        samples=args.samples,
        prompt_len=6,
        max_new=12,
        cfg=cfg,
        seed=0,
    )
    module = FusedPPOModule(actor, critic, cfg, actor_lr=1e-4, critic_lr=1e-4)
    loader = DataLoader(Experience(data), batch_size=args.batch_size, shuffle=False)
    strategy = (
        "auto"
        if args.single
        else FusedPipelineStrategy(
            schedule=args.schedule,
            schedule_out=None if args.schedule else args.schedule_out,
            timeout=120,
        )
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if args.single else 2,
        strategy=strategy,
        max_epochs=args.ppo_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    print(f"trained in {time.perf_counter() - t0:.1f} s; last step: {metrics}")
    if not args.single and not args.schedule:
        print(f"schedule written to {args.schedule_out} (rerun with --schedule to reuse it)")


if __name__ == "__main__":
    main()
