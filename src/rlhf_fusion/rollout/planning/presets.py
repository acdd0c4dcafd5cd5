"""Named cluster configurations for the simulator (and `rlhf-fusion tune-migration --preset`).

Numbers are derived from hardware figures, not fitted to any result; the derivation is in the
comments so they can be re-derived for another cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from .simulate import ClusterModel


@dataclass(frozen=True)
class Preset:
    description: str
    cluster: ClusterModel
    batch_size: int
    median_len: float
    sigma: float
    max_len: int


# Actor LLaMA-13B served by 32 generation instances of TP=2 on H100-80GB (64 GPUs); Ref 13B,
# Reward 33B and Critic 33B for inference; 2048 prompts of 512 tokens per iteration; response
# lengths lognormal, median 300, sigma 1.0 (p99/median ~ 10), capped at 4096.
#   step_base: 13 GB of weights per GPU at ~2.6 TB/s = 5 ms, + TP all-reduces and scheduler = 10 ms
#   step_per_sample: 26 GFLOP per token / (2 GPUs * ~1 PFLOP/s * 50%) = 26 us
#   KV per token: 2 * 40 layers * 5120 * 2 B = 819 KB; read at 2 * 2.6 TB/s -> 0.16 us per token
#   KV capacity: (80 - 13 - 7) GB * 2 GPUs / 819 KB = 146k tokens
#   prefill: 26 GFLOP per token at 50% MFU on 2 GPUs = 26 us per token
#   inference: (13 + 33 + 33) * 2 GFLOP = 158 GFLOP per token at ~27% of 2 GPUs' peak = 300 us
#   transfer: 200 Gb/s InfiniBand = 25 GB/s, 1 ms latency
LLAMA13B_H100X64 = Preset(
    description="Actor 13B (32 instances x TP2 H100), Ref 13B + RM/Critic 33B, 2048 prompts",
    cluster=ClusterModel(
        instances=32, bs_max=256, step_base_s=0.010, step_per_sample_s=2.6e-5,
        step_per_kv_token_s=1.6e-7, prefill_per_token_s=2.6e-5, infer_per_token_s=3.0e-4,
        kv_capacity_tokens=146_000, kv_bytes_per_token=819_200, bandwidth_bytes_s=25e9,
        latency_s=1e-3, prompt_len=512,
    ),
    batch_size=2048, median_len=300, sigma=1.0, max_len=4096,
)

PRESETS: dict[str, Preset] = {"llama13b-h100x64": LLAMA13B_H100X64}
