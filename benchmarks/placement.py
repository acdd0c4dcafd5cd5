"""Placement and plan search: estimates only (nothing here runs a plan).

1. Small clusters: the Metropolis-Hastings search against exhaustive enumeration (time to the
   enumerated optimum).
2. ReaLHF's 7B Actor + 70B Critic setting on 8 x 8 A100-80GB: the searched plan (ReaLHF
   Table 6 style), its estimated iteration time beside the co-located heuristic and the four
   presets, on one core within 2 minutes; again with our fused simulators in the estimate
   (long-tailed lengths through the R_t simulator, fused Actor/Critic pipelines).
3. FlexRLHF trends: co-located vs interleaved vs interleaved2 vs disaggregated for small models
   on one node and 33B/65B Actors on 4 x 8, side by side with the paper's numbers from
   ``benchmarks/reference/flexrlhf.json`` (printed as unknown where that file has none).

Every time is the estimator's (``rlhf_fusion.placement``: analytic costs from A100 datasheet
figures and assumed efficiencies, Algorithm 1 over two iterations); batch and lengths are our
choice, not the papers'.

    OMP_NUM_THREADS=1 python benchmarks/placement.py          # ~6 min; --quick: ~1 min
    OMP_NUM_THREADS=1 python benchmarks/placement.py --only flexrlhf   # one section, the rest
                                                                       # kept from the last run
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

from rlhf_fusion.placement import (
    PRESET_NAMES,
    Estimator,
    PlacementError,
    PlacementProblem,
    enumerate_best,
    preset_plan,
    search,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REFERENCE = HERE / "reference"


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def small_clusters(budget: float) -> list[dict]:
    out = []
    for models in ({"actor": "1b", "critic": "1b"}, {"actor": "1b", "critic": "3b"}):
        p = PlacementProblem.from_dict({"models": models, "cluster": {"nodes": 1, "gpus_per_node": 2},
                                        "batch": 64, "prompt_len": 256, "gen_len": 256})
        t0 = time.perf_counter()
        _, best, n = enumerate_best(p)
        t_enum = time.perf_counter() - t0
        r = search(p, time_limit=budget, seed=0)
        hit = next((t for t, c in r.history if c <= best.cost * (1 + 1e-9)), None)
        out.append({"models": models, "cluster": "1x2 a100-80g", "plans": n,
                    "enumerated_optimum_s": best.cost, "enumeration_seconds": t_enum,
                    "search_best_s": r.estimate.cost, "search_seconds": r.seconds,
                    "search_time_to_optimum_s": hit, "found_optimum": hit is not None})
    return out


def realhf(time_limit: float, fusion: bool) -> dict:
    ref = json.loads((REFERENCE / "realhf.json").read_text())["setting_used_here"]
    cfg = {"models": {k: ref[k] for k in ("actor", "critic", "ref", "reward")},
           "cluster": ref["cluster"], "batch": ref["batch"], "prompt_len": ref["prompt_len"],
           "gen_len": ref["gen_len"], "ppo_minibatches": ref["ppo_minibatches"],
           "name": "ReaLHF 7B Actor + 70B Critic, 8x8 A100-80GB"}
    if fusion:
        cfg["fusion"] = {"rollout": True, "train": True}
        cfg["lengths"] = {"median": 256, "sigma": 1.0}
        cfg["name"] += ", fused simulators, lognormal lengths (median 256, max 1024)"
    p = PlacementProblem.from_dict(cfg)
    t0 = time.perf_counter()
    r = search(p, time_limit=time_limit, seed=0)
    wall = time.perf_counter() - t0
    return {"name": p.name, "config": cfg, "search_seconds": wall, "steps": r.steps,
            "estimates": r.evaluations, "candidates_per_call": r.space,
            "heuristic_s": r.heuristic_estimate.iteration_time,
            "heuristic_strategy": str(r.heuristic.calls["actor_train"].strategy),
            "searched_s": r.estimate.iteration_time, "searched_oom": r.estimate.oom,
            "greedy_start_s": r.greedy_cost, "gain": r.gain, "speedup": r.speedup,
            "presets_s": {k: v.iteration_time for k, v in r.presets.items()},
            "presets_oom": {k: v.oom for k, v in r.presets.items()},
            "table": r.plan.table(), "plan": r.plan.to_dict(),
            "call_time_s": r.estimate.call_time, "realloc_time_s": r.estimate.realloc_time,
            "history": r.history}


FLEX_SETTINGS = [
    ("small", "1.3b", "0.35b", 1), ("small", "llama-7b", "1.3b", 1),
    ("small", "llama-13b", "llama-7b", 1),
    ("large", "llama-33b", "llama-7b", 4), ("large", "llama-65b", "llama-7b", 4),
]


SECTIONS = ("small_clusters", "realhf", "flexrlhf")


def flexrlhf(search_s: float) -> list[dict]:
    """Each setting under both parallelisms: Megatron-style strategies, and ZeRO-3 with the
    hybrid engine (DeepSpeed-Chat, the system FlexRLHF's strategies are measured on)."""
    ref = json.loads((REFERENCE / "flexrlhf.json").read_text())
    rows = []
    for (kind, actor, critic, nodes), parallelism in itertools.product(
            FLEX_SETTINGS, ("megatron", "zero3")):
        p = PlacementProblem.from_dict({
            "models": {"actor": actor, "critic": critic},
            "cluster": {"nodes": nodes, "gpus_per_node": 8, "hardware": "a100-80g"},
            "batch": 256, "prompt_len": 256, "gen_len": 256, "parallelism": parallelism})
        est = Estimator(p)
        row = {"kind": kind, "actor": actor, "critic": critic, "cluster": f"{nodes}x8 a100-80g",
               "parallelism": parallelism, "estimated_s": {}, "oom": {}, "paper": None}
        for name in PRESET_NAMES:
            try:
                e = est.estimate(preset_plan(p, name, estimator=est))
            except PlacementError as exc:
                row["estimated_s"][name] = None
                row["oom"][name] = str(exc)
                continue
            row["estimated_s"][name] = e.iteration_time
            row["oom"][name] = e.oom
        found = search(p, time_limit=search_s, seed=0, estimator=est)
        e = est.estimate(found.plan)
        row["estimated_s"]["searched"], row["oom"]["searched"] = e.iteration_time, e.oom
        co = row["estimated_s"]["colocated"]
        row["speedup_vs_colocated"] = {k: (co / v if v else None)
                                       for k, v in row["estimated_s"].items()}
        row["paper"] = (ref.get("tables") or {}).get(f"{actor}/{critic}")
        rows.append(row)
    return rows


def plot_flexrlhf(rows: list[dict], path: Path) -> None:
    """Speedup of each placement over co-located, per setting, one panel per parallelism;
    plans that do not fit are hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    kinds = ("interleaved", "interleaved2", "disaggregated", "searched")
    colors = ("#8172B3", "#CCB974", "#64B5CD", "#C44E52")
    pars = ("megatron", "zero3")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, par in zip(axes, pars):
        sel = [r for r in rows if r["parallelism"] == par]
        width = 0.8 / len(kinds)
        for i, (k, c) in enumerate(zip(kinds, colors)):
            for j, r in enumerate(sel):
                v = r["speedup_vs_colocated"].get(k)
                if v is None:
                    continue
                ax.bar(j + (i - 1.5) * width, v, width, color=c,
                       hatch="//" if r["oom"].get(k) is True else None, edgecolor="black",
                       linewidth=0.4, label=k if j == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([f"{r['actor']}/{r['critic']}\n{r['cluster'].split()[0]}"
                            for r in sel], fontsize=8)
        ax.set_yscale("log")
        ax.set_yticks([0.25, 0.5, 1, 2, 4])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{par}: estimated speedup over co-located (hatched: out of memory)",
                     fontsize=9)
    axes[0].set_ylabel("x co-located (log)")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    L = ["# Placement and plan search (estimates)", "",
         f"{res['date']}, {res['machine']['cpu']}, one core (`OMP_NUM_THREADS=1`). "
         "Every time below is the planner's estimate, not a measurement: analytic costs from "
         "datasheet figures and assumed efficiencies (`docs/placement.md`). Batch and lengths "
         "are our choice. Command: `" + res["command"] + "`.", "",
         "## Search vs enumeration (small clusters)", "",
         "| models | cluster | plans | optimum (s) | enumeration (s) | search best (s) | time to optimum (s) |",
         "|---|---|---|---|---|---|---|"]
    for r in res["small_clusters"]:
        t = r["search_time_to_optimum_s"]
        L.append(f"| {r['models']['actor']}/{r['models']['critic']} | {r['cluster']} | {r['plans']} | "
                 f"{r['enumerated_optimum_s']:.3f} | {r['enumeration_seconds']:.1f} | "
                 f"{r['search_best_s']:.3f} | {'not reached' if t is None else f'{t:.2f}'} |")
    for r in res["realhf"]:
        L += ["", f"## {r['name']}", "",
              f"Search: {r['search_seconds']:.0f} s on one core, {r['steps']} steps, "
              f"{r['estimates']} estimates; candidates per call {r['candidates_per_call']}.", "",
              "```", r["table"], "```", "",
              "| plan | estimated s/iteration |", "|---|---|",
              f"| co-located heuristic {r['heuristic_strategy']} | {r['heuristic_s']:.1f} |"]
        for k, v in r["presets_s"].items():
            L.append(f"| preset {k} | {v:.1f}{' (OOM)' if r['presets_oom'][k] else ''} |")
        L.append(f"| greedy start | {r['greedy_start_s']:.1f} |")
        L.append(f"| **searched** | **{r['searched_s']:.1f}**{' (OOM)' if r['searched_oom'] else ''} |")
        L += ["", f"Estimated gain over the co-located heuristic: **{100 * r['gain']:.1f}%** "
              f"({r['speedup']:.2f}x). ReaLHF reports 26% on average over its Megatron-LM "
              "heuristic (v1 abstract; `benchmarks/reference/realhf.json`)."]
    L += ["", "## FlexRLHF trends (estimated iteration time, s; speedup over co-located)", "",
          "Each setting twice: `megatron` (tp/pp/dp per model, distributed optimizer) and `zero3` "
          "(every call ZeRO-3 over its mesh, generation through the hybrid engine: "
          "DeepSpeed-Chat, the system FlexRLHF measures its strategies on). *searched*: our "
          f"search under the same parallelism ({res['flexrlhf_search_s']:g} s). Paper columns "
          "come from `benchmarks/reference/flexrlhf.json`; its Tables I-II are not recorded there "
          "(unverified), so they read *unknown*.", "",
          f"![FlexRLHF settings: speedup over co-located]({res['flexrlhf_png']})", "",
          "| setting | cluster | parallelism | co-located | interleaved | interleaved2 "
          "| disaggregated | searched | paper |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in res["flexrlhf"]:
        cells = []
        for k in ("colocated", "interleaved", "interleaved2", "disaggregated", "searched"):
            v = r["estimated_s"][k]
            if v is None:
                cells.append("n/a")
                continue
            oom = " OOM" if r["oom"][k] is True else ""
            cells.append(f"{v:.1f} ({r['speedup_vs_colocated'][k]:.2f}x){oom}")
        L.append(f"| {r['actor']}/{r['critic']} | {r['cluster']} | {r['parallelism']} | "
                 + " | ".join(cells)
                 + f" | {r['paper'] or 'unknown'} |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short searches (smoke test)")
    ap.add_argument("--time-limit", type=float, default=110.0,
                    help="seconds for the 8x8 search (the bar: a plan within 2 minutes)")
    ap.add_argument("--only", choices=SECTIONS, default=None,
                    help="recompute one section and keep the others from the last results file")
    args = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 for the one-core figure", file=sys.stderr)
    limit = 10.0 if args.quick else args.time_limit
    res = {"name": "placement", "date": dt.date.today().isoformat(),
           "command": "OMP_NUM_THREADS=1 python benchmarks/placement.py"
                      + (" --quick" if args.quick else ""),
           "machine": {"cpu": cpu(), "cores_used": 1, "python": platform.python_version()}}
    name = "placement_quick" if args.quick else "placement"
    last = RESULTS / f"{name}.json"
    if args.only:
        if not last.exists():
            ap.error(f"--only needs a previous full run's {last}; run without --only first")
        res = {**json.loads(last.read_text()), "date": res["date"], "machine": res["machine"]}
    if args.only in (None, "small_clusters"):
        res["small_clusters"] = small_clusters(3.0 if args.quick else 8.0)
    if args.only in (None, "realhf"):
        res["realhf"] = [realhf(limit, fusion=False), realhf(limit, fusion=True)]
    if args.only in (None, "flexrlhf"):
        res["flexrlhf_search_s"] = 2.0 if args.quick else 10.0
        res["flexrlhf"] = flexrlhf(res["flexrlhf_search_s"])
    RESULTS.mkdir(exist_ok=True)
    res["flexrlhf_png"] = f"{name}_flexrlhf.png"
    plot_flexrlhf(res["flexrlhf"], RESULTS / res["flexrlhf_png"])
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    md = markdown(res)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
