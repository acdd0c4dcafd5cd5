"""Copy the headline figures from benchmarks/results/ into README.md (between marker comments).

    python benchmarks/update_readme.py

The README quotes numbers only through this script, so they always match a results file that a
benchmark script wrote.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def table3() -> str:
    data = json.loads((RESULTS / "table3.json").read_text())
    s = data["summary"]
    lines = [
        f"Measured by `benchmarks/table3.py` on {data['machine']}, at most "
        f"{data['time_limit_s']:g} s per setting (full table: `benchmarks/results/table3.md`):",
        "",
        "| setting | serial 1F1B | greedy | ours | lower bound | speedup (paper) | peak memory vs serial (paper) | seconds (paper's search, 512+ CPUs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        o, p, f = r["ours"], r["paper"], r["flexfusion"]
        lines.append(
            f"| {r['name']} | {r['serial_1f1b']:g} | {r['greedy']:g} | **{o['makespan']:g}** | "
            f"{r['lower_bound']:g} | {o['speedup']:.2f}x ({p['speedup_ours']:.2f}x) | "
            f"{o['peak_ratio']:.2f}x ({p['peak_ratio_ours']:.2f}x) | {o['wall_seconds']:.0f} ({f['search_wall_seconds']}) |"
        )
    lines += [
        "",
        f"The lower bound (a proof that nothing faster exists) is reached on {s['bound_reached']} of "
        f"{s['settings']} settings (the paper: 11 of 12), in at most {s['max_wall_seconds']:.0f} s "
        f"each on {data['workers']} cores. Peak activation memory is at or below the paper's on "
        f"{s['peak_at_or_below_paper']} of {s['settings']}.",
    ]
    return "\n".join(lines)


def _span(d: dict) -> str:
    """Fused over stock samples/s, and (where recorded) over process CPU seconds per sample,
    the figure a busy shared machine distorts least."""
    def rng(lo: float, hi: float) -> str:
        return f"{lo:.2f}x" if len(d["seeds"]) == 1 else f"{lo:.2f}-{hi:.2f}x"

    out = rng(d["speedup_min"], d["speedup_max"])
    if "cpu_speedup_min" in d:
        out += f" (CPU seconds per sample: {rng(d['cpu_speedup_min'], d['cpu_speedup_max'])})"
    return out


def _trl_conditions(*files: dict, threads: bool = True) -> str:
    """The machine's state beside a TRL figure: load averages seen, torch threads, pairs."""
    loads = [float(v["load"]) for d in files for r in d["runs"]
             for v in (r.get(k) for k in ("stock", "off", "fused")) if v and "load" in v
             and v["load"] != "?"]
    if not loads:
        return ""
    d = files[0]
    pairs = d.get("pairs", 1)
    # The benchmark's own processes make a load of about 1-2; above the core count, other
    # jobs shared the machine.
    cores = int(d.get("device", {}).get("cpu_cores") or 1)
    where = "nothing else running" if max(loads) <= cores + 0.5 else "the machine shared"
    return (f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f} ({where})"
            + (f", torch threads {d.get('torch_threads', '?')}" if threads else "")
            + ", stock and fused alternating"
            + (f", the median of {pairs} pairs per seed" if pairs > 1 else ""))


