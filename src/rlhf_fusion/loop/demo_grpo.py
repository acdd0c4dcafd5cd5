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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .algorithm_config import AlgorithmConfig
from .arithmetic import arithmetic_prompts, correct
from .config import FusionLoopConfig, GenerationConfig, ModelsConfig, PPOLoopConfig, RLHFConfig
from .tokenizers import ArithmeticTokenizer

REWARDS = {"functions": [
    {"function": "rlhf_fusion.loop.arithmetic:correctness_reward", "weight": 1.0},
    {"function": "rlhf_fusion.loop.arithmetic:format_reward", "weight": 0.2}]}


def grpo_demo_config(*, iterations: int = 40, serial: bool = False, world_size: int = 2,
                     balance_scoring: bool = False) -> RLHFConfig:
    """The demo's run; ``serial``: no fusion, each rank scoring its own samples after
    generation, or with ``balance_scoring`` the ranks' scoring balanced through the stream
    (the baseline that differs from the fused run by the overlap alone)."""
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 64},
                            tokenizer="arithmetic", reward=REWARDS, seed=0),
        generation=GenerationConfig(prompts_per_iteration=16, max_new_tokens=32, seed=0,
                                    bs_max=128),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=2, micro_batches=2,
                          learning_rate=1e-3),
        fusion=FusionLoopConfig(inter=False, intra=False, balance_scoring=balance_scoring)
        if serial else FusionLoopConfig(
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


# Rank-seconds, summed over the ranks, where the worker reports them (PPOWorker's accounts):
# decode steps and scoring calls (wall, and the thread CPU they used) and the rest of the
# rollout (waiting for a peer, the migration, the stream).
ACCOUNT_KEYS = ("time/decode", "time/decode_cpu", "time/scoring", "time/scoring_cpu",
                "time/rollout_idle")
BAR_MEDIAN = 1.15      # issue 37: median serial/fused at least this ...
# ... or, when the simulator's bound is below it, 90% of the bound's *gain*: a bound of 1.10x
# asks for 1.09x. (90% of the ratio itself, 0.99x, would pass a run that gains nothing.)
BAR_OF_BOUND = 0.90
CONTROL_DRIFT = 0.10   # training is the same work in both modes: a larger ratio is load drift
# Iterations left out of --compare's times: a process's first rollout pays its one-off costs
# (thread pools, the allocator's first blocks, lazy imports), and in an interleaved pair the
# mode that runs first pays them. Measured: 0.30-1.02 s against 0.10-0.17 s for the other
# mode on a fresh 16-core VM, against rollouts of 0.04-0.06 s later on: up to a third of a
# run's summed rollout, which decided the pair's ratio by its order alone.
WARMUP_ITERATIONS = 1
ABOVE_BOUND = 1.10     # a measured rollout ratio this far above the bound is not fusion's alone


def run_times(hist: Sequence[Mapping[str, Any]], warmup: int = 0) -> dict[str, Any]:
    """One run's stage seconds (summed over iterations and per iteration) and the simulator's
    bound for it: each iteration's bound weighted by its fused rollout time, so it compares
    with the ratio of the summed rollouts (an iteration with no bound, R_t = 0, counts 1.0).
    The first ``warmup`` iterations are listed per iteration but left out of the sums."""
    def train_s(h: Mapping[str, Any]) -> float:
        return float(h["time/training"])

    roll_all = [float(h["time/rollout"]) for h in hist]
    timed = list(hist[warmup:])
    roll = roll_all[warmup:]
    out: dict[str, Any] = {
        "rollout_s": sum(roll), "train_s": sum(train_s(h) for h in timed),
        "iteration_s": sum(float(h["time/iteration"]) for h in timed),
        "warmup": warmup, "warmup_rollout_s": sum(roll_all[:warmup]),
        "per_iteration": [{"rollout": r, "train": train_s(h),
                           "bound": h.get("fusion/simulated_speedup")}
                          for r, h in zip(roll_all, hist, strict=True)],
        "accounts": {k: sum(float(h[k]) for h in timed) for k in ACCOUNT_KEYS
                     if all(k in h for h in timed)},
    }
    bounds = [h.get("fusion/simulated_speedup") for h in timed]
    if any(b is not None for b in bounds) and sum(roll) > 0:
        out["bound"] = sum(r * (b if b is not None else 1.0)
                           for r, b in zip(roll, bounds, strict=True)) / sum(roll)
    return out


def pair_row(pair: int, first: str, fused: dict[str, Any], serial: dict[str, Any],
             balanced: dict[str, Any] | None = None) -> dict[str, Any]:
    """One pair's serial/fused ratios; ``training_ratio`` is the load control (the same work
    in both modes: far from 1.0, the machine's load changed between the two runs).

    With ``balanced`` (the serial run whose ranks balance their scoring through the stream)
    the ratios are against it, the bar's baseline: a fused rollout's stream also evens out
    ranks that score at unequal speeds, a gain beside the overlap that the static split
    (``serial``; its ratios as ``static_*``) would credit to fusion."""
    bound = fused.get("bound")
    base = balanced if balanced is not None else serial
    rollout = base["rollout_s"] / fused["rollout_s"]
    row = {"pair": pair, "first": first, "fused": fused, "serial": serial,
           "baseline": "balanced" if balanced is not None else "serial",
           "rollout_ratio": rollout,
           "training_ratio": base["train_s"] / fused["train_s"],
           "iteration_ratio": base["iteration_s"] / fused["iteration_s"],
           "bound": bound,
           # the share of the bound's gain the measured rollout reached
           "gain_of_bound": (rollout - 1) / (bound - 1) if bound and bound > 1 else None}
    if balanced is not None:
        row.update(balanced=balanced,
                   static_rollout_ratio=serial["rollout_s"] / fused["rollout_s"],
                   static_iteration_ratio=serial["iteration_s"] / fused["iteration_s"])
    return row


def bar_need(bound: float) -> float | None:
    """The median rollout ratio issue 37's bar asks for when the simulator's bound is below
    BAR_MEDIAN (90% of the bound's gain); None when the plain BAR_MEDIAN bar applies."""
    return 1 + BAR_OF_BOUND * (bound - 1) if bound < BAR_MEDIAN else None


def verdict(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The bar of issue 37 on these pairs (rewards equal is checked while running)."""
    ratios = [r["iteration_ratio"] for r in rows]
    rollouts = [r["rollout_ratio"] for r in rows]
    bounds = [r["bound"] for r in rows if r["bound"] is not None]
    bound = statistics.median(bounds) if bounds else None
    med_roll = statistics.median(rollouts)
    drift = [r["pair"] for r in rows if abs(r["training_ratio"] - 1) > CONTROL_DRIFT]
    out = {"median_iteration_ratio": statistics.median(ratios),
           "median_rollout_ratio": med_roll, "median_bound": bound,
           "min_rollout_ratio": min(rollouts), "min_iteration_ratio": min(ratios),
           "no_pair_below_1": min(rollouts) >= 1.0 and min(ratios) >= 1.0,
           "pairs_with_load_drift": drift,
           # above the simulator's ceiling: something other than the overlap made serial slower
           # (on an oversubscribed CPU, the scheduler: see wait_per_cpu_s)
           "above_bound": bound is not None and med_roll > ABOVE_BOUND * bound}
    need = bar_need(bound) if bound is not None else None
    if need is not None:
        out["bar"] = (f"bound {bound:.2f}x < {BAR_MEDIAN}x: rollout gains >= "
                      f"{BAR_OF_BOUND:.0%} of what the bound allows, >= {need:.3f}x")
        out["bar_met"] = out["no_pair_below_1"] and med_roll >= need
    else:
        out["bar"] = f"median serial/fused >= {BAR_MEDIAN}x"
        out["bar_met"] = out["no_pair_below_1"] and out["median_iteration_ratio"] >= BAR_MEDIAN
    return out


def wait_per_cpu(t: Mapping[str, Any]) -> dict[str, float]:
    """Wall over thread-CPU seconds of the decode steps and of the scoring calls, where the
    worker reports them: 1.0 ran on a core throughout; above it, the thread waited for one
    (an oversubscribed machine)."""
    a = t.get("accounts", {})
    return {stage: a[f"time/{stage}"] / a[f"time/{stage}_cpu"] for stage in ("decode", "scoring")
            if a.get(f"time/{stage}_cpu")}


def _breakdown_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    head = "pair  mode      first     rollout s  training s  iteration s"
    acc = [k for k in ACCOUNT_KEYS if all(k in r[m]["accounts"] for r in rows
                                          for m in ("fused", "serial", "balanced") if m in r)]
    head += "".join(f"  {k.removeprefix('time/'):>12}" for k in acc)
    lines = [head]
    for r in rows:
        for m in [m for m in ("fused", "serial", "balanced") if m in r]:
            t = r[m]
            lines.append(f"{r['pair']:>4}  {m:<8}  {r['first']:<8}  {t['rollout_s']:9.2f}  "
                         f"{t['train_s']:10.2f}  {t['iteration_s']:11.2f}"
                         + "".join(f"  {t['accounts'][k]:12.2f}" for k in acc))
    return lines


def interleaved_rank(rank: int, world: int, cfgs: dict[str, RLHFConfig],
                     prompt_ids: list[list[int]], first: str) -> dict[str, list[dict[str, Any]]]:
    """One rank of an interleaved comparison: a worker per mode on this rank, built from the
    same seed, running the same prompts iteration by iteration, the order of the modes
    rotating (``first`` first at iteration 0; two modes alternate). Every mode sees the
    machine's load within a second of the others, so a ratio of their times is not the load's
    drift between two runs."""
    import torch

    from .iteration import PPOWorker
    from .run import prompts_for

    workers = {}
    for mode, cfg in cfgs.items():
        torch.manual_seed(cfg.models.seed)
        workers[mode] = PPOWorker(cfg)
    modes = list(cfgs)
    start = modes.index(first)
    hist: dict[str, list[dict[str, Any]]] = {m: [] for m in cfgs}
    ppi = cfgs["fused"].generation.prompts_per_iteration
    for it in range(cfgs["fused"].iterations):
        prompts = prompts_for(prompt_ids, it, ppi)
        k = (start + it) % len(modes)
        for mode in modes[k:] + modes[:k]:
            hist[mode].append({"iteration": it, **workers[mode].iteration(prompts).metrics})
    for w in workers.values():
        w.close()
    return hist


def compare_grpo(out_dir: str | Path = "rlhf-fusion-demo-grpo", *, pairs: int = 3,
                 iterations: int = 40) -> dict[str, Any]:
    """``--algo grpo --compare``: fused and serial runs of the same workload, *interleaved*:
    each pair is one launch of the ranks that holds three workers per rank, fused, serial
    (the static split: each rank scores its own samples) and serial with balanced scoring
    (the ranks' scoring evened out through the stream, as the fused rollout's is), and runs
    them on the same prompts, iteration by iteration, their order rotating (and the first
    mode rotating between pairs). Checks the rewards are equal in every iteration of every
    run. Per pair it prints the balanced serial/fused ratio of the rollout (generation + Ref
    and reward scoring: what inter-stage fusion's overlap changes) beside R_t's simulator bound
    for the run's own lengths and timings, the same ratio against the static split, the
    training ratio (the same work in every mode: the load control) and the whole iteration's,
    then the per-stage seconds and the bar of issue 37. Writes ``compare.json`` and
    ``compare.png``. Raises :class:`~.compare.CompareError` when rewards differ.

    Interleaved, not separate runs: on a shared or oversubscribed machine the load moves by
    tens of percent between two runs, more than the few percent inter-stage fusion gains on
    this workload (``benchmarks/results/grpo_demo_compare_analysis.md``). The times leave out
    iteration 0 (``WARMUP_ITERATIONS``, printed apart): the mode that runs it first pays the
    processes' one-off costs."""
    import os

    from ..launch import run_ranks
    from .compare import CompareError
    from .models import load_tokenizer
    from .plot import grpo_compare_png

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = arithmetic_prompts()
    cfgs = {"fused": grpo_demo_config(iterations=iterations, serial=False),
            "serial": grpo_demo_config(iterations=iterations, serial=True),
            "balanced": grpo_demo_config(iterations=iterations, serial=True,
                                         balance_scoring=True)}
    modes = list(cfgs)
    tok = load_tokenizer(cfgs["fused"].models)
    prompt_ids = [tok.encode(x) for x in prompts]
    rows: list[dict[str, Any]] = []
    reference = None
    warmup = min(WARMUP_ITERATIONS, iterations - 1)
    for pair in range(pairs):
        first = modes[pair % len(modes)]
        load = os.getloadavg()[0]
        ranks = run_ranks(interleaved_rank, cfgs["fused"].world_size, cfgs, prompt_ids, first,
                          collective_timeout=300, timeout=3600)
        hists = next(r.value for r in ranks if r.rank == 0)
        got: dict[str, dict[str, Any]] = {}
        for mode in modes:
            hist = hists[mode]
            rewards = [h["objective/scores"] for h in hist]
            if reference is None:
                reference = rewards
            elif rewards != reference:
                i = next(i for i, (a, b) in enumerate(zip(rewards, reference, strict=True))
                         if a != b)
                raise CompareError(f"pair {pair}, {mode}: the reward of iteration {i} "
                                   f"differs ({rewards[i]} vs {reference[i]}); fused "
                                   "and serial runs must sample alike")
            got[mode] = run_times(hist, warmup) | {"load_before": load,
                                            "load_after": os.getloadavg()[0]}
        row = pair_row(pair, first, got["fused"], got["serial"], got["balanced"])
        rows.append(row)
        b = row["bound"]
        g = row["gain_of_bound"]
        sim = (f" (simulator's bound {b:.2f}x" + (
            ")" if g is None else ": below 1.0x)" if g < 0 else ": above it)" if g > 1.5
            else f": {g:.0%} of its gain)")) if b is not None else " (no bound reported)"
        drift = ("  <- the load moved even within the pair"
                 if abs(row["training_ratio"] - 1) > CONTROL_DRIFT else "")
        print(f"pair {pair}: rollout serial/fused {row['rollout_ratio']:.2f}x{sim}, against "
              f"the static split {row['static_rollout_ratio']:.2f}x; training (same work) "
              f"{row['training_ratio']:.2f}x; iteration {row['iteration_ratio']:.2f}x; load "
              f"{load:.1f} -> {got['fused']['load_after']:.1f}{drift}", flush=True)
    v = verdict(rows)
    summary = {"pairs": rows, "rewards_equal": True, "iterations": iterations,
               "cpu_cores": os.cpu_count(), "baseline": "balanced",
               "median_static_rollout_ratio": statistics.median(
                   r["static_rollout_ratio"] for r in rows), **v}
    (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    grpo_compare_png(rows, out / "compare.png")
    print()
    print("\n".join(_breakdown_lines(rows)))
    if warmup:
        print(f"times over iterations {warmup}-{iterations - 1}; iteration 0 (warm-up: the mode "
              "that runs first pays the processes' one-off costs) took " + ", ".join(
                  f"pair {r['pair']}: " + ", ".join(f"{m} {r[m]['warmup_rollout_s']:.2f} s"
                                                     for m in modes) for r in rows))
    bound = v["median_bound"]
    static = statistics.median(r["static_rollout_ratio"] for r in rows)
    print(f"rewards equal in every iteration of every run; median serial/fused over {pairs} "
          f"pairs: rollout {v['median_rollout_ratio']:.2f}x"
          + (f" (simulator's bound {bound:.2f}x)" if bound is not None else "")
          + f", iteration {v['median_iteration_ratio']:.2f}x; serial: the ranks balance "
          f"their scoring as the fused stream does, so the ratio is the overlap's; against the "
          f"static split (each rank its own samples, as verl and OpenRLHF score) the rollout "
          f"ratio is {static:.2f}x")
    waits = {m: wait_per_cpu(rows[-1][m]) for m in modes}
    if all(waits.values()):
        print("wall / CPU seconds (last pair; 1.0: never waited for a core): " + "; ".join(
            f"{m} decode {w['decode']:.1f}, scoring {w['scoring']:.1f}"
            for m, w in waits.items() if "decode" in w and "scoring" in w))
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if v["above_bound"]:
        print(f"the measured rollout ratio is above the simulator's bound: the overlap of "
              f"scoring with the tail cannot give more than the bound, so the rest is the "
              f"machine's, not fusion's: on an oversubscribed CPU (load {load:.1f} on {cores} "
              "cores now) the serial path's long scoring burst waits longer for a core than "
              "the fused stream's short calls")
    print(f"bar ({v['bar']}, no pair below 1.0x): {'met' if v['bar_met'] else 'NOT met'}"
          + (f"; training ratio off 1.0 by more than {CONTROL_DRIFT:.0%} in pair(s) "
             f"{v['pairs_with_load_drift']}: the machine's load moved, those ratios are not "
             "fusion's alone" if v["pairs_with_load_drift"] else ""))
    print(f"wrote {out / 'compare.json'}, {out / 'compare.png'}")
    return summary
