"""What running beside a busy peer costs a rank: the GRPO demo's decode step and scoring call,
timed while another process works and while it sleeps, on the same cores.

    python benchmarks/corun_interference.py [--seconds 15] [--slot-ms 50] [--hidden H --layers L]

Inter-stage fusion overlaps the tail's decoding (the destination) with scoring (the freed
rank). R_t's simulator prices a decode step by its batch size alone, fitted on serial
rollouts, where the slowest rank decodes its tail while its peers wait at the barrier. Where
ranks share a machine's caches and memory bandwidth (or, on a VM, a host core's), a step
next to a peer's scoring can cost more than that, and the overlap is then worth less than
the bound says.

Two processes, each one thread (``OMP_NUM_THREADS=1``, as the demo runs): process A runs its
work back to back and times each call; process B alternates, every ``--slot-ms`` of wall
clock, between its load and sleep. A's calls are paired by the slot they ran in (a call that
crosses a slot boundary is dropped), so the machine's drift, which on a shared VM moves a
step's cost by tens of percent within seconds, falls out of the ratio.

Cases: A decodes 8 or 32 samples (the demo's tail and its consolidated tail) beside B's
scoring (the freed rank) or decoding (a serial rollout's generation); A scores beside B's
decoding (the freed rank beside the destination) or scoring (a serial rollout's scoring).
The models are the demo's: its Actor in the generation backend, its Ref scoring
micro-batches of 4 in float64.

Writes ``results/corun_interference.{json,md}``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _harness import write_results  # noqa: E402

# benchmarks/trl.py would shadow the trl library: keep this folder off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

CASES = [("decode", 8, "score"), ("decode", 32, "score"), ("decode", 8, "decode"),
         ("decode", 32, "decode"), ("score", 4, "decode"), ("score", 4, "score")]


# What B stands for, by what A and B run.
_ROLE = {("decode", "score"): "scores (the freed rank, fused)",
         ("decode", "decode"): "decodes (serial generation)",
         ("score", "decode"): "decodes (the destination, fused)",
         ("score", "score"): "scores (serial scoring)"}


def _slot(t: float, slot: float) -> int:
    """0: B works in this slot, 1: B sleeps."""
    return int(t / slot) % 2


def _worker(role: str, work: str, batch: int, slot: float, start: float, stop: float,
            queue: Any, model: dict[str, int]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import random

    import torch

    torch.set_num_threads(1)
    from rlhf_fusion.loop.arithmetic import arithmetic_prompts
    from rlhf_fusion.loop.demo_grpo import grpo_demo_config
    from rlhf_fusion.loop.models import causal_lm, load_tokenizer
    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.rollout.reference import ReferenceBackend
    from rlhf_fusion.rollout.types import SampleResult, SampleSpec

    cfg = grpo_demo_config()
    cfg.models.actor.update(model)
    tok = load_tokenizer(cfg.models)
    vocab = int(tok.vocab_size)
    backend = ReferenceBackend(causal_lm(cfg.models.actor, vocab, seed=0),
                               max_batch_size=cfg.generation.bs_max)
    ref = InferenceModels(causal_lm(cfg.models.actor, vocab, seed=1), lambda p, r: 0.0, None,
                          micro_batch=4, values=False)
    prompts = [tuple(tok.encode(p)) for p in arithmetic_prompts()]
    rng = random.Random(0)
    # Finished samples of the demo's lengths (its completions run 3 to 32 tokens).
    finished = [SampleResult(i, prompts[i % len(prompts)],
                             tuple(rng.randrange(vocab) for _ in range(rng.randint(3, 32))),
                             (), "length") for i in range(256)]
    calls = {0: [], 1: []}
    n = 0

    def timed(fn: Any) -> None:
        t, a = time.time(), time.perf_counter()
        fn()
        d = time.perf_counter() - a
        if role == "A" and _slot(t, slot) == _slot(t + d, slot):
            calls[_slot(t, slot)].append(d)

    def score() -> None:
        nonlocal n
        k = n % (len(finished) // 4)
        n += 1
        ref.score(finished[4 * k: 4 * k + 4])

    def decode(until: float | None = None) -> None:
        nonlocal n
        n += 1
        # No stop token: every sample runs the demo's 32 new tokens, the batch stays whole.
        backend.submit([SampleSpec(100_000 * n + i, prompts[(n + i) % len(prompts)],
                                   cfg.generation.max_new_tokens, seed=i)
                        for i in range(batch)])
        while backend.unfinished():
            timed(backend.step) if role == "A" else backend.step()
            if until is not None and time.time() >= until:
                backend.abort(backend.unfinished())
                return

    while time.time() < start:
        time.sleep(0.005)
    while time.time() < stop:
        if role == "A":
            decode() if work == "decode" else timed(score)
            continue
        t = time.time()
        if _slot(t, slot) == 1:
            time.sleep(slot - t % slot + 1e-4)
        elif work == "score":
            score()
        else:
            decode(until=(int(t / slot) + 1) * slot)
    queue.put((role, calls))


def run_case(a_work: str, batch: int, b_work: str, seconds: float, slot: float,
             model: dict[str, int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # Both processes build their models first (a few seconds), then start on the same clock.
    start = time.time() + 15
    stop = start + seconds
    procs = [ctx.Process(target=_worker,
                         args=("A", a_work, batch, slot, start, stop, queue, model)),
             ctx.Process(target=_worker,
                         args=("B", b_work, 16, slot, start, stop, queue, model))]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=stop - time.time() + 120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    calls = got["A"]
    busy, idle = statistics.median(calls[0]), statistics.median(calls[1])
    return {"a": a_work, "batch": batch, "b": b_work, "busy_ms": 1e3 * busy,
            "idle_ms": 1e3 * idle, "slowdown": busy / idle,
            "n_busy": len(calls[0]), "n_idle": len(calls[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="timed seconds per case")
    ap.add_argument("--slot-ms", type=float, default=50.0,
                    help="B's work/sleep alternation period (ms)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="the Actor's (and Ref's) hidden size instead of the demo's; results go "
                         "to corun_interference_h<hidden>_l<layers>")
    ap.add_argument("--layers", type=int, default=None, help="likewise, its layers")
    args = ap.parse_args(argv)
    from rlhf_fusion.loop.demo_grpo import grpo_demo_config

    demo = grpo_demo_config().models.actor
    model = {"hidden": args.hidden or demo["hidden"], "layers": args.layers or demo["layers"]}
    name = ("corun_interference" if model == {k: demo[k] for k in model}
            else f"corun_interference_h{model['hidden']}_l{model['layers']}")
    rows = []
    for a_work, batch, b_work in CASES:
        r = run_case(a_work, batch, b_work, args.seconds, args.slot_ms / 1e3, model)
        rows.append(r)
        what = (f"decode step, {batch} samples" if a_work == "decode"
                else f"scoring call, {batch} samples")
        print(f"A's {what}, B {b_work}s: {r['busy_ms']:.3f} ms beside B's work, "
              f"{r['idle_ms']:.3f} ms while B sleeps: x{r['slowdown']:.3f} "
              f"({r['n_busy']}/{r['n_idle']} calls)", flush=True)
    table = [[f"{'decode step' if r['a'] == 'decode' else 'scoring call'}, {r['batch']} samples",
              _ROLE[r["a"], r["b"]],
              f"{r['busy_ms']:.3f}", f"{r['idle_ms']:.3f}", f"x{r['slowdown']:.3f}",
              f"{r['n_busy']}/{r['n_idle']}"] for r in rows]
    command = " ".join(["python benchmarks/corun_interference.py",
                        *(argv if argv is not None else sys.argv[1:])])
    write_results(name,
                  {"command": command, "seconds": args.seconds, "slot_ms": args.slot_ms,
                   "cores": os.cpu_count(), "model": model, "rows": rows},
                  [("A's call beside B's work and beside B's sleep (medians, ms)",
                    ["A runs", "B", "B works", "B sleeps", "slowdown", "calls"], table)],
                  ["Paired by 50 ms slots of wall clock (B works in one, sleeps in the next), "
                   "so drift cancels; one thread per process (OMP_NUM_THREADS=1). The demo's "
                   "Actor (decode, no stop token) and Ref (scoring micro-batches of 4, "
                   f"float64), Llama, hidden {model['hidden']}, {model['layers']} layers."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
