"""``demo --algo grpo --compare`` with a larger Actor (and Ref): does the fused rollout's share of
the simulator's bound grow when a decode step and a scoring call cost more than the protocol's
fixed per-rollout costs?

    python benchmarks/grpo_model_scale.py --hidden 256 --layers 4 [--pairs 5] [--iterations 40]

The demo's workload and comparison (``rlhf_fusion.loop.demo_grpo``: fused, static serial and
balanced serial workers interleaved iteration by iteration in the same two processes, rewards
checked equal, iteration 0 left out), with the demo's Llama Actor widened and deepened; the Ref
is a copy of the Actor, as in the demo. Per pair: the balanced serial / fused rollout ratio, the
simulator's bound for the run's own lengths and timings, the share of the bound's gain reached,
the ratio against the static split and the training ratio (the same work in every mode: the
load control).

Writes ``results/grpo_model_scale_h<hidden>_l<layers>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _harness import write_results  # noqa: E402

# benchmarks/trl.py would shadow the trl library: keep this folder off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _share(g: float | None) -> str:
    return "-" if g is None else f"{g:.0%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=40)
    args = ap.parse_args(argv)

    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.loop.arithmetic import arithmetic_prompts
    from rlhf_fusion.loop.demo_grpo import (
        WARMUP_ITERATIONS,
        grpo_demo_config,
        interleaved_rank,
        pair_row,
        run_times,
    )
    from rlhf_fusion.loop.models import load_tokenizer

    def config(**kw: Any) -> Any:
        c = grpo_demo_config(iterations=args.iterations, **kw)
        c.models.actor.update(hidden=args.hidden, layers=args.layers)
        return c

    cfgs = {"fused": config(), "serial": config(serial=True),
            "balanced": config(serial=True, balance_scoring=True)}
    tok = load_tokenizer(cfgs["fused"].models)
    prompt_ids = [tok.encode(x) for x in arithmetic_prompts()]
    modes = list(cfgs)
    rows = []
    for pair in range(args.pairs):
        first = modes[pair % len(modes)]
        ranks = run_ranks(interleaved_rank, cfgs["fused"].world_size, cfgs, prompt_ids, first,
                          collective_timeout=300, timeout=3600)
        hist = next(r.value for r in ranks if r.rank == 0)
        scores = {m: json.dumps([h["objective/scores"] for h in hist[m]]) for m in modes}
        if len(set(scores.values())) != 1:
            raise SystemExit(f"pair {pair}: the modes' rewards differ")
        got = {m: run_times(hist[m], WARMUP_ITERATIONS) for m in modes}
        row = pair_row(pair, first, got["fused"], got["serial"], got["balanced"])
        rows.append({k: row[k] for k in ("pair", "first", "rollout_ratio", "bound",
                                         "gain_of_bound", "static_rollout_ratio",
                                         "training_ratio")}
                    | {"fused_rollout_s": got["fused"]["rollout_s"],
                       "balanced_rollout_s": got["balanced"]["rollout_s"]})
        print(f"pair {pair}: rollout {row['rollout_ratio']:.3f}x, bound {row['bound']:.3f}x "
              f"({_share(row['gain_of_bound'])} of its gain), static split "
              f"{row['static_rollout_ratio']:.3f}x, training {row['training_ratio']:.3f}x, "
              f"fused rollouts {got['fused']['rollout_s']:.2f} s", flush=True)
    med = statistics.median(r["rollout_ratio"] for r in rows)
    bound = statistics.median(r["bound"] for r in rows)
    share = _share((med - 1) / (bound - 1) if bound > 1 else None)
    print(f"median rollout {med:.3f}x against a bound of {bound:.3f}x: {share} of the bound's "
          "gain; rewards equal in every iteration")
    name = f"grpo_model_scale_h{args.hidden}_l{args.layers}"
    command = " ".join(["python benchmarks/grpo_model_scale.py",
                        *(argv if argv is not None else sys.argv[1:])])
    table = [[str(r["pair"]), r["first"], f"{r['rollout_ratio']:.3f}", f"{r['bound']:.3f}",
              _share(r["gain_of_bound"]), f"{r['static_rollout_ratio']:.3f}",
              f"{r['training_ratio']:.3f}", f"{r['fused_rollout_s']:.2f}"] for r in rows]
    write_results(name, {"command": command, "cores": os.cpu_count(),
                         "model": {"hidden": args.hidden, "layers": args.layers},
                         "iterations": args.iterations, "rows": rows,
                         "median_rollout_ratio": med, "median_bound": bound},
                  [("balanced serial / fused rollout per pair (iterations 1 on)",
                    ["pair", "first", "rollout", "bound", "of its gain", "static split",
                     "training", "fused rollouts s"], table)],
                  [f"median {med:.3f}x against {bound:.3f}x; the demo's workload with a Llama "
                   f"Actor/Ref of hidden {args.hidden}, {args.layers} layers."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
