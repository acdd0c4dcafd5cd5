"""The README's demo figure: ``rlhf-fusion demo --compare`` (fused and ``--serial`` as
alternating pairs of the default demo), copied into ``results/demo_compare.{json,md}``,
``results/demo_compare.png`` (per-stage breakdown) and ``results/demo_timeline.png``.

    OMP_NUM_THREADS=1 python benchmarks/demo_compare.py --pairs 3

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=24)
    args = ap.parse_args()
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
