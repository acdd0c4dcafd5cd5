"""Shared by test_tensor_parallel and test_fsdp: tiny Llama/Qwen2/GPT-2 Actors and Critics
trained a few steps sharded on gloo ranks and on one process, compared parameter by parameter.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist

from rlhf_fusion.runtime.engine import clip_grad_norm_ as reference_clip
from rlhf_fusion.runtime.fused import model_outputs
from rlhf_fusion.testing.models import build_causal_lm, build_value_model, tiny_config

VOCAB, SEQ, BATCH, MICRO, STEPS = 64, 12, 2, 4, 3

# (name, family, role, tie): every family as an Actor, tied and untied embeddings, a Critic.
CASES = [("llama-actor", "llama", "actor", False), ("llama-tied-actor", "llama", "actor", True),
         ("qwen2-actor", "qwen2", "actor", None), ("gpt2-actor", "gpt2", "actor", None),
         ("llama-critic", "llama", "critic", None), ("gpt2-critic", "gpt2", "critic", None)]


def build(family: str, role: str, tie: bool | None, dtype: torch.dtype) -> torch.nn.Module:
    conf = tiny_config(family, vocab_size=VOCAB, hidden_size=32, layers=2, heads=4,
                       kv_heads=2, max_positions=64, tie=tie)
    make = build_causal_lm if role == "actor" else build_value_model
    return make(conf, seed=7).to(dtype).train()


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0   # left padding, as the loop's batches have
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out.append({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                    "target": torch.randn(BATCH, SEQ, generator=g, dtype=torch.float64)})
    return out


def loss_of(role: str, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model_outputs(role, model, mb)
    if role == "actor":   # next-token log-likelihood, as a policy loss reads logprobs
        lp = torch.log_softmax(out[:, :-1].float(), -1)
        tok = lp.gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        return -(tok * mb["attention_mask"][:, 1:]).sum() / mb["attention_mask"].sum()
    return ((out - mb["target"].to(out.dtype)) ** 2 * mb["attention_mask"]).mean()


def train(role: str, model: torch.nn.Module, shard: tuple[int, int], clip: Any,
          sync: Any = None) -> list[float]:
    """STEPS optimizer steps; per step this rank runs micro-batches ``[i*per, (i+1)*per)``
    of MICRO (``shard = (i, n)``), each loss divided by MICRO (the loop's arithmetic)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)
    i, n = shard
    per = MICRO // n
    norms = []
    for step in range(STEPS):
        for mb in micro_batches(step)[i * per:(i + 1) * per]:
            (loss_of(role, model, mb) / MICRO).backward()
        if sync is not None:
            sync(model)
        norms.append(clip(model.parameters(), 0.5))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def sharded_rank(rank: int, world: int, kind: str, dtype_name: str) -> dict[str, Any]:
    """Every case, sharded over the ``world`` ranks (``kind``: "tp" or "zero3"), against the
    same case on this process alone; returns the largest differences."""
    from torch.distributed.device_mesh import DeviceMesh

    from rlhf_fusion.runtime.fsdp import apply_zero3
    from rlhf_fusion.runtime.sharded_state import clip_grad_norm_, full_state_dict
    from rlhf_fusion.runtime.tensor_parallel import apply_tensor_parallel

    # CriticModel returns a squeezed view; nothing writes to it in place.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    dtype = getattr(torch, dtype_name)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    out = {}
    for name, family, role, tie in CASES:
        ref = build(family, role, tie, dtype)
        model = copy.deepcopy(ref)
        mb = micro_batches(0)[0]
        with torch.no_grad():
            want = model_outputs(role, ref, mb)
        if kind == "tp":
            apply_tensor_parallel(model, role, mesh)
            shard = (0, 1)   # every tp rank runs every micro-batch
        else:
            apply_zero3(model, role, mesh)
            shard = (rank, world)
        with torch.no_grad():   # a forward without backward first: ZeRO-3 must reshard
            got = model_outputs(role, model, mb)
        ref_norms = train(role, ref, (0, 1), reference_clip)
        norms = train(role, model, shard, clip_grad_norm_)
        full = full_state_dict(model)
        ref_state = dict(ref.named_parameters())
        assert full.keys() == ref_state.keys(), name
        out[name] = {
            "forward": float((got - want).abs().max()),
            "params": max(float((full[k] - ref_state[k].detach()).abs().max()) for k in full),
            "moved": max(float((full[k] - build(family, role, tie, dtype).state_dict()[k])
                               .abs().max()) for k in full),
            "norms": max(abs(a - b) for a, b in zip(norms, ref_norms, strict=True)),
            "sharded": sorted({type(p).__name__ for p in model.parameters()}),
        }
    return out
