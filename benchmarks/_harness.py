"""Small shared harness for the kernel benchmarks: device description, timing, copy bandwidth,
and writing ``benchmarks/results/<name>.json`` plus a Markdown table next to it."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NOT_MEASURED = "not measured"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sms"] = props.multi_processor_count
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def time_cpu(
    fn: Callable[[], Any], *, repeat: int = 20, warmup: int = 2, min_time: float = 0.0
) -> dict[str, float]:
    """Seconds per call over ``repeat`` calls (after warm-up): wall-clock median and min, and the
    median CPU time of the calling thread (``thread_cpu_median_s``).

    With one torch thread all work runs on the calling thread, so its CPU time is the cost of
    the call without the time the OS gave the core to other jobs -- the robust number on a
    shared machine. With more threads, only the wall-clock numbers mean anything.
    """
    for _ in range(warmup):
        fn()
    times, cpu = [], []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "thread_cpu_median_s": statistics.median(cpu),
        "calls": len(times),
    }


def time_cuda(fn: Callable[[], Any], *, rep_ms: float = 200.0) -> dict[str, float]:
    """GPU seconds per call from CUDA events, L2 flushed between calls (triton.testing.do_bench)."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    ms_min = triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="min")
    return {"median_s": ms / 1e3, "min_s": ms_min / 1e3}


def time_cuda_graph(fn: Callable[[], Any], *, reps: int = 20, rounds: int = 7) -> dict[str, float]:
    """GPU seconds per call of a kernel without the host's launch cost, plus the eager per-call time.

    A small kernel (tens of microseconds) finishes before Python has launched the next one, so
    eager event timing (``do_bench``) measures the launcher, not the kernel. Here ``reps`` calls,
    each after a 256 MiB L2 flush, are captured in one CUDA graph and replayed; a graph of the
    flushes alone is timed the same way and subtracted. ``eager_s`` is ``do_bench``'s median: what
    one call costs a caller that launches it from Python.
    """
    import triton.testing

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()

    def capture(body: Callable[[], Any]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                body()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()  # warm
        times = []
        for _ in range(rounds):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    both = capture(lambda: (flush.zero_(), fn()))
    flushes = capture(flush.zero_)
    per_call_ms = max(replay_ms(both) - replay_ms(flushes), 0.0) / reps
    eager_ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return {"median_s": per_call_ms / 1e3, "eager_s": eager_ms / 1e3}


def copy_bandwidth(nbytes: int = 2**30) -> dict[str, float]:
    """Device copy bandwidth: a ``nbytes`` device-to-device copy, bytes read + written / time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src))
    return {
        "bytes_per_copy": 2 * nbytes,
        "seconds": t["median_s"],
        "gbps": 2 * nbytes / t["median_s"] / 1e9,
        "gbps_best": 2 * nbytes / t["min_s"] / 1e9,
    }


def write_results(
    name: str,
    payload: dict[str, Any],
    tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]],
    notes: Sequence[str] = (),
) -> tuple[str, str]:
    """Write ``results/<name>.json`` (payload + device + timestamp) and ``results/<name>.md``
    (one Markdown table per ``(title, header, rows)``)."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    payload = {
        "benchmark": name,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_info(),
        **payload,
    }
    json_path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(json_path, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False)
        fh.write("\n")
    dev = payload["device"]
    lines = [f"# {name} benchmark", ""]
    lines.append(f"- date (UTC): {payload['date_utc']}")
    lines.append(f"- CPU: {dev['cpu']} ({dev['cpu_cores']} cores)")
    lines.append(f"- GPU: {dev['gpu'] or 'none available in this run'}")
    lines.append(f"- torch {dev['torch']}, triton {dev['triton']}")
    lines.append(f"- command: `{payload.get('command', '')}`")
    lines.append("")
    for title, header, rows in tables:
        lines.append(f"## {title}")
        lines.append("")
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            lines.append("| " + " | ".join(_fmt(x) for x in row) + " |")
        lines.append("")
    for note in notes:
        lines.append(note)
        lines.append("")
    md_path = os.path.join(RESULTS_DIR, f"{name}.md")
    with open(md_path, "w") as fh:
        fh.write("\n".join(lines).rstrip() + "\n")
    return json_path, md_path


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3g}"
    return str(x)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return NOT_MEASURED
    if seconds >= 1e-1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
