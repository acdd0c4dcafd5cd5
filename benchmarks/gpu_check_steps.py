"""The Python steps of ``benchmarks/gpu_check.sh``: each checks one GPU path and exits non-zero
when it breaks. ``--cpu`` runs the same code with tiny shapes, as a smoke test.

    python benchmarks/gpu_check_steps.py lightning [--cpu]    # FusedPPOModule, 1 device
    python benchmarks/gpu_check_steps.py offload [--cpu]      # HostOffload's prefetch, GB-sized
    python benchmarks/gpu_check_steps.py loop-metrics DIR N   # the loop's metrics.jsonl

Shapes on the GPU: Qwen2.5-0.5B's (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocabulary 151936, tied embeddings) for Lightning; Qwen2.5-1.5B's (about 3.1 GB in bf16)
for the offload, large enough that the host-to-device copy takes tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

QWEN_05B = dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                vocab_size=151936, tie=True)
QWEN_15B = dict(hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960,
                vocab_size=151936, tie=True)
TINY = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
            vocab_size=512, tie=True)


def _config(shape: dict[str, Any], max_positions: int) -> Any:
    from rlhf_fusion.loop.models import tiny_config

    return tiny_config("qwen2", max_positions=max_positions, **shape)


def _device(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the smoke test")
    return torch.device("cuda", torch.cuda.current_device())


def lightning(cpu: bool) -> None:
    """``FusedPPOModule`` under ``lightning.Trainer`` on one device (no strategy): two epochs
    over synthetic experience; every loss finite, every parameter of both models moved."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset
    from transformers import AutoModelForCausalLM

    from rlhf_fusion.plugins import FusedPPOModule
    from rlhf_fusion.runtime import CriticModel, PPOConfig
    from rlhf_fusion.testing.pipeline import make_experience

    shape, rows, max_len, batch = (TINY, 8, 24, 4) if cpu else (QWEN_05B, 32, 256, 16)
    cfg = _config(shape, 2 * max_len)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(cfg).float()
    critic = CriticModel.from_config(cfg).float()
    before = {f"{r}.{k}": v.detach().clone() for r, m in (("actor", actor), ("critic", critic))
              for k, v in m.named_parameters()}
    data = make_experience(rows, max_len=max_len, micro_batch_rows=batch // 4,
                           vocab=shape["vocab_size"])

    class Rows(Dataset):
        def __len__(self) -> int:
            return rows

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {k: v[i] for k, v in data.items()}

    losses: list[float] = []
    devices: set[str] = set()

    class Module(FusedPPOModule):
        def training_step(self, b: Any, i: int) -> torch.Tensor:
            # where the parameters are while training (Lightning's single-device teardown moves
            # the module back to the CPU after fit, so looking afterwards proves nothing)
            devices.update(p.device.type for p in self.parameters())
            loss = super().training_step(b, i)
            losses.append(float(loss))
            return loss

    module = Module(actor, critic, PPOConfig(micro_batches=4), actor_lr=1e-5, critic_lr=1e-5)
    trainer = pl.Trainer(accelerator="cpu" if cpu else "gpu", devices=1,
                         precision="32-true" if cpu else "bf16-mixed", max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(module, DataLoader(Rows(), batch_size=batch, shuffle=False))
    took = time.perf_counter() - t0
    steps = 2 * math.ceil(rows / batch)
    assert len(losses) == steps, f"{len(losses)} training steps, expected {steps}"
    assert all(math.isfinite(x) for x in losses), f"a loss is not finite: {losses}"
    assert devices == {_device(cpu).type}, (
        f"parameters on {devices} during training, expected {_device(cpu).type}")
    after = {f"{r}.{k}": v.detach().cpu() for r, m in (("actor", actor), ("critic", critic))
             for k, v in m.named_parameters()}
    frozen = [k for k, v in before.items() if torch.equal(v.cpu(), after[k])]
    assert not frozen, f"{len(frozen)} parameters did not move, e.g. {frozen[:3]}"
    peak = torch.cuda.max_memory_allocated() / 2**30 if not cpu else 0.0
    print(f"lightning: {steps} steps of {batch} rows x {max_len} tokens in {took:.1f} s "
          f"({took / steps:.2f} s/step incl. start-up); losses {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}; peak device memory {peak:.1f} GiB; device {_name(cpu)}")


def offload(cpu: bool) -> None:
    """:class:`HostOffload` on a GB-sized model: offload frees the device copy, the prefetch
    copies on a side stream while the compute stream is busy, and the model's logits after
    the round trip equal those before, bit for bit."""
    from transformers import AutoModelForCausalLM

    from rlhf_fusion.runtime.offload import HostOffload

    dev = _device(cpu)
    shape = TINY if cpu else QWEN_15B
    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = _config(shape, 256)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(1, shape["vocab_size"], (4, 64), device=dev)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float().cpu()
        again = model(input_ids=ids).logits.float().cpu()
    # The round trip is checked bit for bit only if the forward itself repeats bit for bit.
    exact = torch.equal(want, again)
    if not exact:
        print("offload: two forwards before any offload differ (a non-deterministic kernel): "
              "comparing within 1e-3 instead")
    off = HostOffload(model, dev, name="policy-1.5b")
    gib = off.nbytes / 2**30
    if not cpu:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated(dev)
    off.offload()
    if not cpu:
        assert all(h.is_pinned() for h in off._host.values()), "host buffers are not pinned"
        freed = (resident - torch.cuda.memory_allocated(dev)) / 2**30
        assert freed > 0.9 * gib, f"offload freed {freed:.2f} GiB of {gib:.2f}"
    rounds = []
    for r in range(3):
        busy_ok = None
        if not cpu:
            x = torch.randn(8192, 8192, device=dev)
            torch.cuda.synchronize()
            busy = torch.cuda.Event()
            for _ in range(40):   # about 50-100 ms of compute on the compute stream
                x = x @ x
                x = x / x.norm()
            busy.record()
        t0 = time.perf_counter()
        off.prefetch()
        if not cpu:
            off._done.synchronize()
            busy_ok = not busy.query()   # the copy ended while the compute was still running
        t1 = time.perf_counter()
        with torch.no_grad():
            got = model(input_ids=ids).logits.float().cpu()   # the pre-hook waits
        if exact:
            assert torch.equal(got, want), f"round {r}: logits after the prefetch differ"
        else:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        st = off.take_stats()
        rounds.append((st.prefetch_s, st.wait_s, t1 - t0, busy_ok))
        off.offload()
    off.close()
    for i, (copy_s, wait_s, _, busy_ok) in enumerate(rounds):
        rate = gib / copy_s if copy_s else float("nan")
        print(f"offload round {i}: {gib * 1024:.1f} MiB prefetched, copy {copy_s * 1e3:.1f} ms "
              f"({rate:.1f} GiB/s), wait {wait_s * 1e3:.1f} ms, overlapped with compute: "
              f"{busy_ok}")
    if not cpu:
        assert any(b for *_, b in rounds), (
            "no prefetch finished while the compute stream was busy: the copy did not overlap")
    print(f"offload: ok on {_name(cpu)}, {gib * 1024:.1f} MiB, logits "
          f"{'bit-identical' if exact else 'within 1e-3'} after 3 round trips")


def loop_metrics(out_dir: str, iterations: int) -> None:
    """The loop's ``metrics.jsonl``: ``iterations`` rows, finite losses and rewards."""
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    assert len(rows) == iterations, f"{len(rows)} iterations in metrics.jsonl, expected {iterations}"
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"iteration {r.get('iteration')}: not finite: {bad}"
    keys = [k for k in ("samples_per_s", "objective/scores", "loss/policy_avg",
                        "time/generation", "time/training", "time/iteration") if k in rows[-1]]
    assert "objective/scores" in keys and "loss/policy_avg" in keys, sorted(rows[-1])
    print("loop: " + "; ".join(f"{k} " + ", ".join(f"{r[k]:.4g}" for r in rows) for k in keys))


def sampling(cpu: bool) -> None:
    """One decode step's token draw for 64 rows of a 151936-token vocabulary: on the logits'
    device (``keyed_sample``) vs the host path it replaced (float64 logits and numpy noise)."""
    import time

    from rlhf_fusion.rollout.sampling import keyed_sample, keyed_uniform

    dev = _device(cpu)
    rows, vocab = (64, 151936) if not cpu else (8, 4096)
    logits = torch.randn(rows, vocab, device=dev, generator=None)
    key = (list(range(rows)), list(range(rows)), [7] * rows, [1.0] * rows)

    def host() -> list[int]:
        lg = logits.to(device="cpu", dtype=torch.float64)
        u = torch.from_numpy(keyed_uniform(key[0], key[1], key[2], vocab))
        return torch.argmax(lg + -torch.log(-torch.log(u)), dim=-1).tolist()

    timings = {}
    for name, fn in (("device", lambda: keyed_sample(logits, *key)[0]), ("host", host)):
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            out = fn()
        timings[name] = (time.perf_counter() - t0) / 3
        timings[name + "_tokens"] = out
    assert timings["device_tokens"] == timings["host_tokens"], "device and host draws differ"
    print(f"sampling: {rows} x {vocab} on {_name(cpu)}: on the device {timings['device'] * 1e3:.1f}"
          f" ms per step, host path {timings['host'] * 1e3:.1f} ms; same tokens")


def _name(cpu: bool) -> str:
    return "cpu" if cpu else torch.cuda.get_device_name()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["lightning", "offload", "sampling", "loop-metrics"])
    ap.add_argument("args", nargs="*")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (smoke test)")
    a = ap.parse_args(argv)
    if a.step == "loop-metrics":
        loop_metrics(a.args[0], int(a.args[1]))
    else:
        {"lightning": lightning, "offload": offload, "sampling": sampling}[a.step](a.cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
