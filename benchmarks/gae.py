"""GAE benchmark: the blocked formulation against the reverse loop as TRL and verl write it.

    python benchmarks/gae.py            # CPU rows always; GPU rows when CUDA is available

CPU: B=64, T=2048, float32: ``gae_torch`` (blocked matrix product) vs the TRL loop ("zero"
semantics) and the verl loop ("skip" semantics, multi-turn mask with holes), with 1 thread and
with all cores. Bar: at least 50x.

GPU: B=256, T=4096: the Triton kernel's achieved bandwidth (unique bytes read and written:
rewards, values, mask, advantages, returns) against the device's measured copy bandwidth (bar:
at least 60%), and its speed against the same loops on the GPU (bar: at least 100x).

Writes ``benchmarks/results/gae.json`` and ``benchmarks/results/gae.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if "--smoke" in sys.argv:  # the GPU code path on CPU tensors, under the Triton interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import (  # noqa: E402
    NOT_MEASURED,
    copy_bandwidth,
    fmt_time,
    time_cpu,
    time_cuda,
    time_cuda_graph,
    write_results,
)

from rlhf_fusion.triton_kernels import gae_reference, gae_torch  # noqa: E402

GAMMA, LAM = 0.99, 0.95
CPU_SHAPE = (64, 2048)
GPU_SHAPE = (256, 4096)
CPU_BAR, GPU_BW_BAR, GPU_SPEED_BAR = 50.0, 0.60, 100.0


# --------------------------------------------------------------------------------------------
# the baselines, as the trainers write them (whitening left out: gae() does not whiten)
# --------------------------------------------------------------------------------------------


def trl_loop(rewards, values, padding_mask, gamma=GAMMA, lam=LAM):
    """trl's PPOTrainer.train, "compute advantages and returns": zero the padding, then the
    reverse loop (``gae_reference``, what FusedPPOTrainer runs with its GAE plugin off)."""
    return gae_reference(rewards, values, ~padding_mask, gamma=gamma, lam=lam,
                         dtype=rewards.dtype)


def verl_loop(token_level_rewards, values, response_mask, gamma=GAMMA, lam=LAM):
    """verl.trainer.ppo.core_algos.compute_gae_advantage_return."""
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
    return advantages, returns


def make_inputs(bsz: int, steps: int, device: str, seed: int = 0):
    """Right-padded responses (lengths in [T/2, T]) and a multi-turn variant with holes."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bsz, steps, generator=gen)
    values = torch.randn(bsz, steps, generator=gen)
    lens = torch.randint(steps // 2, steps + 1, (bsz,), generator=gen)
    right = torch.arange(steps)[None, :] < lens[:, None]
    holes = right.clone()
    for b in range(bsz):  # observation/tool tokens between turns
        t = int(torch.randint(50, 200, (1,), generator=gen))
        while t < steps:
            span = int(torch.randint(10, 60, (1,), generator=gen))
            holes[b, t : t + span] = False
            t += span + int(torch.randint(100, 400, (1,), generator=gen))
    return tuple(x.to(device) for x in (rewards, values, right, holes))


def cases(rewards, values, right, holes):
    """(semantics, baseline name, baseline call, blocked call, mask description)."""
    pad = ~right
    fmask = holes.to(rewards.dtype)
    return [
        (
            "zero",
            "TRL loop",
            lambda: trl_loop(rewards, values, pad),
            lambda: gae_torch(rewards, values, right, gamma=GAMMA, lam=LAM, semantics="zero"),
            "right padding",
        ),
        (
            "skip",
            "verl loop",
            lambda: verl_loop(rewards, values, fmask),
            lambda: gae_torch(rewards, values, holes, gamma=GAMMA, lam=LAM, semantics="skip"),
            "multi-turn holes",
        ),
    ]


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------


def _median_ratio(pairs: list, key: str) -> float:
    return statistics.median(loop[key] / blocked[key] for loop, blocked in pairs)


def bench_cpu(rounds: int, pairs_per_case: int = 7) -> list[dict]:
    bsz, steps = CPU_SHAPE
    rewards, values, right, holes = make_inputs(bsz, steps, "cpu")
    rows = []
    thread_counts = sorted({1, os.cpu_count() or 1})
    for rnd in range(rounds):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for semantics, base_name, base, blocked, mask_desc in cases(
                rewards, values, right, holes
            ):
                err = max_diff(blocked(), base())
                load_before = os.getloadavg()[0]
                # Paired measurements: each loop call is followed by blocked calls, so both
                # see the same machine load (this box is shared); the speedup is the median of
                # the per-pair ratios.
                pairs = []
                for _ in range(pairs_per_case):
                    t_l = time_cpu(base, repeat=1, warmup=0)
                    t_b = time_cpu(blocked, repeat=15, warmup=2)
                    pairs.append((t_l, t_b))
                speed = _median_ratio(pairs, "median_s")
                cpu_speed = _median_ratio(pairs, "thread_cpu_median_s") if threads == 1 else None
                loops = [p[0]["median_s"] for p in pairs]
                blks = [p[1]["median_s"] for p in pairs]
                t_loop = {"median_s": statistics.median(loops), "min_s": min(loops)}
                t_blk = {"median_s": statistics.median(blks), "min_s": min(blks)}
                rows.append(
                    {
                        "round": rnd + 1,
                        "threads": threads,
                        "semantics": semantics,
                        "mask": mask_desc,
                        "baseline": base_name,
                        "loop_s": t_loop["median_s"],
                        "blocked_s": t_blk["median_s"],
                        "loop_min_s": t_loop["min_s"],
                        "blocked_min_s": t_blk["min_s"],
                        "speedup": speed,
                        "speedup_of_minima": t_loop["min_s"] / t_blk["min_s"],
                        "speedup_thread_cpu_time": cpu_speed,
                        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                        "pairs": len(pairs),
                        "max_abs_diff": err,
                        "bar": CPU_BAR,
                        "meets_bar": speed >= CPU_BAR,
                        "meets_bar_cpu_time": None if cpu_speed is None else cpu_speed >= CPU_BAR,
                    }
                )
                print(
                    f"cpu round {rnd + 1} threads={threads} {semantics:4s} {base_name}: "
                    f"loop {fmt_time(t_loop['median_s'])}, blocked {fmt_time(t_blk['median_s'])}, "
                    f"{speed:.0f}x wall"
                    + ("" if cpu_speed is None else f", {cpu_speed:.0f}x thread CPU time")
                    + f", max|diff| {err:.1e}",
                    flush=True,
                )
    torch.set_num_threads(max(thread_counts))
    return rows


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def bench_gpu(device: str = "cuda", shape: tuple[int, int] = GPU_SHAPE) -> dict:
    from rlhf_fusion.triton_kernels import gae_triton

    bsz, steps = shape
    rewards, values, right, holes = make_inputs(bsz, steps, device)
    if device == "cuda":
        timer, kernel_timer = time_cuda, time_cuda_graph
        copy = copy_bandwidth()
    else:  # --smoke
        timer = lambda fn, rep_ms=0: time_cpu(fn, repeat=1, warmup=0)  # noqa: E731
        kernel_timer = timer
        copy = {"gbps": 1.0}
    print(f"gpu copy bandwidth {copy['gbps']:.0f} GB/s", flush=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        r, v = rewards.to(dtype), values.to(dtype)
        # the loop runs on the same (rounded) inputs the kernel reads
        rounded = (r.float(), v.float(), right, holes)
        for semantics, base_name, base, _, mask_desc in cases(*rounded):
            mask = right if semantics == "zero" else holes
            kernel = lambda r=r, v=v, m=mask, s=semantics: gae_triton(  # noqa: E731
                r, v, m, gamma=GAMMA, lam=LAM, semantics=s
            )
            err = max_diff(kernel(), base())
            t_k = kernel_timer(kernel)
            elem = r.element_size() * 2 + mask.element_size() + 4 * 2
            nbytes = bsz * steps * elem
            gbps = nbytes / t_k["median_s"] / 1e9
            row = {
                "semantics": semantics,
                "mask": mask_desc,
                "dtype": str(dtype).replace("torch.", ""),
                "kernel_s": t_k["median_s"],
                "per_call_s": t_k.get("eager_s", t_k["median_s"]),
                "bytes": nbytes,
                "gbps": gbps,
                "copy_gbps": copy["gbps"],
                "fraction_of_copy": gbps / copy["gbps"],
                "bandwidth_bar": GPU_BW_BAR,
                "max_abs_diff_vs_loop": err,
            }
            if dtype == torch.float32:
                t_loop = timer(base, rep_ms=1000)
                blocked = lambda m=mask, s=semantics: gae_torch(  # noqa: E731
                    rewards, values, m, gamma=GAMMA, lam=LAM, semantics=s
                )
                t_torch = timer(blocked)
                row.update(
                    baseline=base_name,
                    loop_s=t_loop["median_s"],
                    speedup_vs_loop=t_loop["median_s"] / t_k["median_s"],
                    speed_bar=GPU_SPEED_BAR,
                    torch_blocked_s=t_torch["median_s"],
                )
            row["meets_bars"] = row["fraction_of_copy"] >= GPU_BW_BAR and (
                row.get("speedup_vs_loop", GPU_SPEED_BAR) >= GPU_SPEED_BAR
            )
            rows.append(row)
            print(f"gpu {row}", flush=True)
    return {"shape": list(shape), "copy": copy, "rows": rows}


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="CPU measurement rounds")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run the GPU code path on tiny CPU shapes under TRITON_INTERPRET=1; writes nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        res = bench_gpu(device="cpu", shape=(3, 700))
        for row in res["rows"]:
            assert row["max_abs_diff_vs_loop"] < 1e-3, row
        print("smoke ok")
        return

    cpu_rows = bench_cpu(args.rounds)
    gpu = None
    gpu_reason = None
    if args.no_gpu:
        gpu_reason = "skipped (--no-gpu)"
    elif not torch.cuda.is_available():
        gpu_reason = "no CUDA device in this run"
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            gpu_reason = "triton is not installed"
    if gpu_reason is None:
        gpu = bench_gpu()

    cpu_table = [
        (
            r["round"],
            r["threads"],
            r["semantics"],
            r["mask"],
            r["baseline"],
            fmt_time(r["loop_s"]),
            fmt_time(r["blocked_s"]),
            f"{r['speedup']:.0f}x",
            f"{r['speedup_of_minima']:.0f}x",
            "-" if r["speedup_thread_cpu_time"] is None else f"{r['speedup_thread_cpu_time']:.0f}x",
            f"{r['max_abs_diff']:.1e}",
            "{:.1f} / {:.1f}".format(*r["loadavg_1min"]),
            "yes" if r["meets_bar"] else "NO",
        )
        for r in cpu_rows
    ]
    gpu_header = (
        "semantics",
        "input dtype",
        "kernel",
        "per call (eager)",
        "GB/s",
        "copy GB/s",
        "% of copy (bar 60%)",
        "loop",
        "speedup (bar 100x)",
        "max abs diff",
    )
    if gpu is None:
        gpu_table = [
            (sem, dt, *([NOT_MEASURED] * 8))
            for sem in ("zero", "skip")
            for dt in ("float32", "bfloat16")
        ]
    else:
        gpu_table = [
            (
                r["semantics"],
                r["dtype"],
                fmt_time(r["kernel_s"]),
                fmt_time(r["per_call_s"]),
                f"{r['gbps']:.0f}",
                f"{r['copy_gbps']:.0f}",
                f"{100 * r['fraction_of_copy']:.0f}%",
                fmt_time(r.get("loop_s")),
                f"{r['speedup_vs_loop']:.0f}x" if "speedup_vs_loop" in r else "-",
                f"{r['max_abs_diff_vs_loop']:.1e}",
            )
            for r in gpu["rows"]
        ]
    notes = [
        "CPU: `gae_torch` (blocked matrix product in torch) against the reverse Python loop "
        "written as TRL (zero semantics, right padding) and verl (skip semantics, multi-turn "
        "mask with holes) write it, whitening excluded. `threads` is `torch.set_num_threads`. "
        "Each row: 7 pairs of (one loop call, median of 15 blocked calls) taken back to back; "
        "times are medians over the pairs, the speedup is the median of the per-pair ratios "
        "(and, for reference, fastest loop / fastest blocked). With one thread, the median ratio "
        "of the calling thread's CPU time is also given: it leaves out time the core spent on "
        "other jobs. Each round is a full repeat. "
        "The 2-core machine is shared with other jobs, so the 2-thread rows in particular are "
        "noisy: with both cores requested, torch's intra-op threads wait for a core another job "
        "holds (1-minute load average on 2 cores shown per row).",
        "GPU: the Triton kernel; bytes counted once each: rewards, values, mask read, "
        "advantages and returns written (float32 outputs). Copy bandwidth: a 1 GiB "
        "device-to-device copy (read + write). Kernel times: 20 calls, each after a 256 MiB L2 "
        "flush, replayed as one CUDA graph, minus a graph of the flushes alone (median of 7 "
        "replays), so the host's launch cost is left out; `per call (eager)` is "
        "`triton.testing.do_bench`'s median of Python calls, launch cost included. The loops "
        "and the blocked torch path are timed eagerly, as trainers run them.",
    ]
    if gpu is None:
        notes.append(
            f"GPU rows: {NOT_MEASURED} -- {gpu_reason}. Rerun `python benchmarks/gae.py` on a "
            "CUDA machine to fill them."
        )
    payload = {
        "command": "python benchmarks/gae.py" + (" --no-gpu" if args.no_gpu else ""),
        "gamma": GAMMA,
        "lam": LAM,
        "cpu": {"shape": list(CPU_SHAPE), "dtype": "float32", "bar": CPU_BAR, "rows": cpu_rows},
        "gpu": gpu if gpu is not None else {"status": NOT_MEASURED, "reason": gpu_reason},
    }
    tables = [
        (
            f"CPU: blocked torch vs reverse loop, B={CPU_SHAPE[0]}, T={CPU_SHAPE[1]}, float32",
            (
                "round",
                "threads",
                "semantics",
                "mask",
                "baseline",
                "loop",
                "blocked torch",
                "speedup (median of pairs)",
                "speedup (min / min)",
                "speedup (thread CPU time)",
                "max abs diff",
                "load avg before / after",
                "median >= 50x",
            ),
            cpu_table,
        ),
        (f"GPU: Triton kernel, B={GPU_SHAPE[0]}, T={GPU_SHAPE[1]}", gpu_header, gpu_table),
    ]
    paths = write_results("gae", payload, tables, notes)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
