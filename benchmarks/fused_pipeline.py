"""Fused pipeline runtime: measured step time against the planner's prediction.

(a) Emulated compute: every forward/backward sleeps its planned time (``--unit`` ms per
    planner time unit) while the runtime does everything else for real: one process per stage
    group, gloo point-to-point with shape headers, early receives, the planner's instruction
    streams. Measures the fused step against the predicted makespan and fused vs serial 1F1B
    speedup against the predicted speedup, for 2 and 4 stage groups. Sleeping tasks keep the
    two-core CPU from being the bottleneck, so this checks the runtime, not the hardware.
(b) Real tiny models: a Llama-style Actor and Critic, partitioned and trained with the schedule
    the planner made from a profiling pass, against serial 1F1B and an unpipelined single
    process. On a 2-core CPU the processes compete for cores, so these times say how the
    runtime behaves there, not what a GPU cluster would gain.

Writes ``benchmarks/results/fused_pipeline.json`` and ``.md``.

    python benchmarks/fused_pipeline.py            # full run (a few minutes on 2 cores)
    python benchmarks/fused_pipeline.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _harness import device_info

from rlhf_fusion.launch import run_ranks
from rlhf_fusion.runtime import (
    EmulatedStageRunner,
    PipelineComm,
    PipelineEngine,
    PipelinePlan,
    TrainStageRunner,
    default_loss_fns,
    partition_,
    reference_step,
    split_micro_batches,
)
from rlhf_fusion.runtime.fused import problem_from_profiles
from rlhf_fusion.runtime.profile import profile_runner
from rlhf_fusion.schedule import (
    Problem,
    Schedule,
    concatenated_1f1b,
    lower_all,
    single_model_problem,
    solve,
)
from rlhf_fusion.testing import build_models, make_experience

RESULTS = Path(__file__).resolve().parent / "results"


# -- helpers --------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    return {**device_info(), "platform": platform.platform(),
            "load_average_1m_at_start": os.getloadavg()[0]}


def plan_schedule(problem: Problem, solver: str, time_limit: float) -> Schedule:
    # One worker: the planner may run inside a (daemonic) rank process, which cannot start a
    # process pool, and the cores are the ranks' anyway.
    try:
        return solve(problem, solver, time_limit=time_limit, workers=1)
    except ImportError:
        return solve(problem, "greedy", time_limit=time_limit)


def serial_streams(problem: Problem) -> list[list[list]]:
    """Per model, the per-group 1F1B instruction streams (serial 1F1B runs them in turn)."""
    out = []
    for mi in range(len(problem.models)):
        sub = single_model_problem(problem, mi)
        out.append(lower_all(sub, concatenated_1f1b(sub)))
    return out


def timed(comm: PipelineComm, fn) -> tuple[float, float]:  # noqa: ANN001
    """Run ``fn`` after a barrier; return this rank's (start, end) on the shared monotonic clock."""
    comm.barrier("before a timed step")
    t0 = time.perf_counter()
    fn()
    return t0, time.perf_counter()


def span(marks: list[tuple[float, float]]) -> float:
    return max(e for _, e in marks) - min(s for s, _ in marks)


