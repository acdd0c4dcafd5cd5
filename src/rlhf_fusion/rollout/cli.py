"""`rlhf-fusion tune-migration`: simulate R_t over 5%-95% of the batch and print the choice
(R_t, the destinations m and the mechanism). Its old name `plan-migration` is a hidden alias
for one release.

The top-level CLI adds the sub-command to its sub-parsers with
:func:`add_tune_migration_parser` and calls :func:`run_tune_migration`;
:func:`tune_migration_main` is the same as a program of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .planning.lengths import LengthDistribution
from .planning.presets import PRESETS
from .planning.simulate import MigrationPlan, plan_migration, rt_grid
from .types import RolloutConfigError

_CLUSTER_FLAGS = {
    # flag: (ClusterModel field, scale from the flag's unit to the field's unit, help)
    "instances": ("instances", None, "generation instances"),
    "bs_max": ("bs_max", None, "max samples decoding together on one instance (BS_max)"),
    "kv_capacity_tokens": ("kv_capacity_tokens", 1.0, "KV cache capacity of one instance, "
                                                      "tokens (C)"),
    "kv_bytes_per_token": ("kv_bytes_per_token", 1.0, "KV bytes per token (all layers)"),
    "step_base_ms": ("step_base_s", 1e-3, "decode step time independent of the batch, ms"),
    "step_per_sample_us": ("step_per_sample_s", 1e-6, "decode step time per running sample, us"),
    "step_per_kv_token_ns": ("step_per_kv_token_s", 1e-9, "decode step time per KV token, ns"),
    "prefill_per_token_us": ("prefill_per_token_s", 1e-6, "prefill time per token, us"),
    "infer_per_token_us": ("infer_per_token_s", 1e-6, "Ref+Reward+Critic forward per token on "
                                                      "one instance, us"),
    "bandwidth_gbs": ("bandwidth_bytes_s", 1e9, "KV transfer bandwidth, GB/s"),
    "latency_ms": ("latency_s", 1e-3, "KV transfer latency, ms"),
    "prompt_len": ("prompt_len", None, "prompt length, tokens"),
}


def add_tune_migration_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the tune-migration options to ``parser`` (a sub-parser or a fresh one)."""
    parser.add_argument("--preset", default="llama13b-h100x64", choices=sorted(PRESETS),
                        help="cluster and workload to start from (flags below override it)")
    g = parser.add_argument_group("response lengths (default: the preset's lognormal)")
    g.add_argument("--lengths", type=Path, help="profiled lengths: JSON list, "
                   '{"lengths": [...], "weights": [...]}, or .npy')
    g.add_argument("--median", type=float, help="lognormal median response length")
    g.add_argument("--sigma", type=float, help="lognormal sigma (1.0: p99 ~ 10x median)")
    g.add_argument("--max-len", type=int, help="max response length (max_new_tokens)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--batch-size", type=int, help="samples per iteration")
    for flag, (_, _, text) in _CLUSTER_FLAGS.items():
        c.add_argument("--" + flag.replace("_", "-"), type=float, help=text)
    s = parser.add_argument_group("search")
    s.add_argument("--points", type=int, default=19, help="R_t values between 5%% and 95%%")
    s.add_argument("--trials", type=int, default=4, help="batches drawn per R_t")
    s.add_argument("--seed", type=int, default=0, help="seed of the drawn batches")
    o = parser.add_argument_group("output")
    o.add_argument("--plot", type=Path, help="write the curve as a PNG")
    o.add_argument("--json", type=Path, help="write the curve and the choice as JSON")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _build(args: argparse.Namespace) -> tuple[LengthDistribution, object, int]:
    preset = PRESETS[args.preset]
    if args.lengths is not None:
        dist = LengthDistribution.load(args.lengths)
    else:
        dist = LengthDistribution.lognormal(
            args.median if args.median is not None else preset.median_len,
            args.sigma if args.sigma is not None else preset.sigma,
            max_len=args.max_len if args.max_len is not None else preset.max_len)
    changes = {}
    for flag, (name, scale, _) in _CLUSTER_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            changes[name] = int(value) if scale is None else value * scale
    cluster = replace(preset.cluster, **changes)
    batch = args.batch_size if args.batch_size is not None else preset.batch_size
    return dist, cluster, batch


