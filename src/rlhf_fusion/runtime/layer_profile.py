"""Per-layer forward and backward times of a decoder model, for the placement cost model.

ReaLHF's estimator runs on profiled per-layer costs at power-of-two batch sizes, interpolated;
:func:`profile_layers` measures them. It runs whole-model passes (so every layer sees the
inputs, masks and position embeddings its model gives it) on random token ids, and times each
decoder layer with hooks: a forward pre-hook and hook around its forward, a backward pre-hook
and hook around its backward. The time of a layer at a token count is the fastest of
``repeats`` passes (least disturbed by other work) averaged over the layers. What the layers
do not cover (embeddings, the final norm, the head and the loss's reduction) is the whole
pass minus the layers: ``rest_forward`` / ``rest_backward``, charged once per pass. Profile
the model with the head it computes with (an Actor's ``AutoModelForCausalLM``, a Critic's
backbone: its value head is one column).

The result is the JSON that :func:`rlhf_fusion.placement.profile.load_profile` reads (plan
config ``profiles: {actor: FILE}``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..placement.profile import FORMAT


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks of a Hugging Face model (``model.layers``, ``h``, ...)."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (
                best is None or len(module) > len(best)):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = module
    if best is None:
        raise ValueError(f"{type(model).__name__}: no list of identical decoder layers found; "
                         "profile a decoder model (Llama, Qwen, GPT-2, ...)")
    return best


class _LayerTimer:
    """Hooks that record when each layer's forward and backward start and end."""

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self.device = device
        self.marks: dict[str, list[float]] = {"f0": [], "f1": [], "b0": [], "b1": []}
        self.handles = []
        for layer in layers:
            self.handles += [
                layer.register_forward_pre_hook(lambda *_: self.mark("f0")),
                layer.register_forward_hook(lambda *_: self.mark("f1")),
                layer.register_full_backward_pre_hook(lambda *_: self.mark("b0")),
                layer.register_full_backward_hook(lambda *_: self.mark("b1")),
            ]

    def mark(self, key: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks[key].append(time.perf_counter())

    def reset(self) -> None:
        for v in self.marks.values():
            v.clear()

    def per_layer(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """Of the last pass, bracketed by one extra mark each way (the first and last of each
        list): the mean forward and backward seconds per layer, and the forward and backward
        seconds outside the layers."""
        spans = {}
        for kind in ("f", "b"):
            starts, ends = self.marks[kind + "0"], self.marks[kind + "1"]
            # Layers run one at a time (backward in reverse): start k pairs with end k.
            inner = [e - s for s, e in zip(starts[1:], ends[:-1])]
            spans[kind] = (inner, ends[-1] - starts[0])
        (f, total_f), (b, total_b) = spans["f"], spans["b"]
        if not f or len(b) != len(f):
            raise RuntimeError(f"layer hooks fired {len(f)} forwards and {len(b)} backwards; "
                               "the model's layers must all take part in forward and backward")
        return ((sum(f) / len(f), sum(b) / len(b)),
                (max(0.0, total_f - sum(f)), max(0.0, total_b - sum(b))))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def profile_layers(model: nn.Module, *, tokens: Sequence[int] = (256, 512, 1024, 2048, 4096),
                   seq_len: int = 512, repeats: int = 3, device: torch.device | str = "cpu",
                   vocab: int | None = None, seed: int = 0,
                   progress: Callable[[int, int], Any] | None = None) -> dict[str, Any]:
    """Seconds of one decoder layer's forward and backward at each token count.

    ``tokens`` are rounded to whole rows of ``seq_len`` (a count below ``seq_len`` is one row
    of that many tokens). The model runs in training mode without gradient checkpointing; its
    dtype is the one it has. ``progress(done, total)`` is called after each pass.
    """
    device = torch.device(device)
    model = model.to(device)
    model.train()
    layers = decoder_layers(model)
    vocab = vocab or int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab < 2:
        raise ValueError("pass vocab= (the model's config has no vocab_size)")
    counts = sorted({int(t) for t in tokens})
    if not counts or counts[0] < 1:
        raise ValueError(f"tokens: positive token counts, got {list(tokens)}")
    gen = torch.Generator().manual_seed(seed)
    timer = _LayerTimer(layers, device)
    out: dict[str, Any] = {"format": FORMAT, "version": 1, "seq_len": seq_len,
                           "layers": len(layers), "device": str(device),
                           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                           "repeats": repeats, "forward": {}, "backward": {},
                           "rest_forward": {}, "rest_backward": {}}
    total, done = len(counts) * (repeats + 1), 0
    try:
        for n in counts:
            rows, length = (max(1, n // seq_len), seq_len) if n >= seq_len else (1, n)
            ids = torch.randint(0, vocab, (rows, length), generator=gen).to(device)
            best = [float("inf")] * 4     # layer f, layer b, rest f, rest b
            for r in range(repeats + 1):   # pass 0 warms up (allocator, kernels)
                timer.reset()
                timer.mark("f0")          # brackets the whole pass (not a layer's)
                result = model(input_ids=ids)
                hidden = getattr(result, "logits", None)
                if hidden is None:
                    hidden = getattr(result, "last_hidden_state", None)
                if hidden is None:
                    hidden = result[0]
                loss = hidden.float().mean()
                timer.mark("f1")
                timer.mark("b0")
                loss.backward()
                timer.mark("b1")
                model.zero_grad(set_to_none=True)
                (f, b), (rest_f, rest_b) = timer.per_layer()
                if r:
                    best = [min(x, y) for x, y in zip(best, (f, b, rest_f, rest_b))]
                done += 1
                if progress is not None:
                    progress(done, total)
            for key, v in zip(("forward", "backward", "rest_forward", "rest_backward"), best):
                out[key][str(rows * length)] = v
    finally:
        timer.remove()
    return out


def profile_config(config: Any, *, lm_head: bool, dtype: torch.dtype = torch.float32,
                   **kw: Any) -> dict[str, Any]:
    """:func:`profile_layers` on a model built from a ``transformers`` config with random
    weights (timing needs no trained ones): with its vocabulary head (an Actor or Ref) or the
    backbone alone (a Critic or Reward, whose value head is one column)."""
    from transformers import AutoModel, AutoModelForCausalLM

    build = AutoModelForCausalLM if lm_head else AutoModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build.from_config(config, dtype=dtype)
    return profile_layers(model, vocab=config.vocab_size, **kw)
