"""Paged decode attention benchmark (GPU).

    python benchmarks/decode.py

Headline: B=64, context 2048, 32 query heads, 8 KV heads, head dim 128, bf16, page size 16. The
Triton kernel's achieved bandwidth (bytes of K and V read, plus queries, outputs and block
table) against the device's measured copy bandwidth (bar: at least 70%), and its time against
torch SDPA on the same cache contents (SDPA needs them dense: it is timed on a contiguous copy,
and also including the gather from the pages). Then a sweep over batch, context, GQA ratio and
page size with achieved GB/s.

Without a CUDA device every row is written as "not measured". Writes
``benchmarks/results/decode.json`` and ``benchmarks/results/decode.md``.
"""

from __future__ import annotations

import argparse
import os
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
    time_cuda_graph,
    write_results,
)

HEADLINE = dict(batch=64, context=2048, q_heads=32, kv_heads=8, head_dim=128, page=16)
BW_BAR = 0.70
MAX_KV_BYTES = 8 * 2**30


def sweep_points() -> list[dict]:
    points = []
    for batch in (1, 8, 64, 256):
        points.append({**HEADLINE, "batch": batch, "vary": "batch"})
    for context in (512, 8192, 32768):
        points.append({**HEADLINE, "context": context, "vary": "context"})
    for kv_heads in (32, 4, 1):  # GQA ratio 1, 8, 32
        points.append({**HEADLINE, "kv_heads": kv_heads, "vary": "gqa"})
    for page in (1, 64):
        points.append({**HEADLINE, "page": page, "vary": "page"})
    return [p for p in points if kv_bytes(p) <= MAX_KV_BYTES]


def kv_bytes(p: dict, elt: int = 2) -> int:
    return 2 * p["batch"] * p["context"] * p["kv_heads"] * p["head_dim"] * elt