def others() -> str:
    out = []
    e2e = RESULTS / "e2e.json"
    if e2e.exists():
        d = json.loads(e2e.read_text())
        sp = [r["speedup"] for r in d["rows"]]
        per = ", ".join(f"seed {r['seed']} {r['speedup']:.2f}x" for r in d["rows"])
        reps = d.get("repeats", 1)
        if reps > 1:
            per += f"; each the median of {reps} serial/fused pairs"
        out += [
            f"End to end (`benchmarks/e2e.py`, PPO on the demo's tiny models, {d['world']} "
            f"processes on {d['device']['cpu']}, {d['device']['cpu_cores']} cores, "
            f"{d['batch']} prompts/iteration): the fused loop runs **{min(sp):.2f}-{max(sp):.2f}x** "
            f"the samples/s of the serial baseline ({per}), generating the same samples. "
            "Per-stage breakdown: `benchmarks/results/e2e_breakdown.png`.",
            "",
        ]
    trl = {a: RESULTS / f"trl_{a}.json" for a in ("ppo", "grpo")}
    if all(f.exists() for f in trl.values()):
        ppo, grpo = (json.loads(f.read_text()) for f in trl.values())
        w = ppo["workload"]
        if all("cpu_s" in r["off"] for r in ppo["runs"]):  # robust on a busy machine
            off = [r["stock"]["cpu_s"] / r["off"]["cpu_s"] for r in ppo["runs"]]
            off_what = "in CPU seconds"
        else:
            off = [r["off"]["samples_per_s"] / r["stock"]["samples_per_s"] for r in ppo["runs"]]
            off_what = "in samples/s"
        off_s = f"{off[0]:.2f}x" if len(off) == 1 else f"{min(off):.2f}-{max(off):.2f}x"
        seeds = f"seeds {', '.join(map(str, ppo['seeds']))}"
        if grpo["seeds"] != ppo["seeds"]:
            seeds = (f"seeds {', '.join(map(str, ppo['seeds']))} (PPO), "
                     f"{', '.join(map(str, grpo['seeds']))} (GRPO)")
        out += [
            f"TRL (`benchmarks/trl.py`, {ppo['device']['cpu']}, {ppo['device']['cpu_cores']} "
            f"cores, one process, a {w['layers']}-layer hidden-{w['hidden']} Llama whose own "
            f"sampling gives long-tailed lengths, p99 about 6x the median; "
            f"{seeds}{_trl_conditions(ppo, grpo)}): "
            f"`FusedPPOTrainer` **{_span(ppo)}** the "
            f"samples/s of trl 1.12's `PPOTrainer` (batch {w['batch']}, {w['ppo_epochs']} PPO "
            f"epochs; our trainer with every plugin off, the same arithmetic bit for bit, runs "
            f"{off_s} {off_what}, so the plugins give the rest); "
            f"`FusedGRPOTrainer` **{_span(grpo)}** stock `GRPOTrainer`.",
            "",
        ]
    short = {a: RESULTS / f"trl_{a}_short.json" for a in ("ppo", "grpo")}
    if all(f.exists() for f in short.values()):
        ppo, grpo = (json.loads(f.read_text()) for f in short.values())
        w = ppo["workload"]
        out += [
            f"Short completions (`benchmarks/trl.py --short`: {w['layers']} layers, hidden "
            f"{w['hidden']}, EOS bias {w['eos_bias']:g}, so the median completion is a few "
            f"tokens and generation a small share of the step; seeds "
            f"{', '.join(map(str, ppo['seeds']))}{_trl_conditions(ppo, grpo)}): PPO "
            f"**{_span(ppo)}**, GRPO **{_span(grpo)}**; per-stage seconds in "
            "`benchmarks/results/trl_{ppo,grpo}_short.md`.",
            "",
        ]
    ddp = sorted(RESULTS.glob("trl_*_ddp*.json"))
    if ddp:
        parts = []
        for f in ddp:
            d = json.loads(f.read_text())
            algo = f.stem.split("_")[1].upper()
            kind = "short-completion" if d["workload"].get("short") else "default"
            parts.append(f"{algo} ({kind} workload, seeds "
                         f"{', '.join(map(str, d['seeds']))}{_trl_conditions(d, threads=False)}) "
                         f"**{_span(d)}**")
        out += [f"Over {d['processes']} DDP processes (`benchmarks/trl.py --processes "
                f"{d['processes']}`, gloo, one torch thread each, the batch split over them): "
                + "; ".join(parts) + ".", ""]
    fp = RESULTS / "fused_pipeline.json"
    if fp.exists():
        d = json.loads(fp.read_text())
        m = d["machine"]
        out += [
            f"Fused pipeline runtime (`benchmarks/fused_pipeline.py` on {m['cpu']}, {m['cores']} "
            "cores): each task sleeps its planned time while real activations and gradients move "
            "over gloo, so the schedule itself is measured:",
            "",
            "| config | measured vs predicted step | measured / predicted speedup over serial 1F1B |",
            "|---|---:|---:|",
        ]
        for r in d["emulated"]:
            out.append(f"| {r['config']} | {100 * r['fused_error']:+.1f}% | "
                       f"{r['measured_speedup']:.3f}x / {r['predicted_speedup']:.3f}x |")
        out.append("")
    inter = RESULTS / "interstage.json"
    if inter.exists():
        d = json.loads(inter.read_text())
        meas = d["measured"]
        plan = d["simulated"]["plan"]
        out.append(
            "Inter-stage fusion (`benchmarks/interstage.py`, 2 processes on CPU, tiny models, "
            "long-tailed response lengths): generation + inference "
            f"**{meas['speedup']:.2f}x** faster than serial, every sample identical to the serial "
            f"run (max logprob difference {meas['max_abs_diff_fused_vs_serial'].get('logprobs', 0):.1e})."
            if isinstance(meas.get("max_abs_diff_fused_vs_serial"), dict)
            else f"Inter-stage fusion (`benchmarks/interstage.py`): {meas['speedup']:.2f}x faster than serial."
        )
        if isinstance(plan, dict) and "speedup" in plan:
            out.append(f"The simulator's sweep for a 64-GPU 13B setting picks R_t at "
                       f"{100 * plan.get('fraction', 0):.0f}% of the batch "
                       f"({plan['speedup']:.2f}x simulated).")
        out.append("")
    pl, pm = RESULTS / "placement.json", RESULTS / "placement_measured.json"
    if pl.exists() and pm.exists():
        d, m = json.loads(pl.read_text()), json.loads(pm.read_text())
        r = d["realhf"][0]
        ratios = [row["ratio"] for row in m["rows"]]
        zero = ""
        flex = d.get("flexrlhf")
        if isinstance(flex, dict) and "compare" in flex:
            c = flex["compare"]
            big = [x["searched_throughput"] / x["best_hand_throughput"] for x in flex["search"]
                   if "table" in x and not x["oom"] and x["size"] in ("33B", "65B")
                   and not x["gpus"].startswith("1x8")]
            zero = (f" On FlexRLHF's own workload (four LLaMA models of one size, LoRA, each "
                    f"strategy at its largest batch; DeepSpeed-Chat's ZeRO-2/3 and hybrid engine "
                    f"modelled) the estimate matches the direction of {c['matched']} of "
                    f"{c['n_pairs']} comparisons in the paper's Tables I-II"
                    + (f" (as-fast within {100 * c['tie']:.2f}%, the largest difference the paper "
                       f"calls no gain; {c['matched_in_band'][0]}-{c['matched_in_band'][1]} of "
                       f"{c['n_pairs']} over every band its text allows)" if "tie" in c else "")
                    + f" and lands within 2x of {c['within_2x']} of the {c['n_ratios']} "
                    f"throughputs of Tables I-III"
                    + (f"; of the {c['n_paper_oom']} cells the paper reports as OOM (65B on one "
                       f"node), {c['paper_oom_ours_fits']} fit in our memory model"
                       if c.get("n_paper_oom") else "")
                    + (f"; at 33B/65B on 2-16 nodes our search finds plans estimated "
                       f"{min(big):.1f}-{max(big):.1f}x faster than the best of FlexRLHF's "
                       f"hand-made strategies." if big else "."))
        out += [
            f"Placement (`benchmarks/placement.py`, estimates from datasheet figures): for "
            f"ReaLHF's 7B Actor + 70B Critic on 8x8 A100 the search finds in "
            f"{r['search_seconds']:.0f} s on one core a plan estimated {r['speedup']:.2f}x "
            f"faster than the co-located Megatron heuristic (ReaLHF reports 1.26x on average)."
            + zero + f" The estimator against emulated runs on {m['machine']['cpu_cores']} cores "
            f"(`benchmarks/placement_measured.py`, every call sleeps its estimate while real "
            f"data and parameters move): measured/predicted iteration time "
            f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} plans.",
            "",
        ]
    gae = RESULTS / "gae.json"
    if gae.exists():
        d = json.loads(gae.read_text())
        rows = [r for r in d["cpu"]["rows"] if r["threads"] == 1]
        by = {}
        for r in rows:
            by.setdefault(r["semantics"], []).append(r["speedup"])
        parts = ", ".join(f"{min(v):.0f}-{max(v):.0f}x ({k} semantics)" for k, v in by.items())
        out.append(
            f"GAE (`benchmarks/gae.py`, B=64, T=2048, one CPU thread): the blocked torch path is "
            f"{parts} faster than the reverse loop as TRL/verl write it." + gpu_kernels()
        )
    return "\n".join(out).strip()


