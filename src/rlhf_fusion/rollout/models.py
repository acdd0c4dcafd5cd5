"""Tiny decoder models built from configs (never downloaded), for tests, examples and benchmarks.

Every rank that builds a model with the same ``seed`` gets bit-identical weights, so no weight
broadcast is needed to make ranks agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def tiny_config(
    kind: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 4096,
) -> Any:
    """A ``LlamaConfig`` / ``Qwen2Config`` / ``GPT2Config`` of the given (small) size."""
    inter = intermediate_size or 2 * hidden_size
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=max_positions)
    if kind == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=max_positions)
    if kind == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=layers,
                          n_head=heads, n_inner=inter, n_positions=max_positions)
    raise ValueError(f"kind={kind!r}: use 'llama', 'qwen2' or 'gpt2'")


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_causal_lm(config: Any, seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM (the Actor, or the Ref model)."""
    from transformers import AutoModelForCausalLM

    return _seeded(seed, lambda: AutoModelForCausalLM.from_config(config)).eval()


class ValueModel(nn.Module):
    """A decoder backbone with a scalar head: per-token values (Critic) or a score (Reward)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_config(config)
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        self.head = nn.Linear(hidden, 1)
        self.config = config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.head(out.last_hidden_state).squeeze(-1)


def build_value_model(config: Any, seed: int = 0) -> ValueModel:
    return _seeded(seed, lambda: ValueModel(config)).eval()
