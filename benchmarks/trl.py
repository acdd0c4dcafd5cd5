"""TRL trainers, stock vs rlhf-fusion's drop-in replacements: samples/s in one run, same model,
same batch, same long-tailed completion lengths (from the model's own sampling).

    python benchmarks/trl.py                     # PPO (needs trl 1.12) and GRPO
    python benchmarks/trl.py --algos grpo --quick      # a few seconds, what the smoke test runs
    python benchmarks/trl.py --cuda              # one GPU: Qwen2.5-0.5B-shaped, bf16, 1 seed

PPO: trl 1.12's ``PPOTrainer``, then ``FusedPPOTrainer`` with every plugin off (the same
algorithm on our code: it must not be the source of the gain) and on; value and reward models
are sequence classifiers on the policy's backbone, ``--ppo-epochs`` epochs of ``--micro``-sample
micro-batches over one mini-batch of ``--batch``. Writes ``results/trl_ppo.{json,md}``.

Workload: a Llama-style model whose EOS logit is biased (``rlhf_fusion.testing.trl.
tiny_causal_lm(eos_bias=...)``), so sampled lengths are geometric: p99 several times the median,
the long tail that a padded ``model.generate`` batch waits on. Both trainers train the same
saved model for ``--steps`` steps; samples/s counts the steps after the first (warm-up).
The stock trainer samples with torch's RNG and ours with keyed Gumbel noise, so the two runs
draw different completions from the same distribution; both length distributions are printed
and recorded. GRPO writes ``results/trl_grpo.{json,md}``.

``--cuda``: one process on the GPU, a randomly initialised model of Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
embeddings; ``--family qwen2``) in bf16, one seed, 5 steps; both algorithms go to one file,
``results/trl_<gpu>.{json,md}`` (the GPU's name, slugified). The EOS bias is raised by
``ln((V - 1) / (36 - 1))`` for a vocabulary of V, so ``--eos-bias`` gives the same per-step
EOS probability, hence the same length distribution, as on the 36-token tiny model.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
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


def _compare(algo: str, runs: dict[str, Any]) -> dict[str, Any]:
    """Run each variant in order (``runs``: name -> thunk), print its samples/s and length
    distribution, and add the fused-over-stock speedup and the tail ratio."""
    out: dict[str, Any] = {}
    for name, run_fn in runs.items():
        run = run_fn()
        ln = run["lengths"]
        print(f"{algo} {name:>5}: {run['samples_per_s']:.1f} samples/s over {run['steps'] - 1} "
              f"timed steps ({run['timed_s']:.2f} s); lengths p50 {pct(ln, 0.5)}, p90 "
              f"{pct(ln, 0.9)}, p99 {pct(ln, 0.99)}, max {max(ln)} (n={len(ln)})",
              file=sys.stderr)
        out[name] = run
    out["speedup"] = out["fused"]["samples_per_s"] / out["stock"]["samples_per_s"]
    ln = out["fused"]["lengths"]
    out["p99_over_median"] = pct(ln, 0.99) / max(1, pct(ln, 0.5))
    print(f"{algo}: fused {out['speedup']:.2f}x stock samples/s; p99/median length "
          f"{out['p99_over_median']:.1f}", file=sys.stderr)
    return out


def _grpo_run(args: argparse.Namespace, model_dir: str, fused: bool) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_fusion.integrations.trl.fusion import FusionConfig
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
        bf16=args.bf16, use_cpu=not args.cuda, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=args.seed,
        model_init_kwargs={"dtype": "bfloat16"} if args.bf16 else None)
    cls = FusedGRPOTrainer if fused else GRPOTrainer
    # The fused trainer runs every plugin (FusionConfig's defaults: streaming, padding_free).
    fusion = {"fusion": FusionConfig()} if fused else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model_dir, reward_funcs=[vowel_reward], args=config,
                      train_dataset=tiny_prompt_dataset(None, args.batch * args.steps),
                      processing_class=tiny_tokenizer(), callbacks=[_Clock()], **fusion)
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
            "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            "fusion": {k: v for k, v in vars(fusion["fusion"]).items()} if fused else None}


QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
            "vocab": 151936}


def qwen2_model_dir(path: str, seed: int, *, eos_bias: float, hidden: int, layers: int,
                    heads: int, kv_heads: int, intermediate: int, vocab: int,
                    max_positions: int, dtype: Any) -> str:
    """A randomly initialised ``Qwen2ForCausalLM`` (tied embeddings) with the tiny character
    tokenizer, saved as a Hub-style folder; its sampled lengths are geometric as
    ``tiny_causal_lm(eos_bias=...)``'s.

    Tied embeddings rule out ``tiny_causal_lm``'s trick (an LM-head row of its own), so the
    constant feature comes from layer 0's value bias instead: attention weights sum to 1,
    so ``v_proj.bias[0]`` reaches the residual stream unchanged through ``o_proj[0, 0]``
    at every position. Only the EOS embedding reads that feature back (tied head), every
    other token's column 0 is 0: the EOS logit is ``eos_bias`` above the rest, which stay
    near 0. ``eos_bias`` is raised by ``ln((V - 1) / (len(tok) - 1))`` so the per-step EOS
    probability equals the tiny model's (tokens outside the tokenizer decode to nothing).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_fusion.testing.trl import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    if eos_bias:
        bias = eos_bias + math.log((vocab - 1) / (len(tok) - 1))
        with torch.no_grad():
            attn = model.model.layers[0].self_attn
            attn.v_proj.weight[0] = 0.0
            attn.v_proj.bias[0] = 10.0
            attn.o_proj.weight[0] = 0.0
            attn.o_proj.weight[:, 0] = 0.0
            attn.o_proj.weight[0, 0] = 1.0
            emb = model.model.embed_tokens.weight
            emb[:, 0] = 0.0
            emb[tok.eos_token_id] = 0.0
            # After the final RMSNorm the constant feature is about sqrt(hidden).
            emb[tok.eos_token_id, 0] = bias / hidden ** 0.5
    tok.save_pretrained(path)
    model.to(dtype).save_pretrained(path)
    return path


