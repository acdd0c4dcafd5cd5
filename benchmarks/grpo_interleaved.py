"""The GRPO demo's workload, fused and serial in the *same* two processes, alternating every
iteration: the load-controlled breakdown behind ``rlhf-fusion demo --algo grpo --compare``.

    python benchmarks/grpo_interleaved.py [--iterations 20]

``demo --compare`` runs fused and serial as separate runs, a minute apart; on a shared machine
the load moves in between, and its ratio moves with it (the training ratio it prints, the same
work in both modes, shows by how much). Here each rank holds two workers of the demo's config,
one fused and one serial, and every iteration runs both on the same prompts, the order
flipping each iteration, so the two see the same load within a second. Both start from the
same seed and train the same way, so they stay identical (the rewards are checked equal every
iteration).

Per iteration and mode it records rank 0's stage seconds (rollout: generation + Ref and reward
scoring; training), R_t's simulator bound, and per rank the decode steps' and the scoring
calls' wall and thread-CPU seconds (wall above CPU: the thread waited for a core). Writes
``results/grpo_interleaved.{json,md}``.

The two ``PPOWorker``s per rank are built directly (a process cannot hold two runs of
``rlhf-fusion train``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import grpo_loop  # noqa: E402  (the tail workload's model and config)
from _harness import write_results  # noqa: E402

# benchmarks/trl.py would shadow the trl library: keep this folder off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

KEYS = ("time/rollout", "time/training", "time/iteration", "objective/scores",
        "fusion/simulated_speedup", "fusion/rt", "response_length/mean",
        "response_length/max")


def _instrument() -> dict[str, float]:
    """Class-level timers (this rank process only) on decode steps and scoring batches."""
    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.rollout.rt_control import TimedBackend

    acc = dict.fromkeys(("decode", "decode_cpu", "scoring", "scoring_cpu"), 0.0)

    def timed(fn: Any, key: str) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            c, t = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t
                acc[key + "_cpu"] += time.thread_time() - c
        return run

    TimedBackend.step = timed(TimedBackend.step, "decode")  # type: ignore[method-assign]
    InferenceModels._score_batch = timed(  # type: ignore[method-assign]
        InferenceModels._score_batch, "scoring")
    return acc


def _yielding_scoring(worker: Any, pause_s: float) -> None:
    """The diagnostic of ``--serial-scoring-yield``: this worker's scorers block for
    ``pause_s`` before each micro-batch (the work is unchanged: the same batches, the same
    results), as the fused stream blocks on its queue between micro-batches."""
    scorers = [getattr(worker, "scorer", None), getattr(worker, "inference", None),
               *getattr(worker, "scorers", {}).values()]
    for sc in scorers:
        if sc is None:
            continue
        inner = sc._score_batch

        def paused(*a: Any, inner: Any = inner, **k: Any) -> Any:
            time.sleep(pause_s)
            return inner(*a, **k)

        sc._score_batch = paused


def rank_main(rank: int, world: int, cfgs: dict[str, Any], prompt_ids: list[list[int]],
              iterations: int, serial_yield: float) -> list[dict[str, Any]]:
    acc = _instrument()
    from rlhf_fusion.loop.iteration import PPOWorker

    workers = {m: PPOWorker(c) for m, c in cfgs.items()}
    if serial_yield:
        _yielding_scoring(workers["serial"], serial_yield)
    ppi = cfgs["fused"].generation.prompts_per_iteration
    rows = []
    for it in range(iterations):
        start = (it * ppi) % len(prompt_ids)
        prompts = [prompt_ids[(start + i) % len(prompt_ids)] for i in range(ppi)]
        row: dict[str, Any] = {"iteration": it, "load": os.getloadavg()[0]}
        for mode in (("fused", "serial") if it % 2 == 0 else ("serial", "fused")):
            for k in acc:
                acc[k] = 0.0
            m = workers[mode].iteration(prompts)
            metrics = m if isinstance(m, dict) else m.metrics
            row[mode] = {**{k: metrics[k] for k in KEYS if k in metrics}, **acc}
        rows.append(row)
    return rows


def tail_workload(iterations: int) -> tuple[dict[str, Any], list[str]]:
    """benchmarks/grpo_loop.py's long-tailed workload: its model (saved to a temporary
    folder), its prompts, and a fused and a serial config of it on 2 ranks."""
    import tempfile
    from pathlib import Path

    from rlhf_fusion.loop.config import RLHFConfig

    wl = grpo_loop.main_parser().parse_args(["fused-serial"])
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-interleaved-"))
    model = grpo_loop.model_dir(wl, root)
    cfgs = {m: RLHFConfig.from_dict(grpo_loop.loop_config(
        wl, model, "", world=2, fused=m == "fused", iterations=iterations)
        | {"prompts": None}) for m in ("fused", "serial")}
    return cfgs, list(grpo_loop.PROMPTS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--workload", choices=("demo", "tail"), default="demo",
                   help="demo: the GRPO demo's arithmetic; tail: benchmarks/grpo_loop.py's "
                        "long-tailed lengths (its default workload, its config)")
    p.add_argument("--serial-scoring-yield", type=float, default=0.0, metavar="SECONDS",
                   help="diagnostic: the serial worker's scoring blocks this long before each "
                        "micro-batch, as the fused stream does on its queue (e.g. 1e-4); "
                        "writes results/grpo_interleaved_yield.{json,md}")
    args = p.parse_args(argv)
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.loop.arithmetic import arithmetic_prompts
    from rlhf_fusion.loop.demo_grpo import WARMUP_ITERATIONS, grpo_demo_config
    from rlhf_fusion.loop.models import load_tokenizer

    if args.workload == "demo":
        cfgs = {"fused": grpo_demo_config(iterations=args.iterations),
                "serial": grpo_demo_config(iterations=args.iterations, serial=True)}
        prompts = arithmetic_prompts()
    else:
        cfgs, prompts = tail_workload(args.iterations)
    tok = load_tokenizer(cfgs["fused"].models)
    ids = [tok.encode(x) for x in prompts]
    load0 = os.getloadavg()[0]
    ranks = run_ranks(rank_main, 2, cfgs, ids, args.iterations, args.serial_scoring_yield,
                      collective_timeout=300, timeout=3600)
    per_rank_all = [r.value for r in sorted(ranks, key=lambda r: r.rank)]
    for row in per_rank_all[0]:
        if row["fused"]["objective/scores"] != row["serial"]["objective/scores"]:
            raise SystemExit(f"iteration {row['iteration']}: rewards differ between fused and "
                             "serial")
    # Iteration 0 is warm-up, as in demo --compare (WARMUP_ITERATIONS): the mode that runs
    # it first pays the processes' one-off costs (2.05 s against 0.11 s on a fresh 16-core VM).
    warm = min(WARMUP_ITERATIONS, args.iterations - 1)
    per_rank = [rows[warm:] for rows in per_rank_all]
    r0 = per_rank[0]
    first = {m: sum(r[m]["time/rollout"] for r in per_rank_all[0][:warm])
             for m in ("fused", "serial")}

    def train_s(x: dict[str, Any]) -> float:
        return x["time/training"]

    def tot(mode: str, fn: Any, rows: list[dict[str, Any]] = r0) -> float:
        return sum(fn(r[mode]) for r in rows)

    roll = {m: tot(m, lambda x: x["time/rollout"]) for m in ("fused", "serial")}
    train = {m: tot(m, train_s) for m in ("fused", "serial")}
    it_s = {m: tot(m, lambda x: x["time/iteration"]) for m in ("fused", "serial")}
    bound = (sum(r["fused"]["time/rollout"] * r["fused"].get("fusion/simulated_speedup", 1.0)
                 for r in r0) / roll["fused"])
    per_it = [r["serial"]["time/rollout"] / r["fused"]["time/rollout"] for r in r0]
    table = []
    for m in ("fused", "serial"):
        acc = {k: sum(tot(m, lambda x, k=k: x[k], rows) for rows in per_rank)
               for k in ("decode", "decode_cpu", "scoring", "scoring_cpu")}
        idle = max(2 * roll[m] - acc["decode"] - acc["scoring"], 0.0)
        table.append([m, f"{roll[m]:.2f}", f"{train[m]:.2f}", f"{it_s[m]:.2f}",
                      f"{acc['decode']:.2f} ({acc['decode_cpu']:.2f})",
                      f"{acc['scoring']:.2f} ({acc['scoring_cpu']:.2f})", f"{idle:.2f}"])
    ratios = {"rollout": roll["serial"] / roll["fused"],
              "training": train["serial"] / train["fused"],
              "iteration": it_s["serial"] / it_s["fused"]}
    payload = {"command": "python benchmarks/grpo_interleaved.py " + " ".join(sys.argv[1:]),
               "iterations": args.iterations, "load_start": load0,
               "load_end": os.getloadavg()[0], "ratios": ratios, "bound": bound,
               "median_iteration_rollout_ratio": statistics.median(per_it),
               "warmup_iterations": warm, "warmup_rollout_s": first, "rows": per_rank_all}
    notes = [
        f"serial/fused, summed over iterations {warm}-{args.iterations - 1}: rollout "
        f"**{ratios['rollout']:.3f}x** beside R_t's simulator bound **{bound:.3f}x** (each "
        f"iteration's bound weighted by its fused rollout); training (the same work in both "
        f"modes: the load control) {ratios['training']:.3f}x; iteration "
        f"{ratios['iteration']:.3f}x. Median over iterations of the rollout ratio "
        f"{statistics.median(per_it):.3f}x. Rewards equal in every iteration."
        + (f" Iteration 0 (warm-up, left out: the mode that runs first pays the processes' "
           f"one-off costs): fused {first['fused']:.2f} s, serial {first['serial']:.2f} s."
           if warm else ""),
        "decode / scoring: rank-seconds over both ranks, wall (thread CPU in brackets: wall "
        "above CPU is time the thread waited for a core); waiting: 2 x rollout - decode - "
        "scoring (a rank idle at a barrier, the migration, the stream, store polls).",
        f"2 processes (gloo), one torch thread each, on a shared {os.cpu_count()}-core machine; "
        f"1-minute load average {load0:.1f} at the start, {payload['load_end']:.1f} at the end.",
    ]
    if args.serial_scoring_yield:
        notes.append(f"Diagnostic run: the serial worker's scoring blocked "
                     f"{args.serial_scoring_yield * 1e3:g} ms before each micro-batch (the "
                     "same work; the fused stream blocks on its queue between micro-batches).")
    name = ("grpo_interleaved" + ("_tail" if args.workload == "tail" else "")
            + ("_yield" if args.serial_scoring_yield else ""))
    path, _ = write_results(name, payload, [(
        f"GRPO {args.workload} workload, fused and serial alternating per iteration in the same "
        "2 processes",
        ["mode", "rollout s (rank 0)", "training s", "iteration s", "decode s (CPU)",
         "scoring s (CPU)", "waiting s"], table)], notes=notes)
    print("\n".join(notes), file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
