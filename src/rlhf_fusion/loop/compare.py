"""``rlhf-fusion demo --compare``: the demo fused and ``--serial``, as alternating pairs.

Each pair runs both modes back to back (the first pair fused first, the next serial first, and
so on), so a change in the machine's load hits both sides of a pair alike. The figure of merit
is the total iteration time (the sum of ``time/iteration``: what the progress rows show; the
one-time set-up before iteration 0 is reported beside it). Both modes must generate the same
samples, so the rewards of every iteration are compared exactly; a mismatch fails the
comparison. Writes ``compare.json`` and ``compare.png`` (the per-stage breakdown) and
``timeline.png`` (one iteration of the last fused run, beside the same iteration replayed
serially).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import RLHFFusionError
from .plot import ACCOUNTS, STAGES


class CompareError(RLHFFusionError, RuntimeError):
    """Fused and serial runs disagree on the samples they generated."""


def _digest(batch: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for e in batch:
        h.update(repr((e.sample_id, tuple(e.response_ids))).encode())
    return h.hexdigest()[:16]


def run_once(*, serial: bool, iterations: int, timeline: bool = False) -> dict[str, Any]:
    """One demo run (no files): its history, timings, samples digest and load averages."""
    from .demo import demo_config, demo_prompts
    from .run import train

    cfg = demo_config(iterations=iterations, serial=serial)
    load = os.getloadavg()
    t = time.perf_counter()
    res = train(cfg, demo_prompts(), progress=False, keep_experiences=True,
                timeline_serial=timeline and not serial)
    wall = time.perf_counter() - t
    hist = res["history"]
    return {
        "mode": "serial" if serial else "fused",
        "iteration_s": sum(h["time/iteration"] for h in hist),
        "planning_s": res.get("planning_s", 0.0),
        "wall_s": wall,
        "load_before": list(load),
        "load_after": list(os.getloadavg()),
        "rewards": [h["objective/scores"] for h in hist],
        "samples": [_digest(b) for b in res["experience_log"]],
        "rt": [h["fusion/rt"] for h in hist],
        "stages": {k: sum(h.get(k, 0.0) for h in hist) for k, _ in STAGES + ACCOUNTS},
        "per_iteration": [{k: h.get(k) for k, _ in STAGES + ACCOUNTS} | {
            "time/iteration": h["time/iteration"]} for h in hist],
        "timelines": res["timelines"] if timeline else None,
        "serial_timeline": res.get("serial_timeline") if timeline else None,
    }


def check_same_samples(fused: dict[str, Any], serial: dict[str, Any]) -> None:
    """Every iteration: the same samples (token digest) and exactly the same mean reward."""
    if len(fused["rewards"]) != len(serial["rewards"]):
        raise CompareError(f"fused ran {len(fused['rewards'])} iterations, serial "
                           f"{len(serial['rewards'])}")
    for it, (a, b, da, db) in enumerate(zip(fused["rewards"], serial["rewards"],
                                            fused["samples"], serial["samples"], strict=True)):
        if da != db or a != b:
            raise CompareError(f"iteration {it}: fused and serial generated different samples "
                               f"(reward {a!r} vs {b!r}); fusion must not change what is "
                               "trained on")


def compare(out_dir: str | Path = "rlhf-fusion-demo", *, pairs: int = 3, iterations: int = 24,
            progress: bool = True) -> dict[str, Any]:
    """Run ``pairs`` alternating fused/serial pairs; write compare.json, compare.png and
    timeline.png; return the summary (``ratios``: serial/fused total iteration time)."""
    from .plot import compare_png, timeline_png

    if pairs < 1:
        raise ValueError(f"pairs={pairs}: run at least one pair")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in range(pairs):
        order = (False, True) if p % 2 == 0 else (True, False)
        got = {}
        for serial in order:
            r = run_once(serial=serial, iterations=iterations,
                         timeline=not serial and p == pairs - 1)
            got[r["mode"]] = r
            if progress:
                print(f"pair {p + 1}/{pairs} {r['mode']:>6}: {r['iteration_s']:6.1f} s in "
                      f"iterations (+{r['planning_s']:.1f} s set-up), load "
                      f"{r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}", flush=True)
        check_same_samples(got["fused"], got["serial"])
        rows.append({"pair": p + 1, "first": "serial" if order[0] else "fused",
                     "ratio": got["serial"]["iteration_s"] / got["fused"]["iteration_s"],
                     "fused": got["fused"], "serial": got["serial"]})
    ratios = [r["ratio"] for r in rows]
    last = rows[-1]["fused"]
    summary = {
        "pairs": pairs, "iterations": iterations, "cpu_cores": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "median_ratio": statistics.median(ratios), "ratios": ratios,
        "rewards_equal": True,
        "rows": [{k: v for k, v in r.items() if k not in ("fused", "serial")}
                 | {m: {k: v for k, v in r[m].items()
                        if k not in ("timelines", "serial_timeline")}
                    for m in ("fused", "serial")} for r in rows],
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    compare_png(summary["rows"], out / "compare.png")
    if last["timelines"]:
        shown = last["timelines"][-1]
        runs = [("fused", shown)]
        if last["serial_timeline"]:
            runs.append(("serial, the same iteration replayed", last["serial_timeline"]))
        timeline_png(runs, 2, out / "timeline.png", of=iterations)
    print()
    print("pair  first   fused s  serial s  serial/fused")
    for r in rows:
        print(f"{r['pair']:>4}  {r['first']:<6}  {r['fused']['iteration_s']:7.1f}  "
              f"{r['serial']['iteration_s']:8.1f}  {r['ratio']:11.2f}x")
    print(f"median serial/fused over {pairs} pairs: {summary['median_ratio']:.2f}x "
          f"(every pair: {', '.join(f'{x:.2f}x' for x in ratios)}); rewards equal in every "
          f"iteration of every pair")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.png'}, {out / 'timeline.png'}")
    return summary