def model_dir_for(args: argparse.Namespace) -> str:
    """The benchmark's model, saved: ``--family llama`` the tiny Llama, ``qwen2`` the above."""
    path = tempfile.mkdtemp(prefix="bench-trl-model-")
    if args.family == "qwen2":
        import torch

        shape = {**QWEN_05B, "hidden": args.hidden, "layers": args.layers}
        if args.hidden != QWEN_05B["hidden"]:   # a smaller smoke-test shape
            shape.update(heads=4, kv_heads=2, intermediate=2 * args.hidden, vocab=512)
        return qwen2_model_dir(path, args.seed, eos_bias=args.eos_bias,
                               max_positions=args.max_new_tokens + 64,
                               dtype=torch.bfloat16 if args.bf16 else torch.float32, **shape)
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(path, seed=args.seed, eos_bias=args.eos_bias, hidden_size=args.hidden,
                          layers=args.layers, max_positions=args.max_new_tokens + 64)


def _dtype(args: argparse.Namespace) -> Any:
    import torch

    return torch.bfloat16 if args.bf16 else torch.float32


def bench_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """Stock ``GRPOTrainer`` vs ``FusedGRPOTrainer``: samples/s, lengths, speedup."""
    model_dir = model_dir_for(args)
    return _compare("grpo", {name: (lambda fused=fused: _grpo_run(args, model_dir, fused))
                             for name, fused in (("stock", False), ("fused", True))})


# --cuda: every algorithm's (payload, table, notes), (re)written to one file after each.
_ONE_FILE: dict[str, tuple[dict[str, Any], Any, list[str]]] = {}


def _write(algo: str, title: str, variants: Sequence[str], args: argparse.Namespace,
           runs: list[tuple[int, dict[str, Any]]], workload: Sequence[str],
           notes: Sequence[str] = ()) -> None:
    """One results file per algorithm: a row per seed and variant, the speedup per seed
    (``--cuda``: kept for :func:`_write_one_file`)."""
    rows = []
    for seed, res in runs:
        for name in variants:
            r, ln = res[name], res[name]["lengths"]
            ph = r.get("phases") or {}
            rows.append([str(seed), name, f"{r['samples_per_s']:.1f}", f"{r['timed_s']:.2f}",
                         f"{pct(ln, 0.5)} / {pct(ln, 0.9)} / {pct(ln, 0.99)} / {max(ln)}",
                         " / ".join(f"{ph[k]:.2f}" for k in (
                             "time/generation", "time/inference", "time/training"))
                         if ph else "-",
                         f"**{res['speedup']:.2f}x**" if name == "fused" else ""])
    speedups = [res["speedup"] for _, res in runs]
    payload = {
        "command": "python benchmarks/trl.py " + " ".join(sys.argv[1:]),
        "workload": {k: getattr(args, k) for k in workload},
        "seeds": [seed for seed, _ in runs],
        "speedup_min": min(speedups), "speedup_max": max(speedups),
        "runs": [{"seed": seed, **res} for seed, res in runs],
    }
    table = (title, ["seed", "trainer", "samples/s", "timed s", "lengths p50 / p90 / p99 / max",
                     "median s: generation / inference / training", "fused / stock"], rows)
    notes = [f"{algo.upper() + ' s' if args.cuda else 'S'}peedup over seeds {payload['seeds']}: "
             f"**{min(speedups):.2f}x - {max(speedups):.2f}x** (fused over stock samples/s).",
             *notes]
    if args.cuda:
        _ONE_FILE[algo] = (payload, table, notes)
        return
    path, _ = write_results(f"trl_{algo}", payload, [table], notes=notes)
    print(f"wrote {path}", file=sys.stderr)


