"""Tiny decoder models built from configs (never downloaded), for tests, benchmarks and examples.

Every process that builds a model with the same ``seed`` gets bit-identical weights, so ranks
agree without a weight broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..loop.models import build_causal_lm, build_value_model, seeded, tiny_config
from ..runtime.partition import CriticModel

__all__ = ["VOCAB", "build_causal_lm", "build_models", "build_value_model", "seeded",
           "tiny_config"]

VOCAB = 96  # vocabulary of the training-side tiny models (``build_models``, ``make_experience``)


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
