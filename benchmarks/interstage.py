"""Inter-stage fusion: generation + inference wall time, fused vs serial, in one run; and the
simulator's R_t sweep for a large configuration.

Measured part: 2 gloo processes on this CPU (one thread each), each a generation instance
(ReferenceBackend, tiny Llama actor) holding tiny Ref / Reward / Critic models. Response lengths
follow a lognormal with p99 >= 10x the median, imposed as per-sample ``max_new_tokens`` with no
stop token. Serial: each rank generates its shard, inference starts when the last sample of the
batch has ended. Fused: ``run_rollout`` migrates the tail at R_t remaining samples and the freed
rank scores samples as they stream in. Runs alternate (serial, fused, serial, ...) in the same
two processes, and every fused batch is checked against the serial one (tokens equal, logprobs
and scores within 1e-5).

Simulated part: ``plan_migration`` on the ``llama13b-h100x64`` preset (see
``rlhf_fusion.rollout.planning.presets`` for how its numbers are derived).

    python benchmarks/interstage.py            # writes benchmarks/results/interstage.{json,md,png}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import cpu_model  # noqa: E402

from rlhf_fusion.launch import run_ranks
from rlhf_fusion.rollout.cli import plot_plan
from rlhf_fusion.rollout.config import RolloutConfig
from rlhf_fusion.rollout.planning import LengthDistribution, lognormal_quantile_lengths
from rlhf_fusion.rollout.planning.presets import PRESETS
from rlhf_fusion.rollout.planning.simulate import plan_migration
from rlhf_fusion.rollout.types import SampleSpec
from rlhf_fusion.testing import TinyJob, tiny_job_worker

RESULTS = Path(__file__).resolve().parent / "results"
# Median of this many passes per calibration point (see calibrate()).
CALIBRATION_REPEATS = 3
# The simulated curve is flat near its minimum: take the middle of the R_t values within 5 % of
# the best, so that cost noise of a few percent does not move the choice along the stretch.
RT_TOLERANCE = 0.05


def make_specs(n: int, median: float, sigma: float, max_len: int, prompt_len: int, vocab: int,
               seed: int) -> tuple[list[SampleSpec], np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(lognormal_quantile_lengths(n, median, sigma, max_len=max_len))
    specs = [SampleSpec(i, rng.integers(0, vocab, prompt_len).tolist(),
                        max_new_tokens=int(lengths[i]), seed=seed) for i in range(n)]
    return specs, lengths


def calibrate(args: argparse.Namespace, actor: dict, scorer: dict, lengths: np.ndarray) -> dict:
    """Measure this machine's costs in the simulator's terms, then let the planner pick R_t.

    Decode steps at several batch sizes and context lengths are fitted to
    ``base + per_sample * b + per_kv_token * K``; scoring time to ``per_token * tokens``.
    """
    import torch

    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.rollout.planning import ClusterModel
    from rlhf_fusion.rollout.reference import ReferenceBackend
    from rlhf_fusion.rollout.types import SampleResult
    from rlhf_fusion.testing import build_causal_lm, build_value_model, model_config

    torch.set_num_threads(1)
    acfg, aseed = model_config(actor)
    backend = ReferenceBackend(build_causal_lm(acfg, aseed), max_batch_size=args.samples)
    # Each (batch, context) point is measured CALIBRATION_REPEATS times and fitted by its
    # median: one disturbed pass (the other core busy, a GC pause) then moves no coefficient.
    samples: dict[tuple[int, int], list[float]] = {}
    sid = 0
    for _ in range(CALIBRATION_REPEATS):
        for b, steps in ((1, 160), (4, 160), (16, 120), (32, 60)):
            backend.submit([SampleSpec(sid + i, [1] * args.prompt_len, max_new_tokens=steps)
                            for i in range(b)])
            sid += b
            backend.step()  # prefill
            for j in range(1, steps - 1):
                t = time.perf_counter()
                backend.step()
                samples.setdefault((b, j), []).append(time.perf_counter() - t)
            list(backend.results())
    rows = [[1.0, b, b * (args.prompt_len + j)] for b, j in samples]
    times = [statistics.median(v) for v in samples.values()]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    base, per_sample, per_kv = (max(float(c), 0.0) for c in coef)
    scfg, sseed = model_config(dict(scorer, seed=2))
    inf = InferenceModels(build_causal_lm(scfg, sseed), build_value_model(scfg, sseed + 1),
                          build_value_model(scfg, sseed + 2), micro_batch=args.micro_batch)
    fake = [SampleResult(i, (1,) * args.prompt_len, (2,) * int(n), (0.0,) * int(n), "length")
            for i, n in enumerate(lengths[:32])]
    inf.score(fake[:2])
    runs = []
    for _ in range(CALIBRATION_REPEATS):
        t = time.perf_counter()
        inf.score(fake)
        runs.append(time.perf_counter() - t)
    per_token = statistics.median(runs) / sum(args.prompt_len + len(f.token_ids) for f in fake)
    t = time.perf_counter()
    backend.submit([SampleSpec(10**6, [1] * 64, max_new_tokens=1)])
    list(backend.results())
    prefill = (time.perf_counter() - t) / 64
    cluster = ClusterModel(
        instances=2, bs_max=args.samples, step_base_s=base, step_per_sample_s=per_sample,
        step_per_kv_token_s=per_kv, prefill_per_token_s=prefill, infer_per_token_s=per_token,
        kv_bytes_per_token=backend.kv_bytes_per_token, bandwidth_bytes_s=1e9, latency_s=1e-3,
        prompt_len=args.prompt_len)
    plan = plan_migration(LengthDistribution(lengths), cluster, args.samples, trials=8,
                          seed=args.seed, tolerance=RT_TOLERANCE, pick="middle")
    return {"cluster": cluster.to_dict(), "plan": plan.to_dict(), "rt_fraction": plan.fraction,
            "predicted_serial_s": plan.serial_s, "predicted_fused_s": plan.fused_s}


def compare(serial, fused) -> dict[str, float]:
    worst = {"logprobs": 0.0, "ref_logprobs": 0.0, "values": 0.0, "reward": 0.0}
    for a, b in zip(serial.experiences, fused.experiences, strict=True):
        if a.sample_id != b.sample_id or a.response_ids != b.response_ids:
            raise AssertionError(f"sample {a.sample_id}: fused tokens differ from serial")
        for f in ("logprobs", "ref_logprobs", "values"):
            d = float((getattr(a, f) - getattr(b, f)).abs().max()) if a.response_ids else 0.0
            worst[f] = max(worst[f], d)
        worst["reward"] = max(worst["reward"], abs(a.reward - b.reward))
    if max(worst.values()) > 1e-5:
        raise AssertionError(f"fused differs from serial beyond 1e-5: {worst}")
    return worst


def stage_times(run: dict) -> dict[str, float]:
    ranks = run["stats"]["ranks"]
    out = {"generation_end_s": max(st["generation_end_s"] for st in ranks)}
    starts = [st["inference_start_s"] for st in ranks if st.get("inference_start_s") is not None]
    if starts:
        out["first_inference_s"] = min(starts)
    if ranks[0].get("trigger_s") is not None:
        out["trigger_s"] = max(st["trigger_s"] for st in ranks)
        out["migrated"] = len(ranks[0]["moved"])
    return out


def measure(args: argparse.Namespace) -> dict:
    specs, lengths = make_specs(args.samples, args.median, args.sigma, args.max_len,
                                args.prompt_len, args.vocab, args.seed)
    p50, p99 = float(np.percentile(lengths, 50)), float(np.percentile(lengths, 99))
    if p99 < 10 * p50:
        raise SystemExit(f"p99/median = {p99 / p50:.1f} < 10: raise --sigma")
    actor = dict(vocab_size=args.vocab, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=1)
    scorer = dict(vocab_size=args.vocab, hidden_size=args.infer_hidden, layers=args.infer_layers,
                  heads=4, kv_heads=4)
    calib = None
    rt_fraction = args.rt_fraction
    if rt_fraction is None:
        # Calibrate several times: the picks show how robust the choice is to timing noise;
        # the median pick is measured.
        runs = [calibrate(args, actor, scorer, lengths) for _ in range(args.calibrations)]
        picks = [c["rt_fraction"] for c in runs]
        calib = sorted(runs, key=lambda c: c["rt_fraction"])[len(runs) // 2]
        calib["rt_picks"] = picks
        rt_fraction = calib["rt_fraction"]
        print(f"R_t picks over {len(picks)} calibrations: "
              + ", ".join(f"{p:.0%}" for p in picks), file=sys.stderr)
    modes = {
        "serial": RolloutConfig(fused=False, timeout_s=300),
        "fused": RolloutConfig(fused=True, rt_fraction=rt_fraction, mechanism=args.mechanism,
                               timeout_s=300),
    }
    if args.also_rt is not None:
        modes[f"fused, R_t={args.also_rt:.0%}"] = RolloutConfig(
            fused=True, rt_fraction=args.also_rt, mechanism=args.mechanism, timeout_s=300)
    names = list(modes)
    job = TinyJob(specs=specs, configs=list(modes.values()) * args.repeats, actor=actor,
                  ref=dict(scorer, seed=2), reward=dict(scorer, seed=3),
                  critic=dict(scorer, seed=4), bs_max=args.samples, micro_batch=args.micro_batch)
    t0 = time.perf_counter()
    out = [r.value for r in run_ranks(tiny_job_worker, 2, job, collective_timeout=300,
                                      timeout=3600)]
    total = time.perf_counter() - t0
    runs = out[0]
    walls: dict[str, list[float]] = {n: [] for n in names}
    stages: dict[str, list[dict]] = {n: [] for n in names}
    worst: dict[str, float] = {}
    ref = runs[0]["output"]
    for i, run in enumerate(runs):
        mode = names[i % len(names)]
        # The stage ends when the last rank has the assembled batch.
        walls[mode].append(max(r[i]["wall_s"] for r in out))
        stages[mode].append(stage_times(run))
        if mode != "serial":
            for k, v in compare(ref, run["output"]).items():
                worst[k] = max(worst.get(k, 0.0), v)
    med = {k: statistics.median(v) for k, v in walls.items()}
    serial_gen = statistics.median(s["generation_end_s"] for s in stages["serial"])
    return {
        "workload": {
            "processes": 2, "threads_per_process": 1, "samples": args.samples,
            "prompt_len": args.prompt_len, "vocab": args.vocab,
            "lengths": {"distribution": f"lognormal median {args.median} sigma {args.sigma}, "
                                        f"cap {args.max_len}", "median": p50, "p99": p99,
                        "p99_over_median": p99 / p50, "max": int(lengths.max()),
                        "mean": float(lengths.mean())},
            "actor": actor, "ref_reward_critic": scorer, "bs_max": args.samples,
            "micro_batch": args.micro_batch, "dtype": "float64",
            "rt_fraction": rt_fraction, "rt_chosen_by": "planner on calibrated costs"
            if calib else "--rt-fraction", "mechanism": args.mechanism,
            "repeats": args.repeats,
        },
        "wall_s": walls, "median_wall_s": med, "speedup": med["serial"] / med["fused"],
        "speedups": {n: med["serial"] / med[n] for n in names if n != "serial"},
        "stages": stages,
        "serial_generation_s": serial_gen,
        "serial_inference_s": med["serial"] - serial_gen,
        "max_abs_diff_fused_vs_serial": worst,
        "launch_total_s": total,
        "calibration": calib,
    }


def simulate(args: argparse.Namespace) -> dict:
    preset = PRESETS[args.preset]
    dist = LengthDistribution.lognormal(preset.median_len, preset.sigma, max_len=preset.max_len)
    plan = plan_migration(dist, preset.cluster, preset.batch_size, trials=args.sim_trials,
                          seed=args.seed, progress=True)
    png = RESULTS / "interstage_rt_sweep.png"
    if not args.no_write:
        plot_plan(plan, png, title=f"simulated R_t sweep: {args.preset}")
    return {"preset": args.preset, "description": preset.description,
            "cluster": preset.cluster.to_dict(), "batch_size": preset.batch_size,
            "lengths": {"median": preset.median_len, "sigma": preset.sigma,
                        "max_len": preset.max_len, "p99_over_median": dist.tail_ratio},
            "plan": plan.to_dict(), "plot": str(png.relative_to(RESULTS.parent.parent))}


def markdown(res: dict) -> str:
    m, s = res["measured"], res["simulated"]
    w = m["workload"]
    lines = [
        "# Inter-stage fusion (generation + inference)",
        "",
        f"Machine: {res['machine']['cpu']} ({res['machine']['cores']} cores), "
        f"torch {res['machine']['torch']}, {res['date']}. Command: `{res['command']}`.",
        "",
        "## Measured: fused vs serial, 2 processes on CPU",
        "",
        f"{w['samples']} samples, prompt {w['prompt_len']} tokens; response lengths "
        f"{w['lengths']['distribution']}: median {w['lengths']['median']:.0f}, "
        f"p99 {w['lengths']['p99']:.0f} ({w['lengths']['p99_over_median']:.1f}x the median), "
        f"max {w['lengths']['max']}. Actor Llama hidden 64 x 2 layers; Ref/Reward/Critic "
        f"hidden {w['ref_reward_critic']['hidden_size']} x {w['ref_reward_critic']['layers']} "
        f"layers; float64; R_t = {w['rt_fraction']:.0%} of the batch ({w['rt_chosen_by']}), "
        f"mechanism `{w['mechanism']}`. {w['repeats']} alternating runs of each mode in one "
        "launch.",
        "",
        "| mode | wall time per run (s) | median (s) |",
        "|---|---|---|",
    ]
    for mode in m["wall_s"]:
        runs = ", ".join(f"{x:.3f}" for x in m["wall_s"][mode])
        label = mode if mode != "fused" else f"fused, R_t={w['rt_fraction']:.0%} (planner)"
        sp = "" if mode == "serial" else f" ({m['speedups'][mode]:.2f}x)"
        lines.append(f"| {label} | {runs} | {m['median_wall_s'][mode]:.3f}{sp} |")
    d = m["max_abs_diff_fused_vs_serial"]
    lines += [
        "",
        f"**Speedup (median serial / median fused at the planner's R_t): "
        f"{m['speedup']:.2f}x.** Serial breakdown: "
        f"generation {m['serial_generation_s']:.3f} s, inference {m['serial_inference_s']:.3f} s.",
        f"Every fused batch equals the serial one: same tokens; max |diff| logprobs "
        f"{d['logprobs']:.1e}, ref logprobs {d['ref_logprobs']:.1e}, values "
        f"{d['values']:.1e}, rewards {d['reward']:.1e}.",
        "",
    ]
    if m.get("calibration"):
        c = m["calibration"]
        cl = c["cluster"]
        lines += [
            f"Calibration on this machine: decode step {1e3 * cl['step_base_s']:.2f} ms "
            f"+ {1e6 * cl['step_per_sample_s']:.0f} us/sample + "
            f"{1e9 * cl['step_per_kv_token_s']:.0f} ns/KV token; scoring "
            f"{1e6 * cl['infer_per_token_s']:.0f} us/token. The simulator predicts serial "
            f"{c['predicted_serial_s']:.2f} s, fused {c['predicted_fused_s']:.2f} s "
            f"({c['predicted_serial_s'] / c['predicted_fused_s']:.2f}x) and picks "
            f"R_t = {c['rt_fraction']:.0%}."
            + (f" Picks over {len(c['rt_picks'])} independent calibrations: "
               + ", ".join(f"{p:.0%}" for p in c["rt_picks"]) + " (the sweep's step is 5%)."
               if c.get("rt_picks") else ""),
            "",
        ]
    lines += [
        f"## Simulated: R_t sweep, preset `{s['preset']}`",
        "",
        f"{s['description']}; response lengths lognormal median {s['lengths']['median']}, "
        f"sigma {s['lengths']['sigma']} (p99/median {s['lengths']['p99_over_median']:.1f}).",
        "",
        "| R_t | % of batch | m | fused (s) | serial (s) | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for p in s["plan"]["curve"]:
        fused = p["fused_s"]
        if fused == float("inf"):
            lines.append(f"| {p['rt']} | {100 * p['fraction']:.0f}% | {p['m']} | infeasible "
                         f"(m >= instances) | {p['serial_s']:.1f} | - |")
        else:
            best = " **(best)**" if p["rt"] == s["plan"]["rt"] else ""
            lines.append(f"| {p['rt']} | {100 * p['fraction']:.0f}% | {p['m']} | {fused:.1f}"
                         f"{best} | {p['serial_s']:.1f} | {p['serial_s'] / fused:.2f}x |")
    pl = s["plan"]
    lines += [
        "",
        f"Optimum: R_t = {pl['rt']} ({100 * pl['fraction']:.0f}% of the batch), m = {pl['m']}, "
        f"mechanism {pl['mechanism']} ({pl['mechanism_reason']}); simulated speedup "
        f"{pl['speedup']:.2f}x. Plot: `{s['plot']}`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--median", type=float, default=32)
    ap.add_argument("--sigma", type=float, default=1.1)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--infer-hidden", type=int, default=160)
    ap.add_argument("--infer-layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rt-fraction", type=float, default=None,
                    help="R_t as a fraction of the batch (default: the planner's choice from "
                         "costs calibrated on this machine)")
    ap.add_argument("--also-rt", type=float, default=0.25,
                    help="also measure fused at this fixed R_t fraction (negative: skip)")
    ap.add_argument("--mechanism", default="kv", choices=["kv", "tokens"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibrations", type=int, default=3,
                    help="calibrate this many times (the picks are recorded; the median runs)")
    ap.add_argument("--preset", default="llama13b-h100x64", choices=sorted(PRESETS))
    ap.add_argument("--sim-trials", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only (for trying settings)")
    args = ap.parse_args(argv)
    if args.also_rt is not None and args.also_rt <= 0:
        args.also_rt = None
    measured = measure(args)
    simulated = simulate(args)
    res = {
        "name": "interstage",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/interstage.py", *(argv or sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "torch": __import__("torch").__version__,
                    "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "measured": measured,
        "simulated": simulated,
    }
    md = markdown(res)
    print(md)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "interstage.json").write_text(json.dumps(res, indent=2))
        (RESULTS / "interstage.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
