"""R_t's simulator against the measured rollouts of the GRPO demo's workload, and where the fused
rollout loses what the simulator's bound allows.

    python benchmarks/grpo_simulator_check.py [--iterations 24] [--skip 6]

Each rank holds a fused and a serial worker of the demo's config; every iteration runs both on
the same prompts, the order flipping each iteration (as ``demo --algo grpo --compare`` does).
After each fused rollout the simulator (``simulate_serial``, ``simulate_fused``) runs on that
rollout's lengths with the costs the worker has fitted so far; the per-rank timelines are put on
one clock (``t0``). Per rollout (medians over the iterations after ``--skip``):

* simulated and measured trigger, generation ends, and scoring ends, serial and fused;
* the simulated ratio again with the scoring handed out in the rollout's micro-batches (4
  samples) instead of single samples: the part of the bound's gain that the micro-batches'
  end granularity leaves to any rollout of this workload, whatever its protocol costs;
* the *balanced* end: the measured trigger and destination generation end, the serial run's
  cost per scoring micro-batch, and the micro-batches split so both ranks end together (what a
  protocol costing nothing would reach);
* the fused run's losses against it: the freed rank's delay from its trigger to its first
  scoring call, its cost per micro-batch against the serial run's, the ranks' end imbalance.

Writes ``results/grpo_simulator_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import grpo_interleaved  # noqa: E402  (the tail workload)
from _harness import write_results  # noqa: E402

# benchmarks/trl.py would shadow the trl library: keep this folder off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def rank_main(rank: int, world: int, cfgs: dict[str, Any], prompt_ids: list[list[int]],
              iterations: int) -> list[dict[str, Any]]:
    import dataclasses

    import numpy as np

    from rlhf_fusion.loop.iteration import PPOWorker
    from rlhf_fusion.loop.run import prompts_for
    from rlhf_fusion.rollout.planning.simulate import simulate_fused, simulate_serial

    workers = {m: PPOWorker(c) for m, c in cfgs.items()}
    ppi = cfgs["fused"].generation.prompts_per_iteration
    rows = []
    for it in range(iterations):
        prompts = prompts_for(prompt_ids, it, ppi)
        row: dict[str, Any] = {"iteration": it}
        for mode in (("fused", "serial") if it % 2 == 0 else ("serial", "fused")):
            w = workers[mode]
            res = w.iteration(prompts)
            row[mode] = {"ranks": res.timeline["ranks"],
                         "rollout_s": res.timeline["rollout"][1] - res.timeline["rollout"][0],
                         "scores": res.metrics["objective/scores"]}
            if mode == "fused" and rank == 0:
                exps = sorted(res.experiences, key=lambda e: e.sample_id)
                lengths = np.asarray([len(e.response_ids) for e in exps])
                rt = res.timeline["ranks"][0].get("rt")
                c = w.rt_planner.cluster()
                total, gen, _ = simulate_serial(lengths, c)
                f = simulate_fused(lengths, c, rt) if rt else None
                # the same costs, the scoring handed out in the rollout's micro-batches
                fm = (simulate_fused(lengths, c, rt, micro_batch=w.inference.micro_batch)
                      if rt and w.inference is not None else None)
                # The serial run again, its decode steps priced by the serial worker's own
                # fit (its steps: every rank decoding beside a decoding peer), the scoring as
                # above: the planner fits the fused worker's steps, whose small batches are
                # the consolidated tail's, beside the freed rank's scoring.
                cs = workers["serial"].rt_planner.cluster()
                own, own_gen, _ = simulate_serial(lengths, dataclasses.replace(
                    c, step_base_s=cs.step_base_s, step_per_sample_s=cs.step_per_sample_s,
                    prefill_per_token_s=cs.prefill_per_token_s))
                row["sim"] = {"serial_s": total, "serial_generation_s": gen,
                              "serial_own_fit_s": own, "serial_own_fit_generation_s": own_gen,
                              "fused_s": f.fused_s if f else None,
                              "fused_micro_batched_s": fm.fused_s if fm else None,
                              "fused_generation_s": f.fused_generation_s if f else None,
                              "trigger_s": f.trigger_s if f else None,
                              "cluster": dataclasses.asdict(c)}
        rows.append(row)
    return rows


OWN_FIT_RATIO = "sim ratio, serial's decode fit"


def measure(row: dict[str, Any]) -> dict[str, float] | None:
    """One iteration's simulated and measured milestones (ms) and the loss budget."""
    fr, sr, sim = row["fused"]["ranks"], row["serial"]["ranks"], row.get("sim")
    if not sim or sim["fused_s"] is None or not fr[0].get("destinations"):
        return None
    dest = fr[0]["destinations"][0]
    src = next(r for r in range(len(fr)) if r != dest)

    def at(ranks: list[dict[str, Any]], r: int, key: str) -> float:
        """Rank r's event on the earliest rank's clock, in ms."""
        return (ranks[r]["t0"] - min(x["t0"] for x in ranks) + ranks[r][key]) * 1e3

    serial_end = max(at(sr, r, "local_end_s") for r in range(len(sr)))
    fused_end = max(at(fr, r, "local_end_s") for r in range(len(fr)))
    per_batch = [(at(sr, r, "local_end_s") - at(sr, r, "inference_start_s"))
                 / sr[r]["scoring_batches"] for r in range(len(sr))]
    batches = sum(x["scoring_batches"] for x in sr)
    trigger, src_start = at(fr, src, "trigger_s"), at(fr, src, "inference_start_s")
    dest_gen = at(fr, dest, "generation_end_s")
    balanced = (trigger + dest_gen + statistics.fmean(per_batch) * batches) / 2
    return {
        "sim trigger": sim["trigger_s"] * 1e3, "trigger": trigger,
        "sim serial generation end": sim["serial_generation_s"] * 1e3,
        "serial generation end": max(at(sr, r, "generation_end_s") for r in range(len(sr))),
        "sim fused generation end": sim["fused_generation_s"] * 1e3,
        "fused generation end": dest_gen,
        "sim serial end": sim["serial_s"] * 1e3, "serial end": serial_end,
        "sim fused end": sim["fused_s"] * 1e3, "fused end": fused_end,
        # the serial run's scoring, from its last generation end to its end: how well the
        # planner's fit prices the scoring of this batch's lengths
        "sim serial scoring": (sim["serial_s"] - sim["serial_generation_s"]) * 1e3,
        "serial scoring": serial_end - max(at(sr, r, "generation_end_s") for r in range(len(sr))),
        "sim ratio": sim["serial_s"] / sim["fused_s"], "ratio": serial_end / fused_end,
        "sim ratio, micro-batched": sim["serial_s"] / (sim.get("fused_micro_batched_s")
                                                       or sim["fused_s"]),
        "sim serial generation end, serial fit": sim.get("serial_own_fit_generation_s",
                                                         math.nan) * 1e3,
        OWN_FIT_RATIO: sim.get("serial_own_fit_s", math.nan)
        / sim["fused_s"],
        "window ratio": row["serial"]["rollout_s"] / row["fused"]["rollout_s"],
        "balanced end": balanced,
        "balanced ratio": serial_end / balanced,
        "freed rank: trigger to scoring": src_start - trigger,
        "serial ms per micro-batch": statistics.fmean(per_batch),
        "freed rank ms per micro-batch": (at(fr, src, "local_end_s") - src_start)
        / fr[src]["scoring_batches"],
        "end imbalance": abs(at(fr, 0, "local_end_s") - at(fr, 1, "local_end_s")),
        # The serial run splits scoring statically (each rank its own shard): ranks that score
        # at different speeds end apart, where the fused stream hands the slower one less.
        "serial end imbalance": abs(at(sr, 0, "local_end_s") - at(sr, 1, "local_end_s")),
        "serial ranks scoring speed ratio": max(per_batch) / min(per_batch),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--skip", type=int, default=6,
                   help="leading iterations left out of the medians (the fits settle)")
    p.add_argument("--workload", choices=("demo", "tail"), default="demo",
                   help="demo: the GRPO demo's arithmetic; tail: benchmarks/grpo_loop.py's "
                        "long-tailed lengths (as grpo_interleaved.py --workload tail); results "
                        "go to grpo_simulator_check_tail")
    p.add_argument("--baseline", choices=("balanced", "static"), default="balanced",
                   help="the serial worker: balanced (its ranks balance their scoring through "
                        "the stream, as the fused rollout's do: the bar's baseline) or static "
                        "(each rank scores its own samples; the checks before session 47)")
    p.add_argument("--rt", default=None,
                   help="the fused worker's R_t (a fraction of the batch, or auto) instead of "
                        "the demo's; results go to grpo_simulator_check_rt<R_t>")
    p.add_argument("--hidden", type=int, default=None,
                   help="the demo workload's Actor (and Ref) hidden size instead of the demo's; "
                        "results go to grpo_simulator_check_h<hidden>_l<layers>")
    p.add_argument("--layers", type=int, default=None, help="likewise, its layers")
    args = p.parse_args(argv)
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.loop.arithmetic import arithmetic_prompts
    from rlhf_fusion.loop.demo_grpo import grpo_demo_config
    from rlhf_fusion.loop.models import load_tokenizer

    name = "grpo_simulator_check"
    if args.workload == "demo":
        cfgs = {"fused": grpo_demo_config(iterations=args.iterations),
                "serial": grpo_demo_config(iterations=args.iterations, serial=True)}
        prompts = arithmetic_prompts()
    else:
        cfgs, prompts = grpo_interleaved.tail_workload(args.iterations)
        name += "_tail"
    if args.hidden or args.layers:
        if args.workload != "demo":
            raise SystemExit("--hidden/--layers change the demo workload's model only")
        for c in cfgs.values():
            c.models.actor.update({k: v for k, v in (("hidden", args.hidden),
                                                     ("layers", args.layers)) if v})
        name += "_h{hidden}_l{layers}".format(**cfgs["fused"].models.actor)
    cfgs["serial"].fusion.balance_scoring = args.baseline == "balanced"
    if args.baseline == "static":
        name += "_static"
    if args.rt is not None:
        cfgs["fused"].fusion.rt = args.rt if args.rt == "auto" else float(args.rt)
        name += f"_rt{args.rt}"
    tok = load_tokenizer(cfgs["fused"].models)
    ids = [tok.encode(x) for x in prompts]
    ranks = run_ranks(rank_main, 2, cfgs, ids, args.iterations, collective_timeout=300,
                      timeout=3600)
    rows = next(r.value for r in ranks if r.rank == 0)
    for row in rows:
        if row["fused"]["scores"] != row["serial"]["scores"]:
            raise SystemExit(f"iteration {row['iteration']}: rewards differ between fused and "
                             "serial")
    got = [m for m in (measure(r) for r in rows[args.skip:]) if m is not None]
    if not got:
        raise SystemExit("no fused rollout migrated after --skip: nothing to compare")
    med = {k: statistics.median(m[k] for m in got) for k in got[0]}
    pairs = [("trigger", "sim trigger"),
             ("serial generation end", "sim serial generation end"),
             ("fused generation end", "sim fused generation end"),
             ("serial scoring", "sim serial scoring"),
             ("serial end", "sim serial end"), ("fused end", "sim fused end"),
             ("ratio", "sim ratio")]
    # The bound's gain that the scoring's micro-batches leave to any rollout: the simulator
    # with the same costs, scoring handed out 4 samples at a time instead of one.
    mb_share = ((med["sim ratio, micro-batched"] - 1) / (med["sim ratio"] - 1)
                if med["sim ratio"] > 1 else None)
    table = [[k, f"{med[s]:.3f}" if k == "ratio" else f"{med[s]:.1f}",
              f"{med[k]:.3f}" if k == "ratio" else f"{med[k]:.1f}"] for k, s in pairs]
    three = ("balanced ratio", "serial ranks scoring speed ratio")
    budget = [[k, f"{med[k]:.3f}" if k in three else f"{med[k]:.2f}"] for k in (
        "balanced end", "balanced ratio", "freed rank: trigger to scoring",
        "serial ms per micro-batch", "freed rank ms per micro-batch", "end imbalance",
        "serial end imbalance", "serial ranks scoring speed ratio")]
    notes = [f"{len(got)} fused rollouts with a migration (iterations {args.skip}-"
             f"{args.iterations - 1}), medians; serial: {args.baseline} scoring; rewards "
             f"equal in every iteration; window ratio "
             f"(the rollout as the demo times it) {med['window ratio']:.3f}x; balanced ratio: "
             "serial end / balanced end.",
             f"sim ratio with the scoring in the rollout's micro-batches: "
             f"{med['sim ratio, micro-batched']:.3f}"
             + (f" ({mb_share:.0%} of the per-sample simulation's gain)"
                if mb_share is not None else ""),
             f"serial generation end with the serial worker's own decode fit: sim "
             f"{med['sim serial generation end, serial fit']:.1f} (measured "
             f"{med['serial generation end']:.1f}); sim ratio with it "
             f"{med[OWN_FIT_RATIO]:.3f}"]
    for line in (*notes, *(f"{a}: sim {b} / measured {c}" for a, b, c in table),
                 *(f"{a}: {b}" for a, b in budget)):
        print(line)
    command = " ".join(["python benchmarks/grpo_simulator_check.py",
                        *(argv if argv is not None else sys.argv[1:])])
    write_results(name, {"command": command, "baseline": args.baseline,
                         "iterations": args.iterations, "skip": args.skip,
                                           "medians": med, "per_iteration": got, "rows": rows},
                  [("Milestones per rollout (ms; ratio: serial/fused at the scoring end)",
                    ["", "simulator", "measured"], table),
                   ("The fused rollout against a balanced split (ms)", ["", "median"], budget)],
                  notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
