"""The rlhf-fusion command: run PPO with stage fusion, or search fused schedules and placements.

Errors are one line naming the file or field and the fix: exit 2 for a bad config or
argument (refused before any process starts), exit 1 for a failure while running (the full
traceback goes to error.log in the output directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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

    if args.algo == "grpo":
        from .loop.demo_grpo import compare_grpo, run_grpo_demo

        out = args.out if args.out != "rlhf-fusion-demo" else "rlhf-fusion-demo-grpo"
        if args.compare:
            if args.serial or args.pairs < 1:
                print("rlhf-fusion demo: error: --compare runs both modes; drop --serial and "
                      "give --pairs 1 or more", file=sys.stderr)
                return 2
            return run_logged("rlhf-fusion demo --algo grpo --compare", out, lambda: compare_grpo(
                out, pairs=args.pairs, iterations=args.iterations or 40))
        return run_logged("rlhf-fusion demo --algo grpo", out, lambda: run_grpo_demo(
            out, iterations=args.iterations or 40, serial=args.serial))
    if args.compare:
        from .loop.compare import compare

        if args.serial or args.pairs < 1:
            print("rlhf-fusion demo: error: --compare runs both modes; drop --serial and give "
                  "--pairs 1 or more", file=sys.stderr)
            return 2
        # a CompareError (the modes' samples differ) is one line and exit 1, like any failure
        return run_logged("rlhf-fusion demo --compare", args.out, lambda: compare(
            args.out, pairs=args.pairs, iterations=args.iterations or 24))
    return run_logged("rlhf-fusion demo", args.out, lambda: run_demo(
        args.out, iterations=args.iterations or 24, serial=args.serial))


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from .launch import (
        LaunchEnvError,
        RunInterrupted,
        cancel_stop_deadline,
        exit_promptly,
        group_from_env,
        ignore_stop_signals,
        stop_gracefully_on_signals,
    )
    from .loop import LoopConfigError, RLHFConfig, load_prompts, train
    from .loop.checkpoint import checkpoint_dir, complete_checkpoints
    from .loop.demo import demo_prompts
    from .loop.resolve import resolve_run

    # SIGTERM or SIGUSR1: stop at the next iteration boundary with a checkpoint, exit 0
    # (preemption; repeats are the same request); SIGINT, or no boundary within --stop-grace:
    # stop every rank now.
    stop_gracefully_on_signals(args.stop_grace)
    try:
        group = group_from_env()   # started by torchrun or srun: this process is one rank
        lead = group is None or group.lead
        cfg = RLHFConfig.from_file(args.config)
        if args.iterations is not None:
            cfg.iterations = args.iterations
        try:
            resolved = resolve_run(cfg)   # once, before any rank starts; handed to train
        except LoopConfigError as exc:
            raise LoopConfigError(f"{args.config}: {exc}") from None
        if cfg.prompts:
            prompts = load_prompts(cfg.prompts)
        elif cfg.models.tokenizer == "arithmetic":   # the GRPO demo's task
            from .loop.arithmetic import arithmetic_prompts

            prompts = arithmetic_prompts()
        else:
            prompts = demo_prompts()
            if lead:
                print(f"prompts: {args.config} sets none; using the demo's {len(prompts)} "
                      "prompts (rlhf_fusion/loop/data/prompts.txt); set prompts: FILE for "
                      "your own", file=sys.stderr)
    except (LoopConfigError, LaunchEnvError) as exc:
        print(f"rlhf-fusion train: error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:   # before any rank started: nothing to keep
        print(f"\nrlhf-fusion train: {exc}", file=sys.stderr)
        return 128 + exc.signum

    def run() -> None:
        try:
            out = train(resolved, prompts, out_dir=args.out, checkpoint_every=args.checkpoint_every,
                        resume=args.resume is not None, overwrite=args.overwrite,
                        keep_checkpoints=args.keep_checkpoints)
        except RunInterrupted as exc:
            # Rank 0 alone writes checkpoints, into its own --out: another rank's --out
            # (maybe on another node) says nothing about them.
            done = complete_checkpoints(args.out) if lead else []
            where = (f"the last complete checkpoint is {done[-1][1]}; continue with --resume"
                     if done else "no checkpoint was complete" if lead
                     else "rank 0 reports the last complete checkpoint")
            print(f"\nrlhf-fusion train: {exc}; every rank stopped, {where}", file=sys.stderr)
            exit_promptly(128 + exc.signum)
        finally:
            cancel_stop_deadline()
            ignore_stop_signals()   # a repeat while exiting must not kill a finished run
        if out.get("stopped") is not None and lead:
            it = out["stopped"]
            name = signal.Signals(out["stop_signal"] or signal.SIGTERM).name
            where = (f"its checkpoint is {checkpoint_dir(args.out, it)}; continue with --resume"
                     if it else "no iteration had finished, nothing to resume")
            print(f"\nrlhf-fusion train: stopped by {name} after {it} of {cfg.iterations} "
                  f"iterations; {where}", file=sys.stderr)

    return run_logged("rlhf-fusion train", args.out, run, write_log=lead)


STOP_GRACE_S = 25.0
"""`train --stop-grace`'s default: seconds a SIGTERMed run has to finish its iteration and
write the checkpoint before every rank is stopped at once. Below the 30 s that Kubernetes
(terminationGracePeriodSeconds) and torchrun (--shutdown-timeout) wait before SIGKILL by
default; under SLURM preemption the window is GraceTime (+ KillWait): docs/loop.md sizes it."""

ERROR_LOG = "error.log"


def run_logged(prog: str, out: str | Path, run: Callable[[], Any], *,
               write_log: bool = True) -> int:
    """Run, and turn any failure into one line on stderr, ``PROG: error: CAUSE`` (exit 2 for
    a config error found late, exit 1 otherwise), with every traceback in ``OUT/error.log``
    (on stderr instead without ``write_log``: a rank other than 0 writes nothing into OUT).
    The examples report their errors through it too."""
    import traceback

    from .loop import LoopConfigError

    try:
        run()
    except LoopConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - reported in one line, logged in full
        if not write_log:
            print(traceback.format_exc(), file=sys.stderr)
            print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
            return 1
        log = _write_error_log(out, traceback.format_exc(), exc)
        print(f"{prog}: error: {_one_line(exc)} (full traceback: {log})",
              file=sys.stderr)
        return 1
    return 0


# Failures that follow from another rank's: the cause is the rank that failed otherwise.
_CONSEQUENCES = ("Deadline", "NotAwaited", "PeerError", "PipelineTimeoutError",
                 "DistBackendError", "DistNetworkError", "DistStoreError", "RankFailedError")


def _one_line(exc: BaseException) -> str:
    """The cause of ``exc`` in one line: for a multi-process failure, the first rank that
    died without reporting (the others' errors follow from it: a closed connection, a
    timeout), else the first whose error is its own (not a wait on a peer), else the first."""
    from .launch import DistributedRunError

    if isinstance(exc, DistributedRunError):
        bad = [r for r in exc.results if not r.ok]
        own = [r for r in bad if r.error_type not in (*_CONSEQUENCES, "Died")]
        died = [r for r in bad if r.error_type == "Died"]
        r = (died or own or bad)[0]
        first = (r.error.strip().splitlines() or [""])[0]
        return (f"rank {r.rank}: {r.error_type}: {first} ({len(bad)} of {len(exc.results)} "
                "ranks failed)")
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


def _write_error_log(out: str | Path, trace: str, exc: BaseException) -> Path:
    """``OUT/error.log`` (a temporary file when OUT cannot be written), appended to."""
    import datetime
    import tempfile

    from .launch import DistributedRunError

    text = [f"--- {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(sys.argv)}",
            trace]
    if isinstance(exc, DistributedRunError):
        for r in exc.results:
            if not r.ok:
                text.append(f"--- rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}")
    try:
        path = Path(out) / ERROR_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write("\n".join(text) + "\n")
    except OSError:
        fd, name = tempfile.mkstemp(prefix="rlhf-fusion-error-", suffix=".log")
        with open(fd, "w") as fh:
            fh.write("\n".join(text) + "\n")
        path = Path(name)
    return path


def cmd_schedule_demo(args: argparse.Namespace) -> int:
    from .schedule import Problem
    from .schedule.plot import plot_schedule

    out = Path(args.out)
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


def config_kind(raw: Any, path: str) -> str:
    """``"problem"`` (a placement problem: it has a ``cluster``), ``"train"`` (an
    ``RLHFConfig``: its top-level keys only), or a :class:`PlacementError` naming both
    accepted shapes."""
    import dataclasses

    from .loop import RLHFConfig
    from .placement import PlacementError
    from .placement.problem import PROBLEM_KEYS

    train_keys = {f.name for f in dataclasses.fields(RLHFConfig)}
    shapes = ("give a placement problem (models, cluster, batch, prompt_len, gen_len; "
              "docs/placement.md) or a train config (models, generation, ppo, placement, "
              "world_size; docs/loop.md)")
    if not isinstance(raw, dict):
        raise PlacementError(f"{path}: a {type(raw).__name__}, not a mapping; {shapes}")
    keys = set(raw)
    # A placement problem always has a cluster, so a file without one and only a train
    # config's keys (an empty one, or models alone, included) is a train config.
    if "cluster" in keys or (keys <= PROBLEM_KEYS and not keys <= train_keys):
        return "problem"
    if keys <= train_keys:
        return "train"
    raise PlacementError(
        f"{path}: keys {sorted(keys - PROBLEM_KEYS)} are not a placement problem's and "
        f"{sorted(keys - train_keys)} not a train config's; {shapes}")


def _train_config_problem(path: str) -> tuple[Any, dict[str, Any]]:
    """The placement problem the loop plans for a train config (``placement.search``'s), and
    the search options it implies (``placement.search`` seconds)."""
    from .loop import LoopConfigError, RLHFConfig, load_prompts
    from .loop.demo import demo_prompts
    from .loop.models import load_tokenizer
    from .loop.placement import placement_problem

    cfg = RLHFConfig.from_file(path)   # as `train` reads it (prompts relative to the file)
    try:
        cfg.validate()   # what `train` would refuse, refused here too
    except LoopConfigError as exc:
        raise LoopConfigError(f"{path}: {exc}") from None
    prompts = load_prompts(cfg.prompts) if cfg.prompts else demo_prompts()
    tok = load_tokenizer(cfg.models)
    prompt_len = sum(len(tok.encode(p)) for p in prompts) / max(len(prompts), 1)
    problem = placement_problem(cfg, prompt_len)
    opts = {"time_limit": float(cfg.placement.search)} if cfg.placement.search else {}
    print(f"{path}: a train config (RLHFConfig): planning the problem the loop runs for it: "
          f"models {list(problem.roles)}, {cfg.world_size} x {cfg.placement.hardware} on one "
          f"node, batch {problem.batch}, prompts {problem.prompt_len} + "
          f"{problem.gen_len} tokens, tp = pp = 1", file=sys.stderr)
    return problem, opts


def cmd_place(args: argparse.Namespace) -> int:
    """``rlhf-fusion place CONFIG``: a placement problem or a train config."""
    from .loop import LoopConfigError
    from .placement import PlacementError
    from .placement.cli import run_place
    from .placement.problem import load_config

    try:
        raw = load_config(args.config)
        if config_kind(raw, args.config) == "problem":
            print(f"{args.config}: a placement problem", file=sys.stderr)
            return run_place(args)
        problem, opts = _train_config_problem(args.config)
    except (PlacementError, LoopConfigError) as exc:
        print(f"rlhf-fusion place: error: {exc}", file=sys.stderr)
        return 2
    return run_place(args, problem, opts)


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

    layouts = []
    for spec in args.layout or []:
        from .placement import PlacementError
        from .placement.profile import parse_layout_key

        try:
            layouts.append(parse_layout_key(spec, "--layout"))
        except PlacementError as exc:
            print(f"rlhf-fusion profile-layers: error: {exc}", file=sys.stderr)
            return 2
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if layouts and device != "cpu":
        print("rlhf-fusion profile-layers: error: --layout profiles on local gloo ranks on the "
              "CPU (the loop's CPU runs); pass --device cpu", file=sys.stderr)
        return 2
    world = args.world or max((dp * tp for dp, tp, _ in layouts), default=1)
    from .runtime.layout_profile import check_layouts, profile_layouts

    try:   # before the profiling, not after it
        check_layouts(layouts, world)
    except ValueError as exc:
        print(f"rlhf-fusion profile-layers: error: {exc} (raise --world)", file=sys.stderr)
        return 2
    try:
        prof = profile_config(config, lm_head=args.head == "lm", dtype=dtype,
                              tokens=args.tokens, seq_len=args.seq_len, repeats=args.repeats,
                              device=device, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if layouts:
        from .loop.models import build_causal_lm, build_value_model

        role, build = (("actor", build_causal_lm) if args.head == "lm"
                       else ("critic", build_value_model))
        print(f"profiling {len(layouts)} layout(s) as the {role} on {world} gloo ranks "
              f"({args.launches} launch(es))", file=sys.stderr)
        prof["layouts"] = profile_layouts(config, role, build, layouts, world=world,
                                          tokens=args.tokens, seq_len=args.seq_len,
                                          repeats=args.repeats,
                                          launches=args.launches)["layouts"]
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
    for key, t in prof.get("layouts", {}).items():
        n = max(t["forward"], key=int)
        step = max(t["step"], key=int)
        print(f"{key}: at {n} tokens forward {1e3 * t['forward'][n]:.3f} ms/layer, backward "
              f"{1e3 * t['backward'][n]:.3f} ms/layer; a step adds {1e3 * t['step'][step]:.1f} ms "
              f"at {int(step):,} parameters"
              + (f"; gather {1e3 * t['gather'][step]:.1f} ms" if "gather" in t else ""))
    print(f"wrote {out} (placement problem: profiles: {{actor: {out}}})")
    return 0


def cmd_openrlhf(args: argparse.Namespace) -> int:
    from .integrations.openrlhf.launch import main as openrlhf_main

    return openrlhf_main(args.openrlhf_argv)


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``, refused with exit 2 otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


# Old command names, hidden from --help, kept for one release: old -> new.
RENAMED_COMMANDS = {"plan": "place", "plan-demo": "schedule-demo",
                    "plan-migration": "tune-migration"}


def _deprecated_command(old: str, new: str, func: Callable[[argparse.Namespace], int]
                        ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"rlhf-fusion: `{old}` is deprecated; use `rlhf-fusion {new}`", file=sys.stderr)
        return func(args)

    return run


class _DeprecatedAlias(argparse.Action):
    """An old option name: still accepted, with a note naming the new one."""

    def __init__(self, *args: Any, new: str = "", **kw: Any) -> None:
        self.new = new
        super().__init__(*args, **kw)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(f"rlhf-fusion: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .schedule import SOLVERS

    parser = argparse.ArgumentParser(
        prog="rlhf-fusion", description=__doc__.split("\n\n")[0],
        epilog="`rlhf-fusion COMMAND --help` shows a command's options. Docs: README.md, "
               "docs/loop.md (train configs), docs/placement.md (place).")
    parser.add_argument("--version", action="version", version=f"rlhf-fusion {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("schedule", help="find a fused Actor/Critic pipeline schedule")
    p.add_argument("problem", help="problem JSON (see docs/architecture.md), or a schedule/table3 entry")
    p.add_argument("--solver", default="auto", choices=SOLVERS,
                   help="search method (default: auto, CP-SAT seeded by the annealer)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for the search")
    p.add_argument("--memory-capacity", type=float, default=None,
                   help="activation memory capacity per group (overrides the problem's)")
    p.add_argument("--workers", type=int, default=None, help="processes/threads (default: all cores)")
    p.add_argument("--out", help="write the schedule JSON (with instruction streams) here")
    p.add_argument("--plot", help="write a timeline + memory PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_schedule)

    d = sub.add_parser("demo", help="PPO on tiny models, 2 CPU processes, every plugin on")
    d.add_argument("--out", default="rlhf-fusion-demo",
                   help="output directory (default: rlhf-fusion-demo)")
    d.add_argument("--iterations", type=_count(1), default=None,
                   help="iterations, >= 1 (default: 24 for ppo, 40 for grpo)")
    d.add_argument("--algo", choices=("ppo", "grpo"), default="ppo",
                   help="ppo (a critic, the vowels task) or grpo (no critic, arithmetic with a "
                        "correctness reward; default: ppo)")
    d.add_argument("--serial", action="store_true",
                   help="the serial baseline (no inter- or intra-stage fusion)")
    d.add_argument("--compare", action="store_true",
                   help="run fused and --serial as alternating pairs (--algo grpo: both "
                        "modes interleaved iteration by iteration in the same processes); "
                        "print every pair's and the median serial/fused ratio, check the "
                        "rewards are equal in every iteration, plot the breakdown")
    d.add_argument("--pairs", type=int, default=3,
                   help="fused/serial pairs for --compare (default: 3)")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="run PPO from a YAML/JSON config (models, prompts, knobs)")
    t.add_argument("config", help="RLHFConfig as YAML or JSON (docs/loop.md; examples in "
                                  "examples/configs/)")
    t.add_argument("--out", default="rlhf-fusion-run",
                   help="metrics, checkpoints and error.log go here (default: rlhf-fusion-run)")
    t.add_argument("--iterations", type=_count(0), default=None,
                   help="override the config's iterations")
    t.add_argument("--checkpoint-every", type=_count(0), default=1,
                   help="iterations per checkpoint, 0: none (default: 1)")
    t.add_argument("--keep-checkpoints", type=_count(0), default=2, metavar="K",
                   help="keep the newest K checkpoints, delete older ones, 0: keep all "
                        "(default: 2)")
    t.add_argument("--resume", nargs="?", const="auto", choices=["auto"], default=None,
                   help="continue the run in --out from its newest complete checkpoint, or "
                        "start it when there is none (`--resume auto`, the same: the way to "
                        "run under torchrun --max-restarts N, docs/loop.md)")
    t.add_argument("--stop-grace", type=float, default=STOP_GRACE_S, metavar="S",
                   help="after SIGTERM or SIGUSR1 (preemption; repeats are one request) the "
                        "run finishes its iteration, writes its "
                        "checkpoint and exits 0; if that takes longer than S seconds every "
                        f"rank is stopped at once, the iteration dropped (default: "
                        f"{STOP_GRACE_S:g})")
    t.add_argument("--overwrite", action="store_true",
                   help="start over in a non-empty --out (deletes its metrics, checkpoints and "
                        "error.log)")
    t.set_defaults(func=cmd_train)

    def schedule_demo(pd: argparse.ArgumentParser, out: str) -> None:
        pd.add_argument("--out", default=out, help=f"output directory (default: {out})")
        pd.add_argument("--out-dir", dest="out", action=_DeprecatedAlias, new="--out",
                        help=argparse.SUPPRESS)
        pd.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds for the search (default: 20)")

    from .placement.cli import add_place_parser
    from .rollout.cli import add_tune_migration_parser, run_tune_migration

    commands: dict[str, tuple[str, Callable[[argparse.ArgumentParser], Any],
                              Callable[[argparse.Namespace], int]]] = {
        "schedule-demo": ("find a fused schedule for a built-in setting, plot it",
                          lambda p: schedule_demo(p, "rlhf-fusion-schedule-demo"),
                          cmd_schedule_demo),
        "tune-migration": ("simulate long-tail migration and choose R_t and m",
                           add_tune_migration_parser, run_tune_migration),
        "place": ("search where each model call runs (placement, dp/tp/pp) for a placement "
                  "problem or a train config", add_place_parser, cmd_place),
    }
    for name, (text, add, func) in commands.items():
        c = sub.add_parser(name, help=text)
        add(c)
        c.set_defaults(func=func)
    for old, new in RENAMED_COMMANDS.items():
        text, add, func = commands[new]
        # No help=: the old name is not listed in `rlhf-fusion --help`.
        c = sub.add_parser(old, description=f"(old name of `{new}`, kept for one release) "
                                            f"{text}")
        if old == "plan-demo":   # its old default folder, for scripts that read it
            schedule_demo(c, "rlhf-fusion-plan-demo")
        else:
            add(c)
        c.set_defaults(func=_deprecated_command(old, new, func))

    pr = sub.add_parser("profile-layers",
                        help="time a model's decoder layers (and the rest of a pass) for `place`")
    pr.add_argument("model", help="a local model directory or Hub id (only its config is read)")
    pr.add_argument("--out", default="layer-profile.json", help="the profile JSON")
    pr.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                    help="token counts per pass (powers of two, as ReaLHF's profiler)")
    pr.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    pr.add_argument("--repeats", type=int, default=3, help="timed passes per count (fastest kept)")
    pr.add_argument("--device", default="auto", help="auto: cuda when there is one, else cpu")
    pr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="the weights' and activations' dtype (default: bfloat16)")
    pr.add_argument("--head", default="lm", choices=["lm", "none"],
                    help="lm: with the vocabulary head (Actor, Ref); none: the backbone "
                         "(Critic, Reward: a one-column value head)")
    pr.add_argument("--layout", action="append", metavar="'dp=2 tp=1 zero=3'",
                    help="also profile training in this layout on local gloo ranks (CPU), as "
                         "the loop trains it: tp on DTensor, zero=3 on FSDP2 (repeatable)")
    pr.add_argument("--world", type=int, default=0,
                    help="ranks for --layout (default: the largest layout's dp*tp)")
    pr.add_argument("--launches", type=int, default=1,
                    help="--layout: start the ranks this many times, keep each figure's median")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_profile_layers)

    # OpenRLHF's flags pass through untouched: this subparser parses none of them ("-" is not
    # its prefix), rlhf_fusion.integrations.openrlhf splits off the --fusion.* ones.
    o = sub.add_parser("openrlhf", prefix_chars="\x00", add_help=False,
                       help="OpenRLHF's train_ppo_ray (every flag) with --fusion.* plugins")
    o.add_argument("openrlhf_argv", nargs="*",
                   help="train_ppo_ray's flags, passed through, and --fusion.* plugin flags")
    o.set_defaults(func=cmd_openrlhf)
    # `COMMAND --help` opens with the line the command list shows.
    for choice in sub._choices_actions:
        sub.choices[choice.dest].description = sub.choices[choice.dest].description or choice.help
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