def spread(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "mean": statistics.fmean(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


# -- (a) emulated compute ---------------------------------------------------------------------------
EMULATED = [
    # Actor larger than Critic (RLHFuse's setting), both spanning all groups.
    {
        "name": "N=2 actor(F2,B4) S2 + critic(F1,B2) S2, M=8",
        "problem": {
            "stage_groups": 2,
            "models": [
                {
                    "name": "actor",
                    "pipeline_stages": 2,
                    "micro_batches": 8,
                    "forward": 2,
                    "backward": 4,
                    "activation": 1,
                    "direction": "forward",
                },
                {
                    "name": "critic",
                    "pipeline_stages": 2,
                    "micro_batches": 8,
                    "forward": 1,
                    "backward": 2,
                    "activation": 1,
                    "direction": "reverse",
                },
            ],
        },
    },
    {
        "name": "N=4 actor(F2,B4) S4 + critic(F1,B2) S4, M=8",
        "problem": {
            "stage_groups": 4,
            "models": [
                {
                    "name": "actor",
                    "pipeline_stages": 4,
                    "micro_batches": 8,
                    "forward": 2,
                    "backward": 4,
                    "activation": 1,
                    "direction": "forward",
                },
                {
                    "name": "critic",
                    "pipeline_stages": 4,
                    "micro_batches": 8,
                    "forward": 1,
                    "backward": 2,
                    "activation": 1,
                    "direction": "reverse",
                },
            ],
        },
    },
    # A Critic with two copies of two stages (K2 = 2) next to a 4-stage Actor.
    {
        "name": "N=4 actor(F2,B4) S4 + critic(F1,B2) S2xK2, M=8",
        "problem": {
            "stage_groups": 4,
            "models": [
                {
                    "name": "actor",
                    "pipeline_stages": 4,
                    "micro_batches": 8,
                    "forward": 2,
                    "backward": 4,
                    "activation": 1,
                    "direction": "forward",
                },
                {
                    "name": "critic",
                    "pipeline_stages": 2,
                    "copies": 2,
                    "micro_batches": 4,
                    "forward": 1,
                    "backward": 2,
                    "activation": 1,
                    "direction": "reverse",
                },
            ],
        },
    },
]


def emulated_worker(rank: int, world: int, sched_dict: dict, unit_s: float, steps: int) -> dict:
    schedule = Schedule.from_dict(sched_dict)
    plan = PipelinePlan(schedule)
    comm = PipelineComm(plan, rank, timeout=120.0)
    problem = plan.problem
    runners = {}
    for name, res in plan.residents(rank).items():
        m = problem.models[res.model_idx]
        runners[name] = EmulatedStageRunner(
            m.forward[res.stage] * unit_s,
            m.backward[res.stage] * unit_s,
            is_first=res.stage == 0,
            is_last=res.stage == m.pipeline_stages - 1,
        )
    engine = PipelineEngine(plan, comm, runners, trace=True)
    serial = serial_streams(problem)
    group = plan.coords(rank)[1]

    def run_serial() -> None:
        for streams in serial:
            engine.run(None, stream=streams[group])
            comm.barrier("between the models of serial 1F1B")

    out: dict[str, list] = {"fused": [], "serial": [], "recv_wait": []}
    timed(comm, lambda: engine.run(None))  # warm-up: threads, connections
    timed(comm, run_serial)
    for _ in range(steps):
        out["fused"].append(timed(comm, lambda: engine.run(None)))
        tr = engine.last_trace
        out["recv_wait"].append(
            sum(e - s for a, s, e in tr.events if "RECV" in a) if tr is not None else 0.0
        )
        out["serial"].append(timed(comm, run_serial))
    comm.barrier("end")
    comm.close()
    return out


def bench_emulated(unit_ms: float, steps: int, solver: str, time_limit: float) -> list[dict]:
    rows = []
    for cfg in EMULATED:
        problem = Problem.from_dict(cfg["problem"])
        sched = plan_schedule(problem, solver, time_limit)
        res = run_ranks(
            emulated_worker,
            problem.stage_groups,
            sched.to_dict(),
            unit_ms / 1e3,
            steps,
            timeout=600,
        )
        fused = [span([r.value["fused"][i] for r in res]) for i in range(steps)]
        serial = [span([r.value["serial"][i] for r in res]) for i in range(steps)]
        pred_fused = sched.makespan * unit_ms / 1e3
        pred_serial = sched.baselines["serial_1f1b"]["makespan"] * unit_ms / 1e3
        f, s = statistics.median(fused), statistics.median(serial)
        row = {
            "config": cfg["name"],
            "solver": sched.solver,
            "ranks": problem.stage_groups,
            "unit_ms": unit_ms,
            "predicted_fused_s": pred_fused,
            "measured_fused_s": spread(fused),
            "fused_error": f / pred_fused - 1.0,
            "predicted_serial_s": pred_serial,
            "measured_serial_s": spread(serial),
            "serial_error": s / pred_serial - 1.0,
            "predicted_speedup": pred_serial / pred_fused,
            "measured_speedup": s / f,
            "speedup_ratio": (s / f) / (pred_serial / pred_fused),
            "recv_wait_s_per_rank": statistics.fmean(
                statistics.fmean(r.value["recv_wait"]) for r in res
            ),
        }
        row["pass"] = abs(row["fused_error"]) <= 0.10 and row["speedup_ratio"] >= 0.90
        rows.append(row)
        print(
            f"[emulated] {row['config']}: fused {f * 1e3:.1f} ms vs predicted "
            f"{pred_fused * 1e3:.1f} ms ({row['fused_error']:+.1%}); speedup "
            f"{row['measured_speedup']:.3f} vs predicted {row['predicted_speedup']:.3f} "
            f"({row['speedup_ratio']:.1%}) {'PASS' if row['pass'] else 'FAIL'}",
            flush=True,
        )
    return rows


# -- (b) real tiny models ---------------------------------------------------------------------------
REAL = [
    {"name": "N=2 llama actor 4L/h128 + critic 2L/h128, M=8", "groups": 2},
    {
        "name": "N=4 llama actor 4L/h128 + critic 2L/h128 (S2xK2), M=8",
        "groups": 4,
        "critic_stages": 2,
    },
]
REAL_MODELS = {"actor": ("llama", 4, 128), "critic": ("llama", 2, 128)}
REAL_MB, REAL_ROWS, REAL_LEN = 8, 2, 64


def real_batches(steps: int) -> list[dict]:
    return [
        make_experience(REAL_MB * REAL_ROWS, max_len=REAL_LEN, micro_batch_rows=REAL_ROWS, seed=s)
        for s in range(steps)
    ]


def real_worker(rank: int, world: int, cfg: dict, steps: int, solver: str, limit: float) -> dict:
    models = build_models(REAL_MODELS)
    loss_fns = default_loss_fns(
        __import__("rlhf_fusion.runtime", fromlist=["PPOConfig"]).PPOConfig()
    )
    n = cfg["groups"]
    critic_stages = cfg.get("critic_stages", n)
    structure = problem_from_profiles(
        [{"actor": (s, 1, 2), "critic": (s % critic_stages, 1, 2)} for s in range(n)],
        stage_groups=n,
        micro_batches=REAL_MB,
        actor_stages=n,
        critic_stages=critic_stages,
    )
    group = rank
    stages, runners = {}, {}
    for mi, _copy, stage in structure.residents(group):
        spec = structure.models[mi]
        st = partition_(models[spec.name], spec.name, stage, spec.pipeline_stages)
        stages[spec.name] = st
        runners[spec.name] = TrainStageRunner(st, loss_fns[spec.name] if st.is_last else None)
    batches = [split_micro_batches(b, REAL_MB) for b in real_batches(steps + 1)]
    # Profiling pass on the real stages (every micro-batch of one batch: lengths differ),
    # then the planner on the measured times.
    prof = {
        name: (st.stage, *profile_runner(runners[name], batches[0], repeats=3))
        for name, st in stages.items()
    }
    profiles: list[Any] = [None] * world
    dist.all_gather_object(profiles, prof)
    problem = problem_from_profiles(
        profiles,
        stage_groups=n,
        micro_batches=REAL_MB,
        actor_stages=n,
        critic_stages=critic_stages,
    )
    # Rank 0 plans and broadcasts: a time-limited search need not give every rank the same
    # order, and all ranks must run streams of one schedule.
    box: list[Any] = [plan_schedule(problem, solver, limit).to_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    sched = Schedule.from_dict(box[0])
    plan = PipelinePlan(sched)
    comm = PipelineComm(plan, rank, timeout=120.0)
    engine = PipelineEngine(plan, comm, runners, trace=True)
    serial = serial_streams(problem)
    opts = {k: torch.optim.AdamW(s.parameters(), lr=1e-4) for k, s in stages.items()}

    def finish() -> None:
        engine.sync_gradients()
        engine.clip_gradients({k: 1.0 for k in stages})
        for o in opts.values():
            o.step()
            o.zero_grad(set_to_none=True)

    def fused_step(mbs):  # noqa: ANN001, ANN202
        def run() -> None:
            t0 = time.perf_counter()
            engine.run(mbs)
            marks["schedule"] = (t0, time.perf_counter())
            finish()

        return run

    def serial_step(mbs):  # noqa: ANN001, ANN202
        def run() -> None:
            t0 = time.perf_counter()
            for streams in serial:
                engine.run(mbs, stream=streams[group])
                comm.barrier("between the models of serial 1F1B")
            marks["schedule"] = (t0, time.perf_counter())
            finish()

        return run

    marks: dict[str, tuple[float, float]] = {}
    timed(comm, fused_step(batches[0]))  # warm-up
    out: dict[str, Any] = {
        k: [] for k in ("fused", "fused_sched", "serial", "serial_sched", "busy")
    }
    for i in range(steps):
        out["fused"].append(timed(comm, fused_step(batches[1 + i])))
        out["fused_sched"].append(marks["schedule"])
        tr = engine.last_trace
        out["busy"].append(
            sum(e - s for a, s, e in tr.events if "RECV" not in a) if tr is not None else 0.0
        )
        out["serial"].append(timed(comm, serial_step(batches[1 + i])))
        out["serial_sched"].append(marks["schedule"])
    out["predicted_fused_ms"] = sched.makespan
    out["predicted_serial_ms"] = sched.baselines["serial_1f1b"]["makespan"]
    out["profiled_problem"] = problem.to_dict()
    out["solver"] = sched.solver
    comm.barrier("end")
    comm.close()
    return out


def reference_times(steps: int) -> list[float]:
    models = build_models(REAL_MODELS)
    from rlhf_fusion.runtime import PPOConfig

    loss_fns = default_loss_fns(PPOConfig())
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    batches = [split_micro_batches(b, REAL_MB) for b in real_batches(steps + 1)]
    times = []
    for i, mbs in enumerate(batches):
        t0 = time.perf_counter()
        reference_step(models, mbs, opts, loss_fns, max_grad_norm=1.0)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def bench_real(steps: int, solver: str, time_limit: float) -> dict:
    torch.set_num_threads(1)
    single = reference_times(steps)
    rows = []
    for cfg in REAL:
        res = run_ranks(real_worker, cfg["groups"], cfg, steps, solver, time_limit, timeout=900)

        def spans(key: str, res=res) -> list[float]:  # noqa: ANN001
            return [span([r.value[key][i] for r in res]) for i in range(steps)]

        fused, serial = spans("fused"), spans("serial")
        v0 = res[0].value
        row = {
            "config": cfg["name"],
            "ranks": cfg["groups"],
            "solver": v0["solver"],
            "fused_step_s": spread(fused),
            "fused_schedule_s": spread(spans("fused_sched")),
            "serial_step_s": spread(serial),
            "serial_schedule_s": spread(spans("serial_sched")),
            "busiest_rank_compute_s": spread(
                [max(r.value["busy"][i] for r in res) for i in range(steps)]
            ),
            "measured_speedup": statistics.median(serial) / statistics.median(fused),
            "predicted_fused_s": v0["predicted_fused_ms"] / 1e3,
            "predicted_serial_s": v0["predicted_serial_ms"] / 1e3,
            "predicted_speedup": v0["predicted_serial_ms"] / v0["predicted_fused_ms"],
            "profiled_problem": v0["profiled_problem"],
        }
        rows.append(row)
        print(
            f"[real] {row['config']}: fused step median {row['fused_step_s']['median'] * 1e3:.1f}"
            f" ms [{row['fused_step_s']['min'] * 1e3:.1f}, {row['fused_step_s']['max'] * 1e3:.1f}]"
            f", schedule part {row['fused_schedule_s']['median'] * 1e3:.1f} ms vs predicted "
            f"{row['predicted_fused_s'] * 1e3:.1f} ms; serial step "
            f"{row['serial_step_s']['median'] * 1e3:.1f} ms",
            flush=True,
        )
    return {"single_process_unpipelined_s": spread(single), "rows": rows}


# -- report -------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Fused pipeline runtime benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cpu_cores']} cores, GPU: {m['gpu'] or 'none'}; torch {m['torch']}, "
        f"Python {m['python']}. Command: `{report['command']}`.",
        "",
        "## (a) Emulated compute (each task sleeps its planned time; real gloo p2p between "
        "processes)",
        "",
        f"Unit: {report['emulated'][0]['unit_ms'] if report['emulated'] else '-'} ms per planner "
        "time unit. Pass: |fused error| <= 10% and measured speedup >= 90% of predicted.",
        "",
        "| config | solver | predicted fused (ms) | measured fused median [min, max] (ms) | error "
        "| predicted speedup | measured speedup | ratio | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["emulated"]:
        f = r["measured_fused_s"]
        lines.append(
            f"| {r['config']} | {r['solver']} | {r['predicted_fused_s'] * 1e3:.1f} | "
            f"{f['median'] * 1e3:.1f} [{f['min'] * 1e3:.1f}, {f['max'] * 1e3:.1f}] | "
            f"{r['fused_error']:+.1%} | {r['predicted_speedup']:.3f} | "
            f"{r['measured_speedup']:.3f} | {r['speedup_ratio']:.1%} | "
            f"{'yes' if r['pass'] else 'NO'} |"
        )
    real = report.get("real")
    if real:
        s = real["single_process_unpipelined_s"]
        lines += [
            "",
            "## (b) Real tiny models (CPU, gloo; processes share the 2 cores)",
            "",
            f"Llama-style Actor 4 layers and Critic 2 layers, hidden 128, {REAL_MB} micro-batches "
            f"of {REAL_ROWS} rows, up to {REAL_LEN} tokens. One process without pipelining: "
            f"median {s['median'] * 1e3:.1f} ms per optimizer step [{s['min'] * 1e3:.1f}, "
            f"{s['max'] * 1e3:.1f}].",
            "",
            "Step = schedule + gradient all-reduce, clipping and both optimizer steps; "
            '"schedule" is the part the planner predicts (from the profiling pass).',
            "",
            "| config | fused step median [min, max] (ms) | fused schedule (ms) | predicted "
            "fused (ms) | busiest rank compute (ms) | serial 1F1B step (ms) | serial schedule "
            "(ms) | predicted serial (ms) | measured speedup (step) | predicted speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in real["rows"]:
            f, fs, se, ss = (
                r["fused_step_s"],
                r["fused_schedule_s"],
                r["serial_step_s"],
                r["serial_schedule_s"],
            )
            lines.append(
                f"| {r['config']} | {f['median'] * 1e3:.1f} [{f['min'] * 1e3:.1f}, "
                f"{f['max'] * 1e3:.1f}] | {fs['median'] * 1e3:.1f} | "
                f"{r['predicted_fused_s'] * 1e3:.1f} | "
                f"{r['busiest_rank_compute_s']['median'] * 1e3:.1f} | {se['median'] * 1e3:.1f} "
                f"[{se['min'] * 1e3:.1f}, {se['max'] * 1e3:.1f}] | {ss['median'] * 1e3:.1f} | "
                f"{r['predicted_serial_s'] * 1e3:.1f} | {r['measured_speedup']:.3f} | "
                f"{r['predicted_speedup']:.3f} |"
            )
        lines += [
            "",
            "The prediction assumes each rank has a device of its own: the profiling pass keeps "
            "each stage's fastest time. Here the ranks share 2 cores (and the machine ran other "
            f"jobs: load average {report['machine']['load_average_1m_at_start']:.1f} at the start"
            f", {report.get('load_average_1m_at_end', float('nan')):.1f} at the end), so stages "
            "the schedule overlaps are time-sliced: with 2 ranks the schedule part lands near the "
            "prediction, with 4 ranks on 2 cores it takes about twice as long or more. These rows "
            "show the runtime training real partitioned models with a profiled schedule and how "
            "noisy the timing is; they do not measure the speedup a GPU per stage group gives.",
        ]
    lines += ["", "## GPU", "", report["gpu_note"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unit-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--real-steps", type=int, default=6)
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer steps, no files")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(argv)
    if args.markdown_only:
        report = json.loads((args.out / "fused_pipeline.json").read_text())
        (args.out / "fused_pipeline.md").write_text(markdown(report))
        return 0
    if args.quick:
        args.steps, args.real_steps, args.time_limit = 2, 2, 2.0
    report: dict[str, Any] = {
        "machine": machine(),
        "command": "python benchmarks/fused_pipeline.py " + " ".join(argv or sys.argv[1:]),
        "emulated": bench_emulated(args.unit_ms, args.steps, args.solver, args.time_limit),
    }
    if not args.skip_real:
        report["real"] = bench_real(args.real_steps, args.solver, args.time_limit)
    report["gpu_note"] = (
        f"Measured on {report['machine']['gpu']}: see the rows above."
        if report["machine"]["gpu"]
        else "Not measured: no GPU in this session (the runtime's NCCL path is untested here)."
    )
    report["load_average_1m_at_end"] = os.getloadavg()[0]
    ok = all(r["pass"] for r in report["emulated"])
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_pipeline.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "fused_pipeline.md").write_text(markdown(report))
        print(f"wrote {args.out / 'fused_pipeline.json'} and .md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
