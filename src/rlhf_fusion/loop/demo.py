"""``rlhf-fusion demo``: real PPO on tiny models, 2 CPU processes, every plugin on.

A tiny Llama-style Actor and Critic built from configs (nothing is downloaded), a character
tokenizer, the prompt set shipped in ``rlhf_fusion/loop/data/prompts.txt`` and a rule-based
reward (the fraction of vowels in the response). Response lengths have the long tail that the
model's own sampling gives them (end-of-sequence is one token among ~36). The run writes
``metrics.jsonl``, ``reward.png``, ``timeline.png`` (the last iteration, fused beside the
same iteration replayed serially) and ``summary.json`` to the output directory. The training
pipeline is planned before iteration 0 and reported apart. ``--compare`` (:mod:`.compare`)
runs fused and serial as alternating pairs.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from .algorithm_config import AlgorithmConfig
from .config import FusionLoopConfig, GenerationConfig, ModelsConfig, PPOLoopConfig, RLHFConfig


def demo_prompts() -> list[str]:
    text = resources.files("rlhf_fusion.loop").joinpath("data/prompts.txt").read_text()
    return [x for x in text.splitlines() if x.strip()]


def demo_config(*, iterations: int = 24, serial: bool = False, world_size: int = 2
                ) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 4, "hidden": 128},
                            reward="vowels", seed=0),
        generation=GenerationConfig(prompts_per_iteration=48, max_new_tokens=256, seed=0,
                                    bs_max=64),
        # TRL's default 4 PPO epochs x 1 mini-batch: training is most of an iteration, and the
        # fused Actor/Critic pipeline fills the bubbles that serial 1F1B leaves on 2 stages
        # with 2 micro-batches (each model idles a third of its step), which is where the
        # demo's gain comes from (docs/loop.md, "What the demo's gain comes from").
        ppo=PPOLoopConfig(num_ppo_epochs=4, num_mini_batches=1, micro_batches=2,
                          learning_rate=1e-3, kl_coef=0.05, gamma=1.0, lam=0.95),
        # The KL penalty's coefficient adapts (Ziegler et al.'s controller, as TRL's former
        # PPOTrainer and OpenRLHF's --kl_target) towards 0.4 nats per token (about 5 per
        # response, below TRL's default target of 6), by up to 10% per iteration of 48
        # samples. With a fixed 0.02 the policy ran away from its reference (1.25 nats per
        # token, 13.8 per response, by the last iteration). Fused and serial adapt alike:
        # their samples, hence their KL, are the same.
        algorithm=AlgorithmConfig(name="ppo", kl_ctrl="adaptive", target_kl=0.4,
                                  kl_horizon=96),
        fusion=FusionLoopConfig.off() if serial else FusionLoopConfig(rt="auto", mechanism="kv"),
        world_size=world_size,
        iterations=iterations,
    )


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_demo(out_dir: str | Path = "rlhf-fusion-demo", *, iterations: int = 24,
             serial: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train, then write the pictures and the summary; returns the summary."""
    from .plot import reward_png, timeline_png
    from .run import train

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(iterations=iterations, serial=serial)
    mode = "serial (RLHFuse-Base)" if serial else "fused: inter-stage + intra-stage"
    print(f"rlhf-fusion demo: PPO on a tiny Llama actor/critic, {cfg.world_size} CPU processes, "
          f"{cfg.generation.prompts_per_iteration} prompts/iteration, {mode}")
    # The demo owns its folder: a re-run replaces the previous demo's output.
    res = train(cfg, demo_prompts(), out_dir=out, progress=progress, overwrite=True,
                timeline_serial=not serial, keep_experiences=True)
    hist = res["history"]
    print(f"set-up before iteration 0 (not in the iterations' seconds): training pipeline "
          f"planned in {res['planning_s']:.1f} s"
          + (f", the schedule {res['schedule_speedup']:.2f}x serial 1F1B on the profiled "
             "stage times" if res.get("schedule_speedup") and not serial else ""))
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    reward_png(hist, out / "reward.png")
    # The last iteration: never the cold first one when there are more.
    runs = [("fused" if not serial else "serial", res["timelines"][-1])]
    if res.get("serial_timeline"):
        runs.append(("serial, the same iteration replayed", res["serial_timeline"]))
    timeline_png(runs, cfg.world_size, out / "timeline.png", of=len(hist))
    lengths = [len(e.response_ids) for batch in res["experience_log"] for e in batch]
    first = [h["objective/scores"] for h in hist[:3]]
    last = [h["objective/scores"] for h in hist[-3:]]
    samples = cfg.generation.prompts_per_iteration * len(hist)
    summary = {
        "iterations": len(hist), "samples": samples, "seconds": res["seconds"],
        "iteration_seconds": sum(h["time/iteration"] for h in hist),
        "planning_s": res["planning_s"],
        "samples_per_s": samples / res["seconds"],
        "reward_first3": sum(first) / len(first), "reward_last3": sum(last) / len(last),
        # the KL to the Ref summed over a response (TRL's objective/kl) and per token
        "kl_last3": sum(h["objective/kl"] for h in hist[-3:]) / len(hist[-3:]),
        "kl_per_token_last3": sum(h["objective/kl_per_token"] for h in hist[-3:])
        / len(hist[-3:]),
        "kl_coef_last": hist[-1]["objective/kl_coef"],
        "length_p50": _pct(lengths, 0.5) if lengths else None,
        "length_p99": _pct(lengths, 0.99) if lengths else None,
        "length_max": max(lengths) if lengths else None,
        "rt_history": res["rt_history"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print()
    if lengths:
        print(f"response lengths over the run: p50 {summary['length_p50']}, p99 "
              f"{summary['length_p99']} ({summary['length_p99'] / max(1, summary['length_p50']):.1f}"
              f"x the median), max {summary['length_max']}")
    print(f"reward: first 3 iterations {summary['reward_first3']:.3f} -> last 3 "
          f"{summary['reward_last3']:.3f} ({summary['reward_last3'] - summary['reward_first3']:+.3f})")
    print(f"KL to the reference, last 3 iterations: {summary['kl_last3']:.2f} per response, "
          f"{summary['kl_per_token_last3']:.3f} per token (target {cfg.algorithm.target_kl}; "
          f"the adaptive coefficient ended at {summary['kl_coef_last']:.3f})")
    print(f"{samples} samples in {res['seconds']:.1f} s: {summary['samples_per_s']:.1f} samples/s")
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'reward.png'}, {out / 'timeline.png'}, "
          f"{out / 'summary.json'}")
    return summary