def gpu_kernels() -> str:
    """The Triton kernels' figures from the last GPU run (``*_h100.json``), if there is one."""
    gae, dec = RESULTS / "gae_h100.json", RESULTS / "decode_h100.json"
    if not (gae.exists() and dec.exists()):
        return " Triton kernels on GPU: not measured."
    g = json.loads(gae.read_text())
    d = json.loads(dec.read_text())
    rows = {(r["semantics"], r["dtype"]): r for r in g["gpu"]["rows"]}
    z, k = rows[("zero", "float32")], rows[("skip", "float32")]
    h = d["headline"]
    return (
        f" On an {g['device']['gpu']} (`benchmarks/results/gae_h100.md`, B=256, T=4096, fp32), "
        f"the Triton GAE kernel takes {z['kernel_s'] * 1e6:.1f} us ({z['speedup_vs_loop']:,.0f}x "
        f"the TRL loop on the same GPU) and reaches {100 * z['fraction_of_copy']:.0f}% of the "
        f"copy bandwidth under zero semantics and {100 * k['fraction_of_copy']:.0f}% under skip "
        f"semantics (bar 60%: not met). Paged decode attention (`decode_h100.md`, B=64, 2048 "
        f"tokens, 32q/8kv heads, bf16) reaches {100 * h['fraction_of_copy']:.0f}% of the copy "
        f"bandwidth, {h['speedup_vs_sdpa_with_gather']:.1f}x gather + SDPA and "
        f"{h['speedup_vs_sdpa_dense']:.2f}x SDPA on an already dense cache."
    )


