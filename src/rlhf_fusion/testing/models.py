"""Tiny decoder models built from configs (never downloaded), for tests, benchmarks and examples.

Every process that builds a model with the same ``seed`` gets bit-identical weights, so ranks
agree without a weight broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..runtime.partition import CriticModel

VOCAB = 96  # vocabulary of the training-side tiny models (``build_models``, ``make_experience``)
KINDS = ("llama", "qwen2", "gpt2")


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
    tie: bool | None = None,
) -> Any:
    """A small ``LlamaConfig`` / ``Qwen2Config`` / ``GPT2Config`` with dropout off.

    ``tie`` sets ``tie_word_embeddings`` (None: the family's default; GPT-2 ties).
    """
    inter = intermediate_size or 2 * hidden_size
    extra = {} if tie is None else {"tie_word_embeddings": bool(tie)}
    if kind == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=layers,
                          n_head=heads, n_inner=inter, n_positions=max_positions,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **extra)
    if kind in ("llama", "qwen2"):
        from transformers import LlamaConfig, Qwen2Config

        cls = LlamaConfig if kind == "llama" else Qwen2Config
        return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                   attention_dropout=0.0, **extra)
    raise ValueError(f"kind={kind!r}: use one of {KINDS}")


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_causal_lm(config: Any, seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM (Actor or Ref), in eval mode."""
    from transformers import AutoModelForCausalLM

    return _seeded(seed, lambda: AutoModelForCausalLM.from_config(config)).eval()


def build_value_model(config: Any, seed: int = 0) -> CriticModel:
    """A randomly initialised value model (Critic or Reward: backbone + scalar head), eval mode."""
    return _seeded(seed, lambda: CriticModel.from_config(config)).eval()


def build_models(spec: Mapping[str, Any], seed: int = 0) -> dict[str, nn.Module]:
    """The Actor and Critic of a training test, float32, in train mode.

    ``spec = {"actor": (kind, layers[, hidden, tie]), "critic": (...)}``; vocabulary
    :data:`VOCAB`, 128 positions. The actor is seeded with ``seed``, the critic ``seed + 1``.
    """
    from transformers import AutoModelForCausalLM

    out: dict[str, nn.Module] = {}
    for i, role in enumerate(("actor", "critic")):
        kind, layers, *rest = spec[role]
        hidden = rest[0] if rest else 32
        tie = rest[1] if len(rest) > 1 else None
        cfg = tiny_config(kind, vocab_size=VOCAB, hidden_size=hidden, layers=layers,
                          max_positions=128, tie=tie)
        torch.manual_seed(seed + i)
        if role == "actor":
            out[role] = AutoModelForCausalLM.from_config(cfg).float()
        else:
            out[role] = CriticModel.from_config(cfg).float()
    return out
