"""``rlhf-fusion place CONFIG``: search an execution plan, print it beside the co-located
heuristic, write the plan JSON and a timeline PNG. ``CONFIG`` is a placement problem
(:meth:`PlacementProblem.from_dict`) or, through the top-level CLI, a train config (the
problem the loop would plan for it). Its old name ``plan`` is a hidden alias for one release."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import PlacementError

if TYPE_CHECKING:
    from .problem import PlacementProblem


def add_place_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML/JSON: a placement problem (models, cluster, batch, "
                                  "prompt_len, gen_len; docs/placement.md) or a train config "
                                  "(models, generation, ppo, placement, world_size; "
                                  "docs/loop.md)")
    p.add_argument("--out", default="rlhf-fusion-plan", help="directory for plan.json and "
                                                             "timeline.png")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds of search (default: the config's search.time_limit, else 60)")
    p.add_argument("--seed", type=int, default=None, help="search seed (default 0)")
    p.add_argument("--preset", default=None,
                   help="print a preset (colocated, interleaved, interleaved2, disaggregated) "
                        "instead of searching")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verl", action="store_true",
                   help="also write verl.txt: the plan as verl 0.9 resource pools and main_ppo "
                        "Hydra overrides (docs/verl.md)")


def run_place(args: argparse.Namespace, problem: PlacementProblem | None = None,
              opts: Mapping[str, Any] | None = None) -> int:
    """Search (or ``--preset``) and report. ``problem``: already read (a train config's, with
    its ``opts``: ``time_limit``/``seed``); else ``args.config`` is a placement-problem file."""
    from .estimate import Estimator
    from .presets import colocated_heuristic, preset_plan
    from .problem import PlacementProblem, load_config
    from .search import search

    try:
        if problem is None:
            raw = load_config(args.config)
            problem = PlacementProblem.from_dict(raw)
            opts = raw.get("search") or {}
        opts = {} if opts is None else opts
        if not isinstance(opts, Mapping) or set(opts) - {"time_limit", "seed"}:
            raise PlacementError("search: a mapping with time_limit and/or seed")
        time_limit = args.time_limit if args.time_limit is not None else float(
            opts.get("time_limit", 60))
        seed = args.seed if args.seed is not None else int(opts.get("seed", 0))
        est = Estimator(problem)
        heuristic = colocated_heuristic(problem, estimator=est)
        if args.preset:
            plan = preset_plan(problem, args.preset, estimator=est)
            result = None
        else:
            bar = None
            if not args.quiet:
                from tqdm import tqdm

                bar = tqdm(total=100, desc="plan search", unit="%", file=sys.stderr,
                           bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")

            def progress(frac: float, best: float, steps: int) -> None:
                if bar is not None:
                    bar.n = int(100 * frac)
                    bar.set_postfix_str(f"best {best:.2f} s, {steps} steps")

            try:
                result = search(problem, time_limit=time_limit, seed=seed, estimator=est,
                                progress=progress)
            finally:
                if bar is not None:
                    bar.close()
            plan = result.plan
    except PlacementError as exc:
        print(f"rlhf-fusion place: error: {exc}", file=sys.stderr)
        return 2
    e_plan = est.estimate(plan)
    e_heur = est.estimate(heuristic)
    summary = problem.summary()
    print(f"{problem.name or args.config}: " + ", ".join(
        f"{k} {v}" for k, v in summary["models"].items()) + "; " + "; ".join(summary["cluster"]))
    print(plan.table())
    print(f"  estimated iteration time  {e_plan.iteration_time:.2f} s"
          + ("  (OUT OF MEMORY)" if e_plan.oom else "")
          + f"  peak {e_plan.peak_memory / 1e9:.1f} of {e_plan.capacity / 1e9:.1f} GB")
    print(f"  co-located heuristic      {e_heur.iteration_time:.2f} s"
          + ("  (OUT OF MEMORY)" if e_heur.oom else "")
          + f"  {heuristic.calls['actor_train'].strategy}")
    gain = 1 - e_plan.cost / e_heur.cost
    print(f"  estimated gain            {100 * gain:.1f}%  ({e_heur.cost / e_plan.cost:.2f}x)")
    if result is not None:
        print(f"  search                    {result.steps} steps, {result.evaluations} "
              f"estimates, {result.seconds:.1f} s, seed {seed}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan.estimate = {**e_plan.to_dict(), "heuristic_iteration_time_s": e_heur.iteration_time,
                     "gain": gain}
    plan.save(out / "plan.json", problem.cluster)
    from .plot import plot_timelines

    plot_timelines([("co-located heuristic", heuristic, e_heur), (plan.name or "plan", plan, e_plan)],
                   out / "timeline.png")
    (out / "problem.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"  wrote {out / 'plan.json'}, {out / 'timeline.png'}")
    if getattr(args, "verl", False):
        from .verl_config import verl_config

        text = verl_config(plan).text()
        (out / "verl.txt").write_text(text)
        print(text, end="")
        print(f"  wrote {out / 'verl.txt'}")
    return 0