def demo() -> str:
    """The main job's figure: ``benchmarks/demo_compare.py`` (``rlhf-fusion demo --compare``)."""
    d = json.loads((RESULTS / "demo_compare.json").read_text())
    dev = d["device"]
    loads = [x for r in d["rows"] for m in ("fused", "serial")
             for x in (r[m]["load_before"][0], r[m]["load_after"][0])]
    per = ", ".join(f"{x:.2f}x" for x in d["ratios"])
    return (
        f"`rlhf-fusion demo --compare` ({d['pairs']} alternating fused/serial pairs of the "
        f"default demo, {d['iterations']} iterations each, {dev['cpu']}, {dev['cpu_cores']} "
        f"cores, 1-minute load {min(loads):.1f}-{max(loads):.1f} during the runs): total "
        f"iteration time serial/fused **{d['median_ratio']:.2f}x** (median; every pair: {per}), "
        "rewards equal in every iteration. Breakdown: `benchmarks/results/demo_compare.png`; "
        "one iteration per rank: `benchmarks/results/demo_timeline.png`."
    )


def demo_grpo() -> str:
    """``benchmarks/demo_compare.py --algo grpo`` (``rlhf-fusion demo --algo grpo --compare``):
    a table of the pairs, the bar's verdict, then short notes on what else was measured."""
    d = json.loads((RESULTS / "demo_compare_grpo.json").read_text())
    # The verdict as the demo reads the bar now (90% of the bound's gain), from the stored pairs.
    from rlhf_fusion.loop.demo_grpo import verdict

    d.update(verdict(d["pairs"]))
    dev = d["device"]
    pairs = d["pairs"]
    loads = [x for r in pairs for x in (r["fused"]["load_before"], r["fused"]["load_after"])]

    def row(name: str, key: str, median: float | None = None) -> str:
        vals = [r[key] for r in pairs if r.get(key) is not None]
        med = statistics.median(vals) if median is None else median
        return (f"| {name} | **{med:.2f}x** | "
                + ", ".join(f"{v:.2f}" for v in vals) + " |")

    share = 100 * (d["median_rollout_ratio"] - 1) / (d["median_bound"] - 1)
    lines = [
        f"`rlhf-fusion demo --algo grpo --compare`: {len(pairs)} pairs of {d['iterations']} "
        f"iterations, the fused and serial workers interleaved in the same 2 processes "
        f"({dev['cpu']}, {dev['cpu_cores']} cores, 1-minute load {min(loads):.1f}-"
        f"{max(loads):.1f}; iteration 0, the warm-up, left out). Serial/fused:",
        "",
        "| | median | every pair |",
        "|---|---|---|",
        row("rollout (generation + Ref and reward scoring), against the serial run that "
            "balances its ranks' scoring as the fused stream does: the bar's ratio",
            "rollout_ratio", d["median_rollout_ratio"]),
        row("the simulator's bound for the pair's own lengths and timings", "bound",
            d["median_bound"]),
        row("rollout, against the static split (each rank scores its own samples, as verl "
            "and OpenRLHF do)", "static_rollout_ratio"),
        row("whole iteration", "iteration_ratio"),
        row("training (the same work in every mode: the load control)", "training_ratio"),
        "",
        f"Rewards equal in every iteration. Issue 37's bar ({d['bar']}, no pair below 1.0x "
        f"in rollout or iteration): {'met' if d['bar_met'] else '**not met**'}; the rollout "
        f"gains {share:.0f}% of what the bound allows. Why, and what was tried: "
        "`benchmarks/results/grpo_demo_compare_analysis.md`; per-stage seconds: "
        "`benchmarks/results/demo_compare_grpo.md`, `demo_compare_grpo.png`.",
    ]
    notes = [n for n in (corun(), sixteen_cores()) if n]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def corun() -> str:
    """What a rank's calls cost beside a busy peer (``benchmarks/corun_interference.py``)."""
    path = RESULTS / "corun_interference.json"
    if not path.exists():
        return ""
    d = json.loads(path.read_text())
    rows = d["rows"]
    beside_score = [r["slowdown"] for r in rows if r["a"] == "decode" and r["b"] == "score"]
    scoring = {r["b"]: r["slowdown"] for r in rows if r["a"] == "score"}
    cpu = d.get("device", {}).get("cpu", "the same CPU")
    return (f"Overlap on shared cores ({d['cores']} cores of {cpu}, its own run): a decode "
            f"step costs x{min(beside_score):.2f}-x{max(beside_score):.2f} beside the peer's "
            f"scoring, a scoring call x{scoring['decode']:.2f} beside the peer's decoding "
            f"(x{scoring['score']:.2f} beside its scoring), against the same call beside a "
            "sleeping peer. The simulator's bound does not price it "
            "(`benchmarks/results/corun_interference.md`).")


