"""RLHFuse Table 3: fused schedules for the paper's 12 settings, beside the paper's numbers.

    python benchmarks/table3.py [--time-limit 60] [--anneal-time 15] [--only table3-02,...]

Reads the settings from benchmarks/reference/table3.json; writes benchmarks/results/table3.json
and benchmarks/results/table3.md. For every setting:
serial 1F1B, greedy, our annealer (the paper's algorithm, on this machine's cores), our
`auto` solver (greedy + anneal + CP-SAT + memory pass), the lower bound, peak activation
memory relative to serial 1F1B, and the CPU seconds spent; beside them the paper's Table 3
("Ours") and the authors' published search results (FlexFusion, 512+ CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import cpu_model  # noqa: E402

from rlhf_fusion.schedule import Problem, solve  # noqa: E402

HERE = Path(__file__).resolve().parent
# The paper's 12 settings and its figures (source named inside the file).
REFERENCE = HERE / "reference" / "table3.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per setting (auto)")
    ap.add_argument("--anneal-time", type=float, default=15.0, help="seconds per setting (anneal)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated instance ids")
    ap.add_argument("--out", default=str(HERE / "results" / "table3"))
    args = ap.parse_args()

    instances = json.loads(REFERENCE.read_text())["instances"]
    if args.only:
        keep = set(args.only.split(","))
        instances = [i for i in instances if i["id"] in keep]
    rows = []
    for inst in instances:
        problem = Problem.from_dict(inst["problem"])
        ref = inst["reference"]
        t = time.perf_counter()
        ours = solve(problem, "auto", time_limit=args.time_limit, workers=args.workers)
        wall = time.perf_counter() - t
        ann = solve(problem, "anneal", time_limit=args.anneal_time, workers=args.workers)
        serial = ours.baselines["serial_1f1b"]
        row = {
            "id": inst["id"],
            "name": problem.name,
            "serial_1f1b": serial["makespan"],
            "greedy": ours.baselines["greedy"]["makespan"],
            "lower_bound": ours.lower_bound,
            "ours": {
                "makespan": ours.makespan,
                "speedup": round(ours.speedup(), 4),
                "reaches_bound": ours.makespan <= ours.lower_bound,
                "peak_ratio": round(ours.peak_ratio(), 4),
                "wall_seconds": round(wall, 1),
                "cpu_seconds": round(wall * args.workers, 1),
                "phases": ours.stats.get("phases", []),
                # Every CP-SAT attempt of the search, for reading why a setting came out as it did.
                "at_bound_attempts": ours.stats.get("cpsat_at_bound", []),
                "memory_pass": ours.stats.get("memory_pass", {}).get("rungs", []),
            },
            "anneal": {
                "makespan": ann.makespan,
                "speedup": round(ann.speedup(), 4),
                "peak_ratio": round(ann.peak_ratio(), 4),
                "wall_seconds": round(ann.seconds, 1),
            },
            "paper": ref["paper_table3"],
            "flexfusion": ref["flexfusion"],
        }
        rows.append(row)
        print(
            f"{row['id']} {problem.name:<24} serial {serial['makespan']:>5g} "
            f"greedy {row['greedy']:>5g} anneal {ann.makespan:>5g} ours {ours.makespan:>5g} "
            f"bound {ours.lower_bound:>5g}  peak {ours.peak_ratio():.2f}x "
            f"(paper {ref['paper_table3']['peak_ratio_ours']:.2f}x)  {wall:.1f}s",
            flush=True,
        )

    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    result = {
        "benchmark": "table3",
        "machine": machine,
        "time_limit_s": args.time_limit,
        "anneal_time_s": args.anneal_time,
        "workers": args.workers,
        "rows": rows,
        "summary": {
            "bound_reached": sum(r["ours"]["reaches_bound"] for r in rows),
            "settings": len(rows),
            "max_wall_seconds": max(r["ours"]["wall_seconds"] for r in rows),
            "peak_at_or_below_paper": sum(
                round(r["ours"]["peak_ratio"], 2) <= r["paper"]["peak_ratio_ours"] for r in rows
            ),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")

    lines = [
        f"Table 3 settings on {machine}; `auto` limited to {args.time_limit:g} s per setting, "
        f"annealer to {args.anneal_time:g} s. Speedups are against serial 1F1B; peak is peak "
        "activation memory / serial 1F1B's.",
        "",
        "| setting | serial | greedy | anneal (ours) | **auto (ours)** | bound | speedup ours / paper | "
        "peak ours / paper / FlexFusion | seconds ours / FlexFusion (512+ CPUs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o, p, f = r["ours"], r["paper"], r["flexfusion"]
        mark = "" if o["reaches_bound"] else " (above bound)"
        lines.append(
            f"| {r['name']} | {r['serial_1f1b']:g} | {r['greedy']:g} | {r['anneal']['makespan']:g} | "
            f"**{o['makespan']:g}**{mark} | {r['lower_bound']:g} | {o['speedup']:.2f} / {p['speedup_ours']:.2f} | "
            f"{o['peak_ratio']:.2f} / {p['peak_ratio_ours']:.2f} / {f['peak_activation_ratio']:.2f} | "
            f"{o['wall_seconds']:.0f} / {f['search_wall_seconds']} |"
        )
    s = result["summary"]
    lines += [
        "",
        f"Lower bound reached on {s['bound_reached']} of {s['settings']} settings "
        f"(paper: 11 of 12), each in at most {s['max_wall_seconds']:.0f} s; peak memory at or below "
        f"the paper's on {s['peak_at_or_below_paper']} of {s['settings']}.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
