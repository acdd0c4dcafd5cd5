"""TRL trainers, stock vs rlhf-fusion's drop-in replacements: samples/s in one run, same model,
same batch, same long-tailed completion lengths (from the model's own sampling).

    python benchmarks/trl.py                     # PPO (needs trl 1.12) and GRPO
    python benchmarks/trl.py --short             # short completions: generation a small share
    python benchmarks/trl.py --processes 2       # DDP over 2 CPU processes (gloo)
    python benchmarks/trl.py --algos grpo --quick      # a few seconds, what the smoke test runs
    python benchmarks/trl.py --cuda              # one GPU: Qwen2.5-0.5B-shaped, bf16, 1 seed

Stock and fused runs alternate which goes first (``--pairs N``: N pairs per seed, the median
pair's ratio), so drift in a shared machine's load does not pick the winner; every run prints
its 1-minute load average and a per-stage split of the median step (generation, scoring,
training, other: see :class:`Phases`), and records the process CPU seconds of its timed steps
(``--threads 1 --cpu-clock``: stage times in CPU seconds, what each stage costs whatever else
the machine runs).

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


PHASES = ("generation", "scoring", "training", "other")


class Phases:
    """Wall seconds of each training step split into stages, by wrapping the functions that
    do each stage: ``generation`` (sampling; the fused side's streamed scoring is subtracted),
    ``scoring`` (Ref/Critic/Reward passes and reward functions), ``training`` (the loss
    forwards, backwards and, for PPO, the whole PPO epochs) and ``other`` (the rest of the step:
    optimizer and scheduler steps where not in ``training``, advantages, logging). A wrapped
    call nested in another is charged to its own stage only."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._children: list[float] = []
        self.totals = dict.fromkeys(PHASES[:-1], 0.0)
        self.marks: list[tuple[float, float, dict[str, float]]] = []
        self.wall: list[float] = []

    def wrap(self, fn: Any, phase: Any) -> Any:
        """``fn`` charged to ``phase`` (a stage name, or a function of no arguments giving it
        at call time)."""
        def timed(*a: Any, **k: Any) -> Any:
            self._children.append(0.0)
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                dt = self.clock() - t0
                child = self._children.pop()
                self.totals[phase() if callable(phase) else phase] += dt - child
                if self._children:
                    self._children[-1] += dt
        return timed

    def step_end(self) -> None:
        self.marks.append((self.clock(), time.process_time(), dict(self.totals)))
        self.wall.append(time.perf_counter())

    @property
    def step_ends(self) -> list[float]:
        return self.wall

    def summary(self) -> dict[str, Any]:
        """Median seconds per timed step (every step after the first) of each stage, and the
        process CPU seconds of the timed steps (every thread of the process; with one torch
        thread this is the work done, whatever else the machine ran meanwhile)."""
        per: dict[str, list[float]] = {k: [] for k in PHASES}
        for (t0, _, a), (t1, _, b) in zip(self.marks, self.marks[1:]):
            spent = {k: b[k] - a[k] for k in PHASES[:-1]}
            for k, v in spent.items():
                per[k].append(v)
            per["other"].append(t1 - t0 - sum(spent.values()))
        return {"stages": {k: statistics.median(v) for k, v in per.items() if v},
                "cpu_s": self.marks[-1][1] - self.marks[0][1]}


def _print_run(algo: str, name: str, run: dict[str, Any]) -> None:
    ln = run["lengths"]
    st = run.get("stages") or {}
    print(f"{algo} {name:>5}: {run['samples_per_s']:.1f} samples/s over {run['steps'] - 1} "
          f"timed steps ({run['timed_s']:.2f} s, cpu {run.get('cpu_s', 0.0):.2f} s); lengths "
          f"p50 {pct(ln, 0.5)}, p90 {pct(ln, 0.9)}, p99 {pct(ln, 0.99)}, max {max(ln)} "
          f"(n={len(ln)}); median s/step " + ", ".join(f"{k} {st[k]:.3f}" for k in PHASES
                                                        if k in st) + f"; load {_load()}",
          file=sys.stderr)


def _load() -> str:
    """The 1-minute load average (the machine is shared: say what the figure ran beside)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def _compare(algo: str, runs: dict[str, Any], *, pairs: int = 1, first: int = 0
             ) -> dict[str, Any]:
    """Run the variants (``runs``: name -> thunk; ``"stock"`` first in the dict) ``pairs``
    times, alternating which side goes first (``first``: 0 stock first in the first pair, 1
    fused first), so drift in the machine's load cannot favour one side; the speedup is the
    median over pairs of fused over stock samples/s of the same pair."""
    names = list(runs)
    rounds: list[dict[str, Any]] = []
    for j in range(pairs):
        order = names if (j + first) % 2 == 0 else names[::-1]
        got = {}
        for name in order:
            got[name] = runs[name]()
            got[name]["load"] = _load()
            _print_run(algo, name, got[name])
        rounds.append(got)
    out: dict[str, Any] = dict(rounds[len(rounds) // 2]) if pairs == 1 else {}
    if pairs > 1:  # keep every pair; the representative row is the median pair
        ratios = [r["fused"]["samples_per_s"] / r["stock"]["samples_per_s"] for r in rounds]
        mid = sorted(range(pairs), key=lambda i: ratios[i])[pairs // 2]
        out = dict(rounds[mid])
        out["pairs"] = rounds
    ratios = [r["fused"]["samples_per_s"] / r["stock"]["samples_per_s"] for r in rounds]
    out["speedup"] = statistics.median(ratios)
    out["pair_speedups"] = ratios
    cpu = [r["stock"]["cpu_s"] / r["stock"]["samples"] / (r["fused"]["cpu_s"]
                                                           / r["fused"]["samples"])
           for r in rounds]
    out["cpu_speedup"] = statistics.median(cpu)
    out["order"] = [list(r) for r in rounds]
    ln = out["fused"]["lengths"]
    out["p99_over_median"] = pct(ln, 0.99) / max(1, pct(ln, 0.5))
    print(f"{algo}: fused {out['speedup']:.2f}x stock samples/s (pairs "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); CPU seconds per sample "
          f"{out['cpu_speedup']:.2f}x; p99/median length {out['p99_over_median']:.1f}",
          file=sys.stderr)
    return out


def _grpo_run(args: argparse.Namespace, model_dir: str, fused: bool) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_fusion.integrations.trl import scoring
    from rlhf_fusion.integrations.trl.fusion import FusionConfig
    from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer
    from rlhf_fusion.testing.trl import tiny_prompt_dataset, tiny_tokenizer, vowel_reward

    phases = Phases(time.thread_time if args.cpu_clock else time.perf_counter)

    class _Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            phases.step_end()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = args.batch // world
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), max_steps=args.steps,
        per_device_train_batch_size=per_device, num_generations=args.generations,
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

    trainer._generate_single_turn = phases.wrap(recording, "generation")  # type: ignore[method-assign]
    trainer._generate_and_score_completions = phases.wrap(  # type: ignore[method-assign]
        trainer._generate_and_score_completions, "scoring")
    trainer.compute_loss = phases.wrap(trainer.compute_loss, "training")  # type: ignore[method-assign]
    trainer.accelerator.backward = phases.wrap(trainer.accelerator.backward, "training")
    real_score = scoring.StreamScorer.score
    scoring.StreamScorer.score = phases.wrap(real_score, "scoring")  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        scoring.StreamScorer.score = real_score  # type: ignore[method-assign]
    total = time.perf_counter() - t0
    step_ends = phases.step_ends
    timed = step_ends[-1] - step_ends[0]
    samples = args.batch * (len(step_ends) - 1)
    return {"samples_per_s": samples / timed, "timed_s": timed, "total_s": total,
            "steps": len(step_ends), "samples": samples, "lengths": lengths,
            **phases.summary(),
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


def _ddp_worker(rank: int, world: int, algo: str, variant: str, args: argparse.Namespace,
                model_dir: str) -> dict[str, Any]:
    """One rank of a ``--processes N`` run (``rlhf_fusion.launch.run_ranks`` starts the gloo
    group, accelerate attaches to it as under ``accelerate launch``): the global batch
    ``--batch`` split over the ranks, every rank timing the same steps."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    return _one_process_run(algo, variant, args, model_dir)


def _one_process_run(algo: str, variant: str, args: argparse.Namespace, model_dir: str
                     ) -> dict[str, Any]:
    if algo == "grpo":
        return _grpo_run(args, model_dir, variant == "fused")
    from rlhf_fusion.integrations.trl import FusionConfig

    fusion = {"stock": None, "off": FusionConfig.off(), "fused": FusionConfig()}[variant]
    return _ppo_run(args, model_dir, fusion)


def _run(algo: str, variant: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """One training run in this process, or over ``args.processes`` spawned ranks (DDP on
    gloo, one torch thread each); rank 0's clock and lengths, every rank's lengths pooled."""
    if args.processes == 1:
        return _one_process_run(algo, variant, args, model_dir)
    from rlhf_fusion.launch import run_ranks

    if args.batch % (args.processes * (args.micro if algo == "ppo" else 1)):
        raise SystemExit(f"--batch {args.batch} must split evenly over {args.processes} "
                         "processes (and PPO micro-batches)")
    ranks = sorted(run_ranks(_ddp_worker, args.processes, algo, variant, args, model_dir,
                             timeout=1800, collective_timeout=600),
                   key=lambda r: r.rank)
    out = dict(ranks[0].value)
    out["lengths"] = [n for r in ranks for n in r.value["lengths"]]
    out["processes"] = args.processes
    return out


def bench_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """Stock ``GRPOTrainer`` vs ``FusedGRPOTrainer``: samples/s, lengths, speedup."""
    model_dir = model_dir_for(args)
    return _compare("grpo", {name: (lambda name=name: _run("grpo", name, args, model_dir))
                             for name in ("stock", "fused")},
                    pairs=args.pairs, first=args.seed % 2)


# --cuda: every algorithm's (payload, table, notes), (re)written to one file after each.
_ONE_FILE: dict[str, tuple[dict[str, Any], Any, list[str]]] = {}


def results_name(algo: str, args: argparse.Namespace) -> str:
    """``trl_<algo>``, ``_short`` for the short-completion workload, ``_ddp<N>`` for N
    processes."""
    return (f"trl_{algo}" + ("_short" if args.short else "")
            + (f"_ddp{args.processes}" if args.processes > 1 else ""))


def _write(algo: str, title: str, variants: Sequence[str], args: argparse.Namespace,
           runs: list[tuple[int, dict[str, Any]]], workload: Sequence[str],
           notes: Sequence[str] = ()) -> None:
    """One results file per algorithm and workload: a row per seed and variant (of the
    median pair with ``--pairs``), the speedup per seed (``--cuda``: kept for
    :func:`_write_one_file`)."""
    rows = []
    for seed, res in runs:
        for name in variants:
            r, ln = res[name], res[name]["lengths"]
            st = r.get("stages") or {}
            rows.append([str(seed), name, f"{r['samples_per_s']:.1f}", f"{r['timed_s']:.2f}",
                         f"{pct(ln, 0.5)} / {pct(ln, 0.9)} / {pct(ln, 0.99)} / {max(ln)}",
                         " / ".join(f"{st[k]:.3f}" for k in PHASES) if st else "-",
                         r.get("load", "?"),
                         f"**{res['speedup']:.2f}x** ({res['cpu_speedup']:.2f}x)"
                         if name == "fused" else ""])
    speedups = [res["speedup"] for _, res in runs]
    cpu = [res["cpu_speedup"] for _, res in runs]
    payload = {
        "command": "python benchmarks/trl.py " + " ".join(sys.argv[1:]),
        "workload": {k: getattr(args, k) for k in workload},
        "processes": args.processes, "pairs": args.pairs,
        "torch_threads": 1 if args.processes > 1 else _torch_threads(),  # run_ranks: 1
        "seeds": [seed for seed, _ in runs],
        "speedup_min": min(speedups), "speedup_max": max(speedups),
        "cpu_speedup_min": min(cpu), "cpu_speedup_max": max(cpu),
        "runs": [{"seed": seed, **res} for seed, res in runs],
    }
    table = (title, ["seed", "trainer", "samples/s", "timed s", "lengths p50 / p90 / p99 / max",
                     "median s/step: " + " / ".join(PHASES), "load (1 min)",
                     "fused / stock (CPU s per sample)"], rows)
    notes = [f"{algo.upper() + ' s' if args.cuda else 'S'}peedup over seeds {payload['seeds']}: "
             f"**{min(speedups):.2f}x - {max(speedups):.2f}x** (fused over stock samples/s"
             + (f", each the median of {args.pairs} alternating pairs" if args.pairs > 1
                else ", stock and fused alternating which runs first") + "); in process CPU "
             f"seconds per sample {min(cpu):.2f}x - {max(cpu):.2f}x.",
             f"{args.processes} process(es), torch threads {payload['torch_threads']}. Stages: "
             "generation (sampling; streamed scoring subtracted), scoring (Ref/Critic/Reward "
             "passes, reward functions), training (loss forwards, backwards, optimizer steps), "
             "other (advantages, logging, the rest of the step).",
             *notes]
    if args.cuda:
        _ONE_FILE[algo] = (payload, table, notes)
        return
    path, _ = write_results(results_name(algo, args), payload, [table], notes=notes)
    print(f"wrote {path}", file=sys.stderr)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


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
                  "layers", "lr", "quick", "short", *(("family", "bf16") if args.cuda else ())),
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
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        TrainerCallback,
        set_seed,
    )

    from rlhf_fusion.integrations.trl import FusedPPOTrainer, PPOConfig
    from rlhf_fusion.integrations.trl import rollout as fused_rollout
    from rlhf_fusion.testing.trl import tiny_prompt_dataset, tiny_tokenizer

    phases = Phases(time.thread_time if args.cpu_clock else time.perf_counter)

    class _Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            phases.step_end()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = args.batch // world
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
        gradient_accumulation_steps=per_device // args.micro, num_ppo_epochs=args.ppo_epochs,
        num_mini_batches=1, total_episodes=args.batch * args.steps,
        response_length=args.max_new_tokens, stop_token="eos", temperature=1.0,
        local_rollout_forward_batch_size=per_device, learning_rate=args.lr, bf16=args.bf16,
        use_cpu=not args.cuda, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, num_sample_generations=0, seed=args.seed)
    if fusion is None:
        from trl.experimental.ppo import PPOTrainer as cls
        kw: dict[str, Any] = {}
    else:
        cls, kw = FusedPPOTrainer, {"fusion": fusion}
    lengths: list[int] = []

    def no_grad_is_scoring() -> str:
        return "training" if torch.is_grad_enabled() else "scoring"

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, fn: Any) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(args=config, processing_class=tok, model=policy, ref_model=None,
                      reward_model=reward, value_model=value, train_dataset=data,
                      callbacks=[_Clock()], **kw)
        trainer.accelerator.backward = phases.wrap(trainer.accelerator.backward, "training")
        trainer.optimizer.step = phases.wrap(trainer.optimizer.step, "training")
        if fusion is None:
            import trl.experimental.ppo.ppo_trainer as stock

            real_gen = stock.batch_generation

            def recording(model: Any, queries: Any, *a: Any, **k: Any) -> Any:
                qr, logits = real_gen(model, queries, *a, **k)
                lengths.extend(_response_lengths(qr[:, queries.shape[1]:], tok.eos_token_id,
                                                 tok.pad_token_id))
                return qr, logits

            patch(stock, "batch_generation", phases.wrap(recording, "generation"))
            for name in ("forward", "get_reward"):
                patch(stock, name, phases.wrap(getattr(stock, name), no_grad_is_scoring))
        else:
            real_rollout = trainer._rollout

            def recording_rollout(*a: Any, **k: Any) -> Any:
                out = real_rollout(*a, **k)
                lengths.extend(_response_lengths(out.responses, tok.eos_token_id,
                                                 tok.pad_token_id))
                return out

            trainer._rollout = phases.wrap(recording_rollout, "generation")  # type: ignore[method-assign]
            trainer._ppo_epochs = phases.wrap(trainer._ppo_epochs, "training")  # type: ignore[method-assign]
            patch(fused_rollout.RowScorer, "score",
                  phases.wrap(fused_rollout.RowScorer.score, "scoring"))
            patch(fused_rollout, "score_padded",
                  phases.wrap(fused_rollout.score_padded, "scoring"))
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            for owner, name, real in reversed(patched):
                setattr(owner, name, real)
    total = time.perf_counter() - t0
    step_ends = phases.step_ends
    timed = step_ends[-1] - step_ends[0]
    logs = [h for h in trainer.state.log_history if "objective/kl" in h]
    samples = args.batch * (len(step_ends) - 1)
    return {"samples_per_s": samples / timed, "timed_s": timed, "total_s": total,
            "steps": len(step_ends), "samples": samples, "lengths": lengths,
            **phases.summary(), "scores": [h["objective/scores"] for h in logs]}