def sixteen_cores() -> str:
    """The same comparison where each rank has a core of its own (``grpo_16cores_summary.py``
    over the stored runs of ``grpo_quiet_machine.sh`` on the device machine's CPUs)."""
    path = RESULTS / "grpo_16cores.json"
    if not path.exists():
        return ""
    d = json.loads(path.read_text())
    if "pooled_balanced" not in d:
        return ""
    runs = [r for r in d["runs"] if r["baseline"] == "balanced"]
    p = d["pooled_balanced"]
    return ("A core for each rank (16 CPU cores of the device machine, sessions 46-49, "
            "bounds priced per token before session 54's per-sample term; "
            "`PAIRS=7 bash benchmarks/grpo_quiet_machine.sh`): against the balanced serial "
            f"run, {len(runs)} runs with medians "
            + ", ".join(f"{r['median']:.2f}x (bound {r['bound']:.2f}x)" for r in runs)
            + f"; pooled over {p['pairs']} pairs {p['median']:.3f}x against {p['bound']:.3f}x "
            f"(bar >= {p['need']:.3f}x: {'met' if p['met'] else 'not met'}), lowest pair "
            f"{p['min']:.2f}x (`benchmarks/results/grpo_16cores.md`).")


def inject(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no <!-- {name}:begin/end --> markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if (RESULTS / "table3.json").exists():
        text = inject(text, "table3", table3())
    text = inject(text, "others", others())
    if (RESULTS / "demo_compare.json").exists():
        text = inject(text, "demo", demo())
    if (RESULTS / "demo_compare_grpo.json").exists():
        text = inject(text, "demo_grpo", demo_grpo())
    readme.write_text(text)
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
