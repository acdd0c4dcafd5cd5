"""``rlhf-fusion demo --algo grpo``: GRPO on a task with a checkable answer, 2 CPU processes.

A tiny Llama-style Actor (no Critic) learns small arithmetic (:mod:`.arithmetic`): prompts
``a+b=`` / ``a-b=``, 8 samples each, rewarded by two TRL-style functions named by import path,
correctness (1.0) and a bare-number format (0.2). The KL to the Ref is a loss term (verl's
``use_kl_loss``, k3) whose coefficient an adaptive controller steers towards a per-token target,
so the policy earns its reward without running away from its reference. Generation + Ref and
reward scoring run with inter-stage fusion (``--serial``: without). Writes ``metrics.jsonl``,
``reward.png`` and ``summary.json``; prints the reward and the share of correct answers.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .algorithm_config import AlgorithmConfig
from .arithmetic import arithmetic_prompts, correct
from .config import FusionLoopConfig, GenerationConfig, ModelsConfig, PPOLoopConfig, RLHFConfig
from .tokenizers import ArithmeticTokenizer

REWARDS = {"functions": [
    {"function": "rlhf_fusion.loop.arithmetic:correctness_reward", "weight": 1.0},
    {"function": "rlhf_fusion.loop.arithmetic:format_reward", "weight": 0.2}]}


def grpo_demo_config(*, iterations: int = 40, serial: bool = False, world_size: int = 2
                     ) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 64},
                            tokenizer="arithmetic", reward=REWARDS, seed=0),
        generation=GenerationConfig(prompts_per_iteration=16, max_new_tokens=32, seed=0,
                                    bs_max=128),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=2, micro_batches=2,
                          learning_rate=1e-3),
        fusion=FusionLoopConfig.off() if serial else FusionLoopConfig(
            inter=True, intra=False, rt=0.25, mechanism="kv"),
        algorithm=AlgorithmConfig(name="grpo", n=8, use_kl_loss=True, kl_loss_coef=0.05,
                                  kl_loss_type="low_var_kl", kl_ctrl="adaptive",
                                  target_kl=0.05, kl_horizon=500),
        world_size=world_size, iterations=iterations)


def correct_share(history_row: dict[str, Any], exps: list[tuple[int, Any, float]],
                  prompts: list[str], prompts_per_iteration: int, n: int) -> float:
    """The share of the iteration's completions that start with the right answer."""
    tok = ArithmeticTokenizer()
    start = (history_row["iteration"] * prompts_per_iteration) % len(prompts)
    return statistics.fmean(correct(prompts[(start + sid // n) % len(prompts)], tok.decode(ids))
                            for sid, ids, _ in exps)


def run_grpo_demo(out_dir: str | Path = "rlhf-fusion-demo-grpo", *, iterations: int = 40,
                  serial: bool = False) -> dict[str, Any]:
    from .plot import reward_png

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = grpo_demo_config(iterations=iterations, serial=serial)
    a, g = cfg.algorithm, cfg.generation
    mode = "serial" if serial else "fused: inter-stage (Ref + reward scored while the tail decodes)"
    print(f"rlhf-fusion demo --algo grpo: arithmetic, a tiny Llama actor and no critic, "
          f"{cfg.world_size} CPU processes, {g.prompts_per_iteration} prompts x {a.n} samples "
          f"per iteration, {mode}")
    prompts = arithmetic_prompts()
    res = _train(cfg, prompts, keep_experiences=True)
    hist = res["history"]
    for h, exps in zip(hist, res["experiences"], strict=True):
        h["objective/correct"] = correct_share(h, exps, prompts, g.prompts_per_iteration, a.n)
    with open(out / "metrics.jsonl", "w") as f:
        for h in hist:
            f.write(json.dumps(h) + "\n")
    reward_png(hist, out / "reward.png")
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    k = min(5, len(hist))

    def avg(key: str, rows: list[dict[str, Any]]) -> float:
        return statistics.fmean(r[key] for r in rows)

    summary = {
        "iterations": len(hist), "samples": len(hist) * g.prompts_per_iteration * a.n,
        "seconds": sum(h["time/iteration"] for h in hist),
        "reward_first": avg("objective/scores", hist[:k]),
        "reward_last": avg("objective/scores", hist[-k:]),
        "correct_first": avg("objective/correct", hist[:k]),
        "correct_last": avg("objective/correct", hist[-k:]),
        "kl_per_token_last": avg("objective/kl_per_token", hist[-k:]),
        "kl_coef_last": hist[-1]["objective/kl_coef"],
        # R_t's simulator, groups included, on each batch's own lengths and fitted timings
        "simulated_speedup_median": _median_of(hist, "fusion/simulated_speedup"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for h in hist:
        print(f"iteration {h['iteration']:3d}: reward {h['objective/scores']:.3f}, correct "
              f"{h['objective/correct']:.3f}, KL/token {h['objective/kl_per_token']:.3f} "
              f"(coef {h['objective/kl_coef']:.3f}), length {h['response_length/mean']:.1f}, "
              f"{h['time/iteration']:.2f} s")
    print(f"reward: first {k} iterations {summary['reward_first']:.3f} -> last {k} "
          f"{summary['reward_last']:.3f}; correct {summary['correct_first']:.3f} -> "
          f"{summary['correct_last']:.3f}; KL per token at the end "
          f"{summary['kl_per_token_last']:.3f} (target {a.target_kl})")
    if summary["simulated_speedup_median"] is not None:
        print(f"R_t's simulator (groups included) on these lengths and timings: generation + "
              f"scoring serial/fused {summary['simulated_speedup_median']:.2f}x (median over "
              "iterations): the ceiling of inter-stage fusion here")
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'reward.png'}, {out / 'summary.json'}")
    return summary


def _train(cfg: RLHFConfig, prompts: list[str], *, keep_experiences: bool = False
           ) -> dict[str, Any]:
    """The loop's :func:`~rlhf_fusion.loop.run.train` (no progress bar), with each iteration's
    experience as ``(sample id, tokens, reward)`` under ``experiences``."""
    from .run import train

    out = train(cfg, prompts, progress=False, keep_experiences=keep_experiences)
    out["experiences"] = [[(e.sample_id, e.response_ids, e.reward) for e in exps]
                          for exps in (out.get("experience_log") or [])]
    return out


def _median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def compare_grpo(out_dir: str | Path = "rlhf-fusion-demo-grpo", *, pairs: int = 3,
                 iterations: int = 40) -> dict[str, Any]:
    """``--algo grpo --compare``: fused and serial runs of the same workload as alternating
    pairs (the order flips each pair, so drift in the machine's load hits both); checks the
    rewards are equal in every iteration of every run and prints each pair's serial/fused
    ratio of the rollout (generation + scoring, the stage inter-stage fusion changes) and of
    the whole iteration. Raises :class:`~.compare.CompareError` when rewards differ."""
    from .compare import CompareError

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = arithmetic_prompts()
    rows, reference = [], None
    bound: float | None = None
    for pair in range(pairs):
        times: dict[str, dict[str, float]] = {}
        for serial in ((False, True) if pair % 2 == 0 else (True, False)):
            res = _train(grpo_demo_config(iterations=iterations, serial=serial), prompts)
            hist = res["history"]
            rewards = [h["objective/scores"] for h in hist]
            if reference is None:
                reference = rewards
            elif rewards != reference:
                first = next(i for i, (a, b) in enumerate(zip(rewards, reference, strict=True))
                             if a != b)
                raise CompareError(f"pair {pair}, {'serial' if serial else 'fused'}: the "
                                   f"reward of iteration {first} differs ({rewards[first]} vs "
                                   f"{reference[first]}); fused and serial must sample alike")
            if not serial:
                bound = _median_of(hist, "fusion/simulated_speedup")
            times["serial" if serial else "fused"] = {
                "rollout": sum(h["time/rollout"] for h in hist),
                "iteration": sum(h["time/iteration"] for h in hist)}
        row = {"pair": pair, **{f"{m}_{k}_s": v for m, t in times.items() for k, v in t.items()},
               "simulated_rollout_ratio": bound,
               "rollout_ratio": times["serial"]["rollout"] / times["fused"]["rollout"],
               "iteration_ratio": times["serial"]["iteration"] / times["fused"]["iteration"]}
        rows.append(row)
        sim = f" (simulator's bound {bound:.2f}x)" if bound is not None else ""
        print(f"pair {pair}: rollout serial/fused {row['rollout_ratio']:.2f}x{sim}, iteration "
              f"{row['iteration_ratio']:.2f}x")
    summary = {"pairs": rows, "rewards_equal": True,
               "median_rollout_ratio": statistics.median(r["rollout_ratio"] for r in rows),
               "median_iteration_ratio": statistics.median(r["iteration_ratio"] for r in rows)}
    (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"rewards equal in every iteration of every run; median serial/fused over {pairs} "
          f"pairs: rollout {summary['median_rollout_ratio']:.2f}x, iteration "
          f"{summary['median_iteration_ratio']:.2f}x")
    return summary
