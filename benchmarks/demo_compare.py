"""The README's demo figures: ``rlhf-fusion demo --compare`` (fused and ``--serial`` as
alternating pairs of the default demo), copied into ``results/demo_compare.{json,md}``,
``results/demo_compare.png`` (per-stage breakdown) and ``results/demo_timeline.png``; with
``--algo grpo``, ``rlhf-fusion demo --algo grpo --compare`` (fused and serial workers
interleaved iteration by iteration in the same processes) into
``results/demo_compare_grpo.{json,md,png}``.

    OMP_NUM_THREADS=1 python benchmarks/demo_compare.py --pairs 3
    OMP_NUM_THREADS=1 python benchmarks/demo_compare.py --algo grpo --pairs 3

Load averages are recorded before and after every run: run it on a quiet machine (load below
1 at the start) for the README.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from _harness import RESULTS_DIR, write_results

from rlhf_fusion.loop.compare import STAGES, compare


def grpo(pairs: int, iterations: int) -> None:
    from rlhf_fusion.loop.demo_grpo import compare_grpo

    with tempfile.TemporaryDirectory(prefix="demo-compare-grpo-") as tmp:
        s = compare_grpo(tmp, pairs=pairs, iterations=iterations)
        shutil.copy(Path(tmp) / "compare.png", Path(RESULTS_DIR) / "demo_compare_grpo.png")
    rows = []
    for r in s["pairs"]:
        f, se, ba = r["fused"], r["serial"], r["balanced"]
        b = r["bound"]
        rows.append([r["pair"], r["first"], f"{f['rollout_s']:.2f}", f"{ba['rollout_s']:.2f}",
                     f"{se['rollout_s']:.2f}", f"**{r['rollout_ratio']:.2f}x**",
                     "-" if b is None else f"{b:.2f}x", f"{r['static_rollout_ratio']:.2f}x",
                     f"{r['training_ratio']:.2f}x", f"{r['iteration_ratio']:.2f}x",
                     f"{f['load_before']:.1f}-{f['load_after']:.1f}"])
    write_results(
        "demo_compare_grpo",
        {**s, "command": "OMP_NUM_THREADS=1 python benchmarks/demo_compare.py "
         + " ".join(sys.argv[1:])},
        [("rlhf-fusion demo --algo grpo --compare: fused and serial interleaved",
          ["pair", "first", "fused rollout s", "serial (balanced scoring) rollout s",
           "serial (static split) rollout s", "rollout serial/fused", "simulator's bound",
           "static split/fused", "training (same work)", "iteration", "load (1 min)"], rows)],
        notes=[f"median rollout serial/fused {s['median_rollout_ratio']:.2f}x against the "
               "serial run whose ranks balance their scoring as the fused stream does (the "
               "bar's baseline: the ratio is the overlap's), simulator's bound "
               f"{s['median_bound']:.2f}x; bar ({s['bar']}, no pair below 1.0x): "
               f"{'met' if s['bar_met'] else 'not met'}. Against the static split (each rank "
               f"scores its own samples): {s['median_static_rollout_ratio']:.2f}x. Rewards "
               "equal in every iteration of every mode."],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=None,
                    help="default: 24 (ppo), 40 (grpo), as the demo's")
    args = ap.parse_args()
    if args.algo == "grpo":
        grpo(args.pairs, args.iterations or 40)
        return
    args.iterations = args.iterations or 24
    with tempfile.TemporaryDirectory(prefix="demo-compare-") as tmp:
        s = compare(tmp, pairs=args.pairs, iterations=args.iterations)
        for src, dst in (("compare.png", "demo_compare.png"), ("timeline.png", "demo_timeline.png")):
            if (Path(tmp) / src).exists():
                shutil.copy(Path(tmp) / src, Path(RESULTS_DIR) / dst)
    rows = []
    for r in s["rows"]:
        f, se = r["fused"], r["serial"]
        rows.append([r["pair"], r["first"], f"{f['iteration_s']:.1f}", f"{se['iteration_s']:.1f}",
                     f"**{r['ratio']:.2f}x**",
                     " / ".join(f"{f['stages'][k]:.1f} vs {se['stages'][k]:.1f}"
                                for k, _ in STAGES[1:4:2]),
                     f"{f['planning_s']:.1f}",
                     f"{f['load_before'][0]:.2f}-{max(f['load_after'][0], se['load_after'][0]):.2f}",
                     "yes"])
    write_results(
        "demo_compare",
        {**s, "command": "OMP_NUM_THREADS=1 python benchmarks/demo_compare.py " + " ".join(sys.argv[1:])},
        [("rlhf-fusion demo vs demo --serial, alternating pairs",
          ["pair", "first", "fused s", "serial s", "serial/fused",
           "generation + inference / training s (fused vs serial)", "fused set-up s",
           "load (1 min)", "rewards equal"], rows)],
        notes=[f"median serial/fused: {s['median_ratio']:.2f}x over {s['pairs']} pairs of "
               f"{s['iterations']} iterations (total iteration time; the fused run's set-up, "
               "planning the training pipeline once, is before iteration 0 and reported apart)."],
    )


if __name__ == "__main__":
    main()
