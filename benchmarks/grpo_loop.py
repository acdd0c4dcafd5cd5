"""GRPO in the loop (``rlhf-fusion train`` with a GRPO config file), measured two ways.

    python benchmarks/grpo_loop.py fused-serial   # (a) fused vs serial, 2 processes
    python benchmarks/grpo_loop.py vs-trl         # (b) the loop vs TRL's GRPOTrainer, samples/s

Workload (both): a tiny Llama whose EOS logit is biased (``rlhf_fusion.testing.trl.
tiny_model_dir(eos_bias=...)``), so sampled lengths are geometric, with the long tail a GRPO
rollout waits on; ``--prompts`` prompts x ``--n`` samples per iteration, up to
``--max-new-tokens`` tokens each, TRL's ``vowel_reward`` as the reward function (named by import
path in the loop's config), the KL to the Ref as a loss term (TRL's ``beta`` 0.04, k3), one
optimizer step per batch.

(a) ``fused-serial``: ``rlhf-fusion train`` on 2 processes with ``fusion.inter`` on (the Ref and
the reward scored while the tail decodes, the tail migrated) and off, as alternating pairs
(the order flips each pair, so drift in the machine's load hits both sides). Per pair: the
serial/fused ratio of the rollout (generation + scoring: what inter-stage fusion changes)
beside R_t's simulator bound for the run's own lengths and timings, of the training (the same
work in both modes: how much the load moved between the two runs) and of the iteration. The
rewards of every iteration must be equal. Writes ``results/grpo_fused_serial.{json,md}``.

(b) ``vs-trl``: the same model, batch and completion budget in TRL 1.12's stock
``GRPOTrainer`` (one process; ``per_device_train_batch_size`` = prompts x n,
``num_generations`` = n, ``max_completion_length``) and in ``rlhf-fusion train`` on one
process and on two (fused). samples/s = samples per step over the steps after the first
(warm-up). Writes ``results/grpo_vs_trl.{json,md}``.

Every run starts in its own process (one torch thread per process; ``OMP_NUM_THREADS=1``) and
drives the loop through its command line, so the benchmark measures what a user runs. Each
run records its 1-minute load average: on a shared machine, read the ratios with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _harness import write_results  # noqa: E402

# benchmarks/trl.py would shadow the trl library: keep this folder off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

PROMPTS = ("the cat sings", "a dog runs", "hello there", "go on, tell", "what is it?",
           "one two", "blue sky", "say more")
REWARD = "rlhf_fusion.testing.trl:vowel_reward"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _load() -> float:
    return os.getloadavg()[0]


def model_dir(args: argparse.Namespace, root: Path) -> str:
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(root / "model", seed=args.seed, eos_bias=args.eos_bias,
                          hidden_size=args.hidden, layers=args.layers,
                          max_positions=args.max_new_tokens + 64)


def loop_config(args: argparse.Namespace, model: str, prompts: str, *, world: int,
                fused: bool, iterations: int) -> dict[str, Any]:
    """The ``rlhf-fusion train`` config of the workload."""
    return {
        "world_size": world, "iterations": iterations, "prompts": prompts,
        "models": {"actor": model, "reward": {"function": REWARD}, "seed": args.seed},
        "generation": {"prompts_per_iteration": args.prompts,
                       "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                       "bs_max": args.prompts * args.n},
        # one optimizer step per batch, as GRPOTrainer with steps_per_generation 1; two
        # micro-batches so that two ranks each train on one
        "ppo": {"num_ppo_epochs": 1, "num_mini_batches": 1, "micro_batches": 2,
                "learning_rate": args.lr},
        "fusion": ({"inter": True, "intra": False, "rt": args.rt, "mechanism": "kv"}
                   if fused else {"inter": False, "intra": False}),
        "algorithm": {"name": "grpo", "n": args.n, "use_kl_loss": True, "kl_loss_coef": 0.04,
                      "kl_loss_type": "low_var_kl", "loss_agg_mode": "token-mean"},
    }


def run_loop(args: argparse.Namespace, root: Path, model: str, *, world: int, fused: bool,
             iterations: int, tag: str) -> dict[str, Any]:
    """``rlhf-fusion train CONFIG --out DIR`` in a fresh process; its metrics rows."""
    import yaml

    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = root / f"{tag}.yaml"
    cfg.write_text(yaml.safe_dump(loop_config(args, model, str(prompts), world=world,
                                              fused=fused, iterations=iterations)))
    out = root / f"out-{tag}"
    load = _load()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlhf_fusion.cli", "train", str(cfg), "--out",
                           str(out), "--overwrite"], env=_env(), capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"rlhf-fusion train {cfg} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return {"history": rows, "wall_s": wall, "load_before": load, "load_after": _load()}


# -- (a) fused vs serial -------------------------------------------------------------------------
def fused_serial(args: argparse.Namespace) -> None:
    from rlhf_fusion.loop.demo_grpo import _breakdown_lines, pair_row, run_times, verdict

    root = Path(tempfile.mkdtemp(prefix="bench-grpo-loop-"))
    model = model_dir(args, root)
    rows, reference = [], None
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        got = {}
        for fused in order:
            mode = "fused" if fused else "serial"
            r = run_loop(args, root, model, world=2, fused=fused, iterations=args.iterations,
                         tag=f"{mode}-{pair}")
            rewards = [h["objective/scores"] for h in r["history"]]
            if reference is None:
                reference = rewards
            elif rewards != reference:
                raise SystemExit(f"pair {pair} {mode}: rewards differ from the first run's "
                                 f"({rewards} vs {reference}): fused and serial must sample "
                                 "alike")
            lengths = [h["response_length/mean"] for h in r["history"]]
            got[mode] = run_times(r["history"]) | {
                "load_before": r["load_before"], "load_after": r["load_after"],
                "wall_s": r["wall_s"], "mean_length": statistics.fmean(lengths),
                "rt": [h.get("fusion/rt") for h in r["history"]],
                "max_length": max(h["response_length/max"] for h in r["history"])}
        row = pair_row(pair, "fused" if order[0] else "serial", got["fused"], got["serial"])
        rows.append(row)
        b = row["bound"]
        print(f"pair {pair}: R_t per iteration {got['fused']['rt']}; rollout "
              f"{row['rollout_ratio']:.2f}x (bound "
              f"{'-' if b is None else f'{b:.2f}x'}), training {row['training_ratio']:.2f}x, "
              f"iteration {row['iteration_ratio']:.2f}x; load {got['fused']['load_before']:.1f}"
              f" / {got['serial']['load_before']:.1f}", file=sys.stderr, flush=True)
    v = verdict(rows)
    print("\n".join(_breakdown_lines(rows)), file=sys.stderr)
    table = []
    for r in rows:
        for m in ("fused", "serial"):
            t = r[m]
            table.append([str(r["pair"]), m, r["first"], f"{t['rollout_s']:.2f}",
                          f"{t['train_s']:.2f}", f"{t['iteration_s']:.2f}",
                          f"{t['mean_length']:.1f} / {t['max_length']:.0f}",
                          f"{t['load_before']:.1f} -> {t['load_after']:.1f}",
                          (f"**{r['rollout_ratio']:.2f}x** (bound "
                           + ("-" if r["bound"] is None else f"{r['bound']:.2f}x")
                           + f"); training {r['training_ratio']:.2f}x; iteration "
                           f"{r['iteration_ratio']:.2f}x") if m == "fused" else ""])
    payload = {"command": "python benchmarks/grpo_loop.py " + " ".join(sys.argv[1:]),
               "workload": _workload(args), "processes": 2, "rewards_equal": True,
               **v, "pairs": rows}
    bound = v["median_bound"]
    notes = [
        f"Median over {args.pairs} alternating pairs: rollout serial/fused "
        f"**{v['median_rollout_ratio']:.2f}x** (R_t's simulator bound "
        + ("-" if bound is None else f"{bound:.2f}x") + "), iteration "
        f"{v['median_iteration_ratio']:.2f}x; rewards equal in every iteration of every run.",
        "rollout: generation + Ref and reward scoring (what inter-stage fusion changes); "
        "training: the same work in both modes, so its ratio shows how much the machine's load "
        "moved between the two runs of a pair"
        + (f" (off 1.0 by more than 10% in pair(s) {v['pairs_with_load_drift']})"
           if v["pairs_with_load_drift"] else "") + ".",
        "bound: the simulator's serial/fused rollout time on each iteration's own lengths and "
        "fitted decode/scoring costs, weighted by the fused rollout time of the iteration.",
        "2 processes (gloo), one torch thread each, on a shared 2-core machine (see the load "
        "column: other jobs ran beside it).",
    ]
    path, _ = write_results("grpo_fused_serial", payload, [(
        "GRPO in rlhf-fusion train, 2 processes: fused vs serial",
        ["pair", "mode", "first", "rollout s", "training s", "iteration s",
         "length mean / max", "load (1 min)", "serial/fused"], table)], notes=notes)
    print(f"wrote {path}", file=sys.stderr)


# -- (b) the loop vs TRL's GRPOTrainer -----------------------------------------------------------
def trl_run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """One stock ``GRPOTrainer`` run in this process (started by :func:`vs_trl`)."""
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_fusion.testing.trl import vowel_reward

    torch.set_num_threads(1)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    batch = args.prompts * args.n
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-grpo-trl-"), max_steps=args.steps,
        per_device_train_batch_size=batch, num_generations=args.n,
        max_completion_length=args.max_new_tokens, beta=0.04, learning_rate=args.lr,
        loss_type="bnpo", bf16=False, use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=args.seed)
    data = Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)]
                                         for i in range(args.prompts * args.steps)]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=[vowel_reward], args=config,
                              train_dataset=data, processing_class=AutoTokenizer.from_pretrained(
                                  model), callbacks=[Clock()])
        trainer.train()
    timed = ends[-1] - ends[0]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h]
    return {"samples_per_s": batch * (len(ends) - 1) / timed, "timed_s": timed,
            "steps": len(ends), "mean_length": statistics.fmean(lengths),
            "max_length": max(h.get("completions/max_length", 0)
                              for h in trainer.state.log_history)}


def vs_trl(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-vs-trl-"))
    model = model_dir(args, root)
    batch = args.prompts * args.n
    variants = [("TRL GRPOTrainer", None), ("rlhf-fusion train, 1 process", (1, False)),
                ("rlhf-fusion train, 2 processes, fused", (2, True))]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for rep in range(args.pairs):
        for name, how in (variants if rep % 2 == 0 else variants[::-1]):
            load = _load()
            if how is None:
                out = root / f"trl-{rep}.json"
                proc = subprocess.run([sys.executable, __file__, "_trl", "--out", str(out),
                                       "--model", model, *_argv(args)], env=_env(),
                                      capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    raise SystemExit(f"TRL run failed:\n{proc.stderr[-3000:]}")
                r = json.loads(out.read_text())
            else:
                world, fused = how
                h = run_loop(args, root, model, world=world, fused=fused,
                             iterations=args.steps, tag=f"loop{world}-{rep}")["history"]
                timed = sum(x["time/iteration"] for x in h[1:])
                r = {"samples_per_s": batch * (len(h) - 1) / timed, "timed_s": timed,
                     "steps": len(h),
                     "mean_length": statistics.fmean(x["response_length/mean"] for x in h),
                     "max_length": max(x["response_length/max"] for x in h)}
            r["load"] = load
            results[name].append(r)
            print(f"{rep} {name}: {r['samples_per_s']:.1f} samples/s (mean length "
                  f"{r['mean_length']:.1f}, max {r['max_length']:.0f}; load {load:.1f})",
                  file=sys.stderr, flush=True)
    stock = statistics.median(r["samples_per_s"] for r in results[variants[0][0]])
    table = []
    for name, _ in variants:
        rs = results[name]
        med = statistics.median(r["samples_per_s"] for r in rs)
        table.append([name, " / ".join(f"{r['samples_per_s']:.1f}" for r in rs),
                      f"**{med:.1f}**", f"{med / stock:.2f}x",
                      " / ".join(f"{r['mean_length']:.1f}" for r in rs),
                      " / ".join(f"{r['load']:.1f}" for r in rs)])
    payload = {"command": "python benchmarks/grpo_loop.py " + " ".join(sys.argv[1:]),
               "workload": _workload(args), "results": results}
    notes = [
        f"samples/s: {batch} samples ({args.prompts} prompts x {args.n}) per step, over the "
        f"{args.steps - 1} steps after the first; the median of {args.pairs} runs each, the "
        "variants' order reversed every other round.",
        "TRL samples with torch's RNG and the loop with its own keyed sampler: the same model "
        "and length distribution, not the same completions (mean lengths shown per run).",
        "TRL: one process, `loss_type` bnpo (token mean, the loop's `token-mean`), `beta` "
        "0.04; the loop: `use_kl_loss` k3 0.04. One torch thread per process, on a shared "
        "2-core machine (the load column: other jobs ran beside it). The 2-process run uses "
        "twice the processes of the other two.",
    ]
    path, _ = write_results("grpo_vs_trl", payload, [(
        "GRPO: TRL GRPOTrainer vs rlhf-fusion train (same model, batch, completion budget)",
        ["trainer", "samples/s per run", "median samples/s", "vs TRL", "mean length per run",
         "load (1 min) per run"], table)], notes=notes)
    print(f"wrote {path}", file=sys.stderr)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("prompts", "n", "max_new_tokens", "eos_bias", "hidden",
                                          "layers", "iterations", "steps", "pairs", "rt", "lr",
                                          "seed")}


def _argv(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in _workload(args).items()]


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("fused-serial", "vs-trl", "_trl"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the group)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--eos-bias", type=float, default=1.5,
                   help="the tiny model's EOS logit bias: geometric lengths, a long tail")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iterations", type=int, default=8, help="fused-serial: per run")
    p.add_argument("--steps", type=int, default=5, help="vs-trl: steps per run (first untimed)")
    p.add_argument("--pairs", type=int, default=3, help="alternating pairs / rounds")
    p.add_argument("--rt", default="auto", help="fusion.rt of the fused runs")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = main_parser().parse_args(argv)
    if args.what == "_trl":
        Path(args.out).write_text(json.dumps(trl_run(args, args.model)))
    elif args.what == "fused-serial":
        fused_serial(args)
    else:
        vs_trl(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
