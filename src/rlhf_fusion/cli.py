"""The ``rlhf-fusion`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# The RLHFuse Table 3 setting "33B/13B PP 8/4 GBS 8" in the planner's cost model: a small
# problem the demo solves to the bound in seconds.
DEMO_PROBLEM = {
    "name": "demo: 33B actor PP8 + 13B critic PP4 x2, global batch 8",
    "stage_groups": 8,
    "models": [
        {"name": "actor", "pipeline_stages": 8, "copies": 1, "micro_batches": 8,
         "forward": 5, "backward": 10, "activation": 1.95, "direction": "forward"},
        {"name": "critic", "pipeline_stages": 4, "copies": 2, "micro_batches": 4,
         "forward": 4, "backward": 8, "activation": 2.0, "direction": "reverse"},
    ],
}


def _table(schedule) -> str:
    serial = schedule.baselines["serial_1f1b"]
    rows = [
        ("makespan", f"{schedule.makespan:g}"),
        ("speedup vs serial 1F1B", f"{schedule.speedup():.3f}x  (serial {serial['makespan']:g})"),
        ("speedup vs greedy", f"{schedule.speedup('greedy'):.3f}x  "
                              f"(greedy {schedule.baselines['greedy']['makespan']:g})"),
        ("lower bound", f"{schedule.lower_bound:g}"),
        ("gap to bound", f"{100 * schedule.gap:.2f}%" + ("  (optimal)" if schedule.optimal else "")),
        ("peak activation", f"{schedule.peak_activation:.4g}  "
                            f"({schedule.peak_ratio():.2f}x serial {serial['peak_activation']:.4g})"),
        ("solver", schedule.solver),
        ("seconds", f"{schedule.seconds:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _solve_with_progress(problem, solver: str, time_limit: float, workers: int | None, quiet: bool):
    from tqdm import tqdm

    from .schedule import solve

    if quiet or solver in ("greedy", "concatenated_1f1b"):
        return solve(problem, solver, time_limit=time_limit, workers=workers)
    bar = tqdm(total=100, desc=f"{solver} search", unit="%", file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")

    def progress(phase: str, fraction: float, makespan) -> None:
        bar.n = int(100 * fraction)
        bar.set_postfix_str(f"{phase}: makespan {makespan:g}")

    try:
        return solve(problem, solver, time_limit=time_limit, workers=workers, progress=progress)
    finally:
        bar.n = 100
        bar.close()


def cmd_schedule(args: argparse.Namespace) -> int:
    from .schedule import Problem, ProblemError

    try:
        problem = Problem.from_json(args.problem)
        if args.memory_capacity is not None:
            problem = problem.with_capacity(args.memory_capacity)
        schedule = _solve_with_progress(problem, args.solver, args.time_limit, args.workers, args.quiet)
    except ProblemError as exc:
        print(f"rlhf-fusion schedule: error: {exc}", file=sys.stderr)
        return 2
    print(f"{problem.name or args.problem}")
    print(_table(schedule))
    if args.out:
        schedule.save(args.out)
        print(f"  schedule written to {args.out}")
    if args.plot:
        from .schedule.plot import plot_schedule

        plot_schedule(schedule, args.plot)
        print(f"  plot written to {args.plot}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .loop.demo import run_demo

    run_demo(args.out, iterations=args.iterations, serial=args.serial)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .launch import RunInterrupted, exit_promptly, raise_on_signals
    from .loop import LoopConfigError, RLHFConfig, load_prompts, train
    from .loop.checkpoint import complete_checkpoints
    from .loop.demo import demo_prompts

    raise_on_signals()  # SIGTERM/SIGINT: stop every rank, keep the last complete checkpoint
    try:
        cfg = RLHFConfig.from_file(args.config)
        if args.iterations is not None:
            cfg.iterations = args.iterations
        prompts = load_prompts(cfg.prompts) if cfg.prompts else demo_prompts()
        train(cfg, prompts, out_dir=args.out, checkpoint_every=args.checkpoint_every,
              resume=args.resume, overwrite=args.overwrite,
              keep_checkpoints=args.keep_checkpoints)
    except LoopConfigError as exc:
        print(f"rlhf-fusion train: error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        done = complete_checkpoints(args.out)
        where = (f"the last complete checkpoint is {done[-1][1]}; continue with --resume"
                 if done else "no checkpoint was complete")
        print(f"\nrlhf-fusion train: {exc}; every rank stopped, {where}", file=sys.stderr)
        exit_promptly(128 + exc.signum)
    return 0


def cmd_plan_demo(args: argparse.Namespace) -> int:
    from .schedule import Problem
    from .schedule.plot import plot_schedule

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problem = Problem.from_dict(DEMO_PROBLEM)
    (out / "problem.json").write_text(json.dumps(DEMO_PROBLEM, indent=1) + "\n")
    print(f"Planning a fused Actor/Critic pipeline schedule for: {problem.name}")
    schedule = _solve_with_progress(problem, "auto", args.time_limit, None, False)
    print(_table(schedule))
    schedule.save(out / "schedule.json")
    plot_schedule(schedule, out / "schedule.png")
    streams = schedule.instruction_streams()
    print(f"  rank 0 runs {len(streams[0])} instructions, starting: "
          + " ".join(str(a) for a in streams[0][:6]) + " ...")
    print(f"  wrote {out / 'problem.json'}, {out / 'schedule.json'}, {out / 'schedule.png'}")
    return 0


def cmd_profile_layers(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    from .runtime.layer_profile import profile_config

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        print(f"rlhf-fusion profile-layers: error: {args.model}: {exc}\n(give a local model "
              "directory or a Hub id; only its config is read, weights are not needed)",
              file=sys.stderr)
        return 2
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(desc="profile-layers", unit="pass", file=sys.stderr,
                   total=len(set(args.tokens)) * (args.repeats + 1))

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        prof = profile_config(config, lm_head=args.head == "lm", dtype=dtype,
                              tokens=args.tokens, seq_len=args.seq_len, repeats=args.repeats,
                              device=device, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    prof["model"] = args.model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1) + "\n")
    print(f"{args.model}: {prof['layers']} layers, {prof['dtype']} on {prof['device']}")
    print(f"{'tokens':>8}  {'forward ms/layer':>16}  {'backward ms/layer':>17}  "
          f"{'rest fwd/bwd ms':>15}")
    for k in prof["forward"]:
        print(f"{k:>8}  {1e3 * prof['forward'][k]:16.3f}  {1e3 * prof['backward'][k]:17.3f}  "
              f"{1e3 * prof['rest_forward'][k]:7.3f}/{1e3 * prof['rest_backward'][k]:.3f}")
    print(f"wrote {out} (plan config: profiles: {{actor: {out}}})")
    return 0


def cmd_openrlhf(args: argparse.Namespace) -> int:
    from .integrations.openrlhf.launch import main as openrlhf_main

    return openrlhf_main(args.openrlhf_argv)


def build_parser() -> argparse.ArgumentParser:
    from .schedule import SOLVERS

    parser = argparse.ArgumentParser(prog="rlhf-fusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schedule", help="find a fused Actor/Critic pipeline schedule")
    p.add_argument("problem", help="problem JSON (see docs/architecture.md), or a schedule/table3 entry")
    p.add_argument("--solver", default="auto", choices=SOLVERS)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for the search")
    p.add_argument("--memory-capacity", type=float, default=None,
                   help="activation memory capacity per group (overrides the problem's)")
    p.add_argument("--workers", type=int, default=None, help="processes/threads (default: all cores)")
    p.add_argument("--out", help="write the schedule JSON (with instruction streams) here")
    p.add_argument("--plot", help="write a timeline + memory PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_schedule)

    d = sub.add_parser("demo", help="PPO on tiny models, 2 CPU processes, every plugin on")
    d.add_argument("--out", default="rlhf-fusion-demo", help="output directory")
    d.add_argument("--iterations", type=int, default=24)
    d.add_argument("--serial", action="store_true",
                   help="the serial baseline (no inter- or intra-stage fusion)")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="run PPO from a YAML/JSON config (models, prompts, knobs)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("config", help="RLHFConfig as YAML or JSON (see docs/loop.md)")
    t.add_argument("--out", default="rlhf-fusion-run", help="metrics and checkpoints go here")
    t.add_argument("--iterations", type=int, default=None, help="override config.iterations")
    t.add_argument("--checkpoint-every", type=int, default=1,
                   help="iterations per checkpoint (0: none)")
    t.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="keep the newest K checkpoints, delete older ones (0: keep all)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="start over in a non-empty --out (deletes its metrics and checkpoints)")
    t.set_defaults(func=cmd_train)

    pd = sub.add_parser("plan-demo", help="plan a fused schedule for a built-in setting, plot it")
    pd.add_argument("--out-dir", default="rlhf-fusion-plan-demo")
    pd.add_argument("--time-limit", type=float, default=20.0)
    pd.set_defaults(func=cmd_plan_demo)

    from .rollout.cli import add_plan_migration_parser, run_plan_migration

    m = sub.add_parser("plan-migration", help="simulate long-tail migration and choose R_t and m")
    add_plan_migration_parser(m)
    m.set_defaults(func=run_plan_migration)

    from .placement.cli import add_plan_parser, run_plan

    pl = sub.add_parser("plan", help="search where each model call runs (placement, dp/tp/pp)")
    add_plan_parser(pl)
    pl.set_defaults(func=run_plan)

    pr = sub.add_parser("profile-layers",
                        help="measure one decoder layer's forward/backward time for `plan`")
    pr.add_argument("model", help="a local model directory or Hub id (only its config is read)")
    pr.add_argument("--out", default="layer-profile.json", help="the profile JSON")
    pr.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                    help="token counts per pass (powers of two, as ReaLHF's profiler)")
    pr.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    pr.add_argument("--repeats", type=int, default=3, help="timed passes per count (fastest kept)")
    pr.add_argument("--device", default="auto", help="auto: cuda when there is one, else cpu")
    pr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    pr.add_argument("--head", default="lm", choices=["lm", "none"],
                    help="lm: with the vocabulary head (Actor, Ref); none: the backbone "
                         "(Critic, Reward: a one-column value head)")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_profile_layers)

    # OpenRLHF's flags pass through untouched: this subparser parses none of them ("-" is not
    # its prefix), rlhf_fusion.integrations.openrlhf splits off the --fusion.* ones.
    o = sub.add_parser("openrlhf", prefix_chars="\x00", add_help=False,
                       help="OpenRLHF's train_ppo_ray (every flag) with --fusion.* plugins")
    o.add_argument("openrlhf_argv", nargs="*")
    o.set_defaults(func=cmd_openrlhf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