def gpu_slug() -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
    import torch

    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


def _write_one_file(args: argparse.Namespace) -> None:
    """``--cuda``: every algorithm in ``results/trl_<gpu>.{json,md}``."""
    if not _ONE_FILE:
        return
    import torch

    payload = {"command": "python benchmarks/trl.py " + " ".join(sys.argv[1:]),
               "gpu": torch.cuda.get_device_name(), "family": args.family,
               "dtype": "bfloat16" if args.bf16 else "float32",
               **{algo: p for algo, (p, _, _) in _ONE_FILE.items()}}
    notes = [n for _, _, ns in _ONE_FILE.values() for n in ns]
    notes.append(f"Model: randomly initialised {args.family}, hidden {args.hidden}, "
                 f"{args.layers} layers" + (" (Qwen2.5-0.5B's shape: 14 heads, 2 KV heads, "
                 "intermediate 4864, vocabulary 151936, tied embeddings)"
                 if args.family == "qwen2" and args.hidden == QWEN_05B["hidden"] else "")
                 + f", {payload['dtype']}, one process on {payload['gpu']}.")
    path, _ = write_results(f"trl_{gpu_slug()}", payload,
                            [t for _, t, _ in _ONE_FILE.values()], notes=notes)
    print(f"wrote {path}", file=sys.stderr)


def _write_grpo(args: argparse.Namespace, runs: list[tuple[int, dict[str, Any]]]) -> None:
    _write("grpo", "GRPO: stock GRPOTrainer vs FusedGRPOTrainer", ("stock", "fused"), args,
           runs, ("steps", "batch", "generations", "max_new_tokens", "eos_bias", "hidden",
                  "layers", "lr", "quick", *(("family", "bf16") if args.cuda else ())),
           notes=["fused: `FusionConfig()` defaults (streamed generation and scoring, "
                  "padding-free training forward)."])


def _response_lengths(responses: Any, eos_id: int, pad_id: int) -> list[int]:
    """Tokens through the first EOS (or up to the first pad), per row of ``[B, R]``."""
    out = []
    for row in responses.tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t == eos_id:
                n = i + 1
                break
            if t == pad_id:
                n = i
                break
        out.append(n)
    return out


def _ppo_run(args: argparse.Namespace, model_dir: str, fusion: Any) -> dict[str, Any]:
    """One PPO training run: stock trl 1.12 ``PPOTrainer`` when ``fusion`` is None."""
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        TrainerCallback,
        set_seed,
    )

    from rlhf_fusion.integrations.trl import FusedPPOTrainer, PPOConfig
    from rlhf_fusion.testing.trl import tiny_prompt_dataset, tiny_tokenizer

    step_ends: list[float] = []

    class _Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_ends.append(time.perf_counter())

    tok = tiny_tokenizer()
    tok.padding_side = "left"
    prompts = tiny_prompt_dataset(None, args.batch)["prompt"]
    data = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts]})
    set_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(args))
        value, reward = (AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, dtype=_dtype(args)) for _ in range(2))
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.batch // args.micro, num_ppo_epochs=args.ppo_epochs,
        num_mini_batches=1, total_episodes=args.batch * args.steps,
        response_length=args.max_new_tokens, stop_token="eos", temperature=1.0,
        local_rollout_forward_batch_size=args.batch, learning_rate=args.lr, bf16=args.bf16,
        use_cpu=not args.cuda, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, num_sample_generations=0, seed=args.seed)
    if fusion is None:
        from trl.experimental.ppo import PPOTrainer as cls
        kw: dict[str, Any] = {}
    else:
        cls, kw = FusedPPOTrainer, {"fusion": fusion}
    lengths: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(args=config, processing_class=tok, model=policy, ref_model=None,
                      reward_model=reward, value_model=value, train_dataset=data,
                      callbacks=[_Clock()], **kw)
        if fusion is None:
            import trl.experimental.ppo.ppo_trainer as stock

            real_gen = stock.batch_generation

            def recording(model: Any, queries: Any, *a: Any, **k: Any) -> Any:
                qr, logits = real_gen(model, queries, *a, **k)
                lengths.extend(_response_lengths(qr[:, queries.shape[1]:], tok.eos_token_id,
                                                 tok.pad_token_id))
                return qr, logits

            stock.batch_generation = recording
        else:
            real_rollout = trainer._rollout

            def recording_rollout(*a: Any, **k: Any) -> Any:
                out = real_rollout(*a, **k)
                lengths.extend(_response_lengths(out.responses, tok.eos_token_id,
                                                 tok.pad_token_id))
                return out

            trainer._rollout = recording_rollout  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            if fusion is None:
                stock.batch_generation = real_gen
    total = time.perf_counter() - t0
    timed = step_ends[-1] - step_ends[0]
    logs = [h for h in trainer.state.log_history if "objective/kl" in h]
    phases = {k: statistics.median(h[k] for h in logs[1:]) for k in (
        "time/generation", "time/inference", "time/training") if logs and k in logs[0]}
    return {"samples_per_s": args.batch * (len(step_ends) - 1) / timed, "timed_s": timed,
            "total_s": total, "steps": len(step_ends), "lengths": lengths, "phases": phases,
            "scores": [h["objective/scores"] for h in logs]}