def build(p: dict, device: str, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, ctx, page = p["batch"], p["context"], p["page"]
    per_seq = -(-ctx // page)
    pool = batch * per_seq
    shape = (pool, page, p["kv_heads"], p["head_dim"])
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    table = torch.randperm(pool, generator=gen, device=device).view(batch, per_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, p["q_heads"], p["head_dim"], generator=gen, device=device, dtype=dtype)
    return q, k_cache, v_cache, table, seq_lens


def dense(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[pool, page, Hkv, D] pages -> contiguous [B, Hkv, ctx, D] (what SDPA needs)."""
    g = cache[table.long()]  # [B, pages, page, Hkv, D]
    b, n, page, h, d = g.shape
    return g.reshape(b, n * page, h, d)[:, :ctx].permute(0, 2, 1, 3).contiguous()


def bench_point(p: dict, copy_gbps: float, with_sdpa: bool, device: str = "cuda") -> dict:
    from rlhf_fusion.triton_kernels import decode_attention_triton

    timer = time_cuda_graph if device == "cuda" else lambda fn: time_cpu(fn, repeat=1, warmup=0)
    q, k_cache, v_cache, table, seq_lens = build(p, device)
    scale = p["head_dim"] ** -0.5
    kernel = lambda: decode_attention_triton(  # noqa: E731
        q, k_cache, v_cache, table, seq_lens, sm_scale=scale
    )
    out = kernel()
    t_k = timer(kernel)
    nbytes = (
        kv_bytes(p, k_cache.element_size())
        + 2 * q.numel() * q.element_size()  # q read, output written
        + table.numel() * table.element_size()
        + seq_lens.numel() * 4
    )
    row = {
        **{k: p[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim", "page")},
        "vary": p.get("vary", "headline"),
        "kernel_s": t_k["median_s"],
        "per_call_s": t_k.get("eager_s", t_k["median_s"]),
        "bytes": nbytes,
        "gbps": nbytes / t_k["median_s"] / 1e9,
        "fraction_of_copy": nbytes / t_k["median_s"] / 1e9 / copy_gbps,
    }
    if with_sdpa:
        kd = dense(k_cache, table, p["context"])
        vd = dense(v_cache, table, p["context"])
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q[:, :, None], kd, vd, scale=scale, enable_gqa=True
        )
        ref = sdpa()[:, :, 0]
        t_s = timer(sdpa)

        def gather_sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None],
                dense(k_cache, table, p["context"]),
                dense(v_cache, table, p["context"]),
                scale=scale,
                enable_gqa=True,
            )

        t_g = timer(gather_sdpa)
        row.update(
            sdpa_dense_s=t_s["median_s"],
            sdpa_with_gather_s=t_g["median_s"],
            speedup_vs_sdpa_dense=t_s["median_s"] / t_k["median_s"],
            speedup_vs_sdpa_with_gather=t_g["median_s"] / t_k["median_s"],
            max_abs_diff_vs_sdpa=float((out.float() - ref.float()).abs().max()),
        )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run the GPU code path on tiny CPU shapes under TRITON_INTERPRET=1; writes nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        tiny = dict(batch=2, context=40, q_heads=8, kv_heads=2, head_dim=32, page=16)
        for p in ({**tiny, "vary": "headline"}, {**tiny, "page": 1, "vary": "page"}):
            row = bench_point(p, copy_gbps=1.0, with_sdpa=p["vary"] == "headline", device="cpu")
            print("smoke", row)
            assert row.get("max_abs_diff_vs_sdpa", 0.0) < 5e-2, row
        return
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device in this run"
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            reason = "triton is not installed"

    headline_header = (
        "shape",
        "kernel",
        "per call (eager)",
        "GB/s",
        "copy GB/s",
        "% of copy (bar 70%)",
        "SDPA (dense copy)",
        "SDPA (gather + dense)",
        "speedup vs SDPA dense",
        "max abs diff",
    )
    sweep_header = (
        "varied", "B", "context", "Hq/Hkv", "page", "kernel", "per call (eager)", "GB/s",
        "% of copy",
    )  # fmt: skip
    shape_desc = (
        f"B={HEADLINE['batch']}, ctx={HEADLINE['context']}, {HEADLINE['q_heads']}q/"
        f"{HEADLINE['kv_heads']}kv heads, d={HEADLINE['head_dim']}, bf16, page {HEADLINE['page']}"
    )
    if reason is not None:
        payload = {
            "command": "python benchmarks/decode.py",
            "headline": {**HEADLINE, "dtype": "bfloat16", "status": NOT_MEASURED},
            "status": NOT_MEASURED,
            "reason": reason,
            "sweep": [{**p, "status": NOT_MEASURED} for p in sweep_points()],
        }
        headline_rows = [(shape_desc, *([NOT_MEASURED] * 9))]
        sweep_rows = [
            (
                p["vary"],
                p["batch"],
                p["context"],
                f"{p['q_heads']}/{p['kv_heads']}",
                p["page"],
                NOT_MEASURED,
                NOT_MEASURED,
                NOT_MEASURED,
                NOT_MEASURED,
            )
            for p in sweep_points()
        ]
        notes = [
            f"All rows {NOT_MEASURED}: {reason}. The kernel's correctness is covered on CPU by "
            "tests/test_decode_attention.py under TRITON_INTERPRET=1 and its sm_80/sm_90 "
            "compilation (no register spills) by tests/test_kernel_compile.py; rerun "
            "`python benchmarks/decode.py` on a CUDA machine to fill this table."
        ]
    else:
        copy = copy_bandwidth()
        print(f"copy bandwidth {copy['gbps']:.0f} GB/s", flush=True)
        head = bench_point({**HEADLINE, "vary": "headline"}, copy["gbps"], with_sdpa=True)
        print("headline", head, flush=True)
        sweep = []
        for p in sweep_points():
            row = bench_point(p, copy["gbps"], with_sdpa=False)
            torch.cuda.empty_cache()
            print("sweep", row, flush=True)
            sweep.append(row)
        payload = {
            "command": "python benchmarks/decode.py",
            "copy": copy,
            "bandwidth_bar": BW_BAR,
            "headline": {**head, "dtype": "bfloat16", "meets_bandwidth_bar": (
                head["fraction_of_copy"] >= BW_BAR
            ), "faster_than_sdpa": head["speedup_vs_sdpa_dense"] > 1.0},
            "sweep": sweep,
        }  # fmt: skip
        headline_rows = [
            (
                shape_desc,
                fmt_time(head["kernel_s"]),
                fmt_time(head["per_call_s"]),
                f"{head['gbps']:.0f}",
                f"{copy['gbps']:.0f}",
                f"{100 * head['fraction_of_copy']:.0f}%",
                fmt_time(head["sdpa_dense_s"]),
                fmt_time(head["sdpa_with_gather_s"]),
                f"{head['speedup_vs_sdpa_dense']:.2f}x",
                f"{head['max_abs_diff_vs_sdpa']:.1e}",
            )
        ]
        sweep_rows = [
            (
                r["vary"],
                r["batch"],
                r["context"],
                f"{r['q_heads']}/{r['kv_heads']}",
                r["page"],
                fmt_time(r["kernel_s"]),
                fmt_time(r["per_call_s"]),
                f"{r['gbps']:.0f}",
                f"{100 * r['fraction_of_copy']:.0f}%",
            )
            for r in sweep
        ]
        notes = [
            "Bytes: K and V of every cached token read once, queries read, outputs written, "
            "block table and lengths read. Copy bandwidth: 1 GiB device-to-device copy "
            "(read + write). Kernel and SDPA times: 20 calls, each after a 256 MiB L2 flush, "
            "replayed as one CUDA graph, minus a graph of the flushes alone (median of 7 "
            "replays), so the host's launch cost is left out; `per call (eager)` is "
            "triton.testing.do_bench's median of Python calls, launch cost included. "
            "SDPA runs on a contiguous [B, Hkv, ctx, D] copy of the same cache (enable_gqa)."
        ]
    tables = [
        ("Headline", headline_header, headline_rows),
        ("Sweep (one factor at a time around the headline, bf16)", sweep_header, sweep_rows),
    ]
    paths = write_results("decode", payload, tables, notes)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