PPO_VARIANTS = ("stock", "off", "fused")


def bench_ppo(args: argparse.Namespace) -> dict[str, Any]:
    """trl 1.12's ``PPOTrainer`` vs ``FusedPPOTrainer`` (all plugins off, then on)."""
    from rlhf_fusion.integrations.trl.ppo_config import TRL_HAS_PPO

    if not TRL_HAS_PPO:
        raise SystemExit("the PPO benchmark compares with trl 1.12's PPOTrainer: "
                         "pip install trl==1.12.0")
    model_dir = model_dir_for(args)
    return _compare("ppo", {name: (lambda name=name: _run("ppo", name, args, model_dir))
                            for name in PPO_VARIANTS}, pairs=args.pairs, first=args.seed % 2)


def _write_ppo(args: argparse.Namespace, runs: list[tuple[int, dict[str, Any]]]) -> None:
    _write("ppo", "PPO: trl 1.12 PPOTrainer vs FusedPPOTrainer (off = every plugin off)",
           PPO_VARIANTS, args, runs, ("steps", "batch", "micro", "ppo_epochs",
                                      "max_new_tokens", "eos_bias", "hidden", "layers", "lr",
                                      "quick", "short", *(("family", "bf16") if args.cuda else ())))


BENCHES = {
    "grpo": (bench_grpo, _write_grpo),
    "ppo": (bench_ppo, _write_ppo),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=sorted(BENCHES))
    ap.add_argument("--steps", type=int, default=None, help="default 6 (--cuda: 5)")
    ap.add_argument("--batch", type=int, default=64,
                    help="samples per step (over every process with --processes)")
    ap.add_argument("--generations", type=int, default=8, help="GRPO num_generations")
    ap.add_argument("--micro", type=int, default=8, help="PPO per-device micro-batch")
    ap.add_argument("--ppo-epochs", type=int, default=4, help="PPO epochs per batch")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eos-bias", type=float, default=None,
                    help="EOS logit bias of the model (per-step EOS probability); default 0.5 "
                         "(--short: 1.5)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="default 128 (--short: 96; qwen2: 896)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (--short: 3; qwen2: 24)")
    ap.add_argument("--short", action="store_true",
                    help="the short-completion workload: 3 layers, hidden 96, EOS bias 1.5 "
                         "(median about 5 tokens, p99 about 30), where generation is a small "
                         "share of the step; results/trl_<algo>_short.*")
    ap.add_argument("--pairs", type=int, default=1,
                    help="stock/fused pairs per seed, alternating which side runs first; the "
                         "speedup is the median pair's")
    ap.add_argument("--processes", type=int, default=1,
                    help="DDP over N spawned CPU processes (gloo, one torch thread each), "
                         "--batch split over them; results/trl_<algo>[_short]_ddp<N>.*")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="time the stages in this thread's CPU seconds instead of wall seconds "
                         "(with --threads 1: what each stage costs, whatever else the machine "
                         "runs; samples/s stays wall-clock)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads of a one-process run (default: torch's)")
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
    if args.short and (args.cuda or qwen):
        raise SystemExit("--short is the CPU short-completion workload (a tiny Llama); "
                         "drop --cuda/--family qwen2")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.hidden = args.hidden or (QWEN_05B["hidden"] if qwen else 96 if args.short else 128)
    args.layers = args.layers or (QWEN_05B["layers"] if qwen else 3 if args.short else 4)
    if args.eos_bias is None:
        args.eos_bias = 1.5 if args.short else 0.5
    args.steps = args.steps or (5 if args.cuda else 6)
    if args.quick:
        args.steps, args.batch, args.generations, args.max_new_tokens = 2, 8, 4, 16
        args.micro = min(args.micro, args.batch // args.processes)
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