PPO_VARIANTS = ("stock", "off", "fused")


def bench_ppo(args: argparse.Namespace) -> dict[str, Any]:
    """trl 1.12's ``PPOTrainer`` vs ``FusedPPOTrainer`` (all plugins off, then on)."""
    from rlhf_fusion.integrations.trl import FusionConfig
    from rlhf_fusion.integrations.trl.ppo_config import TRL_HAS_PPO

    if not TRL_HAS_PPO:
        raise SystemExit("the PPO benchmark compares with trl 1.12's PPOTrainer: "
                         "pip install trl==1.12.0")
    model_dir = model_dir_for(args)
    fusions = {"stock": None, "off": FusionConfig.off(), "fused": FusionConfig()}
    return _compare("ppo", {name: (lambda f=fusions[name]: _ppo_run(args, model_dir, f))
                            for name in PPO_VARIANTS})


def _write_ppo(args: argparse.Namespace, runs: list[tuple[int, dict[str, Any]]]) -> None:
    _write("ppo", "PPO: trl 1.12 PPOTrainer vs FusedPPOTrainer (off = every plugin off)",
           PPO_VARIANTS, args, runs, ("steps", "batch", "micro", "ppo_epochs",
                                      "max_new_tokens", "eos_bias", "hidden", "layers", "lr",
                                      "quick", *(("family", "bf16") if args.cuda else ())))


BENCHES = {
    "grpo": (bench_grpo, _write_grpo),
    "ppo": (bench_ppo, _write_ppo),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=sorted(BENCHES))
    ap.add_argument("--steps", type=int, default=None, help="default 6 (--cuda: 5)")
    ap.add_argument("--batch", type=int, default=64, help="per-device train batch size")
    ap.add_argument("--generations", type=int, default=8, help="GRPO num_generations")
    ap.add_argument("--micro", type=int, default=8, help="PPO per-device micro-batch")
    ap.add_argument("--ppo-epochs", type=int, default=4, help="PPO epochs per batch")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eos-bias", type=float, default=0.5,
                    help="EOS logit bias of the model (per-step EOS probability)")
    ap.add_argument("--hidden", type=int, default=None, help="default 128 (qwen2: 896)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (qwen2: 24)")
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="small, so the length distribution stays what sampling gives")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="one model and sampling seed per run (default 0 1 2; --quick: 0)")
    ap.add_argument("--cuda", action="store_true",
                    help="train on the GPU: Qwen2.5-0.5B-shaped, bf16, seed 0, 5 steps unless "
                         "given; results/trl_<gpu>.{json,md}")
    ap.add_argument("--family", choices=["llama", "qwen2"], default=None,
                    help="llama: the tiny Llama (CPU default); qwen2: Qwen2.5-0.5B's shape "
                         "(--cuda default; --hidden/--layers shrink it)")
    ap.add_argument("--bf16", action="store_true", default=None,
                    help="bf16 weights and bf16 training (--cuda default)")
    ap.add_argument("--quick", action="store_true", help="a few-second smoke run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--cuda: torch sees no CUDA device (torch.cuda.is_available() is "
                             "False); drop --cuda to run on the CPU")
    args.family = args.family or ("qwen2" if args.cuda else "llama")
    args.bf16 = bool(args.cuda if args.bf16 is None else args.bf16)
    qwen = args.family == "qwen2"
    args.hidden = args.hidden or (QWEN_05B["hidden"] if qwen else 128)
    args.layers = args.layers or (QWEN_05B["layers"] if qwen else 4)
    args.steps = args.steps or (5 if args.cuda else 6)
    if args.quick:
        args.steps, args.batch, args.generations, args.max_new_tokens = 2, 8, 4, 16
        args.micro = min(args.micro, args.batch)
    seeds = args.seeds or ([0] if args.quick or args.cuda else [0, 1, 2])
    for algo in args.algos:
        bench, write = BENCHES[algo]
        runs = []
        for seed in seeds:
            args.seed = seed
            runs.append((seed, bench(args)))
        if not args.no_write:
            write(args, runs)
            if args.cuda:   # after every algorithm, so a run cut short keeps what it measured
                _write_one_file(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