def format_plan(plan: MigrationPlan) -> str:
    lines = [f"{'R_t':>6} {'% batch':>8} {'m':>4} {'fused s':>9} {'serial s':>9} "
             f"{'speedup':>8}  mechanism"]
    for p in plan.sweep.points:
        mark = "  <- best" if p.rt == plan.rt else ""
        if math.isfinite(p.fused_s):
            lines.append(f"{p.rt:>6} {100 * p.fraction:>7.1f}% {p.m:>4} {p.fused_s:>9.2f} "
                         f"{p.serial_s:>9.2f} {p.speedup:>7.3f}x  {p.mechanism}{mark}")
        else:
            lines.append(f"{p.rt:>6} {100 * p.fraction:>7.1f}% {p.m:>4} {'-':>9} "
                         f"{p.serial_s:>9.2f} {'-':>8}  infeasible: m >= instances")
    lines.append("")
    lines.append(f"choice: R_t = {plan.rt} ({100 * plan.fraction:.0f}% of the batch), "
                 f"m = {plan.m} destination instances, mechanism = {plan.mechanism} "
                 f"({plan.mechanism_reason})")
    lines.append(f"expected generation + inference: {plan.fused_s:.2f} s fused vs "
                 f"{plan.serial_s:.2f} s serial ({plan.speedup:.3f}x)")
    return "\n".join(lines)


def plot_plan(plan: MigrationPlan, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = plan.sweep.points
    ok = [p for p in pts if math.isfinite(p.fused_s)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([100 * p.fraction for p in ok], [p.fused_s for p in ok], "o-", label="fused")
    ax.axhline(pts[0].serial_s, color="gray", ls="--", label="serial")
    bad = [100 * p.fraction for p in pts if not math.isfinite(p.fused_s)]
    if bad:
        ax.axvspan(min(bad), max(bad), color="red", alpha=0.08, label="infeasible (m >= n)")
    ax.plot([100 * plan.fraction], [plan.fused_s], "r*", ms=14,
            label=f"best: R_t={100 * plan.fraction:.0f}%, m={plan.m}")
    ax.set_xlabel("migration threshold R_t (% of the batch)")
    ax.set_ylabel("generation + inference (s)")
    ax.set_title(title or "simulated R_t sweep")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_tune_migration(args: argparse.Namespace) -> int:
    try:
        dist, cluster, batch = _build(args)
        plan = plan_migration(dist, cluster, batch, grid=rt_grid(batch, points=args.points),
                              trials=args.trials, seed=args.seed, progress=not args.quiet)
    except RolloutConfigError as exc:
        print(f"rlhf-fusion tune-migration: error: {exc}", file=sys.stderr)
        return 2
    print(f"lengths: median {dist.median:.0f}, p99/median {dist.tail_ratio:.1f}; batch {batch}, "
          f"{cluster.instances} instances, BS_max {cluster.bs_max}, "
          f"C {cluster.kv_capacity_tokens} KV tokens")
    print(format_plan(plan))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cluster": cluster.to_dict(), "batch_size": batch,
                                         "plan": plan.to_dict()}, indent=2))
    if args.plot is not None:
        plot_plan(plan, args.plot)
        print(f"plot: {args.plot}")
    return 0


def tune_migration_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `rlhf-fusion tune-migration`; returns the exit status."""
    parser = add_tune_migration_parser(argparse.ArgumentParser(
        prog="rlhf-fusion tune-migration",
        description="Simulate inter-stage fusion over R_t = 5%..95% of the batch and choose "
                    "R_t, the number of destination instances m and the migration mechanism."))
    return run_tune_migration(parser.parse_args(argv))


# The names before `plan-migration` became `tune-migration` (one release).
plan_migration_main = tune_migration_main
add_plan_migration_parser = add_tune_migration_parser
run_plan_migration = run_tune_migration

if __name__ == "__main__":
    raise SystemExit(tune_migration_main())
