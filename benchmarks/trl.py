"""TRL trainers, stock vs rlhf-fusion's drop-in replacements: samples/s in one run, same model,
same batch, same long-tailed completion lengths (from the model's own sampling).

    python benchmarks/trl.py --algos grpo
    python benchmarks/trl.py --algos grpo --quick      # a few seconds, what the smoke test runs

GRPO workload: a Llama-style model whose EOS logit is biased (``rlhf_fusion.testing.trl.
tiny_causal_lm(eos_bias=...)``), so sampled lengths are geometric: p99 several times the median,
the long tail that a padded ``model.generate`` batch waits on. Both trainers train the same
saved model for ``--steps`` steps; samples/s counts the steps after the first (warm-up).
The stock trainer samples with torch's RNG and ours with keyed Gumbel noise, so the two runs
draw different completions from the same distribution; both length distributions are printed
and recorded. Writes ``results/trl_grpo.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _harness import write_results  # noqa: E402

# This file is named trl.py: keep its folder off the path so `import trl` finds the library.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def pct(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _grpo_run(args: argparse.Namespace, model_dir: str, fused: bool) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer
    from rlhf_fusion.testing.trl import tiny_prompt_dataset, tiny_tokenizer, vowel_reward

    step_ends: list[float] = []

    class _Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.max_new_tokens, beta=0.04, learning_rate=args.lr,
        bf16=False, use_cpu=not args.cuda, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=args.seed)
    cls = FusedGRPOTrainer if fused else GRPOTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model_dir, reward_funcs=[vowel_reward], args=config,
                      train_dataset=tiny_prompt_dataset(None, args.batch * args.steps),
                      processing_class=tiny_tokenizer(), callbacks=[_Clock()])
    lengths: list[int] = []
    real = trainer._generate_single_turn

    def recording(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        lengths.extend(len(c) for c in out[0])
        return out

    trainer._generate_single_turn = recording  # type: ignore[method-assign]
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    total = time.perf_counter() - t0
    timed = step_ends[-1] - step_ends[0]
    samples = args.batch * (len(step_ends) - 1)
    return {"samples_per_s": samples / timed, "timed_s": timed, "total_s": total,
            "steps": len(step_ends), "lengths": lengths,
            "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h]}


def bench_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """Stock ``GRPOTrainer`` vs ``FusedGRPOTrainer``: samples/s, lengths, speedup."""
    from rlhf_fusion.testing.trl import tiny_model_dir

    model_dir = tiny_model_dir(tempfile.mkdtemp(prefix="bench-trl-model-"), seed=args.seed,
                               eos_bias=args.eos_bias, hidden_size=args.hidden,
                               layers=args.layers, max_positions=args.max_new_tokens + 64)
    out: dict[str, Any] = {}
    for name, fused in (("stock", False), ("fused", True)):
        run = _grpo_run(args, model_dir, fused)
        ln = run["lengths"]
        print(f"grpo {name:>5}: {run['samples_per_s']:.1f} samples/s over {run['steps'] - 1} "
              f"timed steps ({run['timed_s']:.2f} s); lengths p50 {pct(ln, 0.5)}, p90 "
              f"{pct(ln, 0.9)}, p99 {pct(ln, 0.99)}, max {max(ln)} (n={len(ln)})",
              file=sys.stderr)
        out[name] = run
    out["speedup"] = out["fused"]["samples_per_s"] / out["stock"]["samples_per_s"]
    ln = out["fused"]["lengths"]
    out["p99_over_median"] = pct(ln, 0.99) / max(1, pct(ln, 0.5))
    print(f"grpo: fused {out['speedup']:.2f}x stock samples/s; p99/median length "
          f"{out['p99_over_median']:.1f}", file=sys.stderr)
    return out


def _write_grpo(args: argparse.Namespace, res: dict[str, Any]) -> None:
    rows = []
    for name in ("stock", "fused"):
        r, ln = res[name], res[name]["lengths"]
        rows.append([name, f"{r['samples_per_s']:.1f}", f"{r['timed_s']:.2f}",
                     f"{pct(ln, 0.5)} / {pct(ln, 0.9)} / {pct(ln, 0.99)} / {max(ln)}"])
    payload = {
        "command": "python benchmarks/trl.py " + " ".join(sys.argv[1:]),
        "workload": {k: getattr(args, k) for k in ("steps", "batch", "generations",
                                                   "max_new_tokens", "eos_bias", "hidden",
                                                   "layers", "lr", "seed", "quick")},
        "speedup": res["speedup"], "p99_over_median": res["p99_over_median"],
        **{name: {k: v for k, v in res[name].items()} for name in ("stock", "fused")},
    }
    path, _ = write_results(
        "trl_grpo", payload,
        [("GRPO: stock GRPOTrainer vs FusedGRPOTrainer",
          ["trainer", "samples/s", "timed s", "lengths p50 / p90 / p99 / max"], rows)],
        notes=[f"Speedup: **{res['speedup']:.2f}x** (fused over stock samples/s)."])
    print(f"wrote {path}", file=sys.stderr)


BENCHES = {
    "grpo": (bench_grpo, _write_grpo),
    # "ppo": (bench_ppo, _write_ppo),  -- the PPO trainer's benchmark goes here
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", nargs="+", default=["grpo"], choices=sorted(BENCHES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64, help="per-device train batch size")
    ap.add_argument("--generations", type=int, default=8, help="GRPO num_generations")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eos-bias", type=float, default=0.5,
                    help="EOS logit bias of the model (per-step EOS probability)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="small, so the length distribution stays what sampling gives")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda", action="store_true", help="train on the GPU (default: CPU)")
    ap.add_argument("--quick", action="store_true", help="a few-second smoke run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.generations, args.max_new_tokens = 2, 8, 4, 16
    for algo in args.algos:
        bench, write = BENCHES[algo]
        res = bench(args)
        if not args.no_write:
            write(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
