"""Shared by test_tensor_parallel and test_fsdp: tiny Llama/Qwen2/GPT-2 Actors and Critics
trained a few steps sharded on gloo ranks and on one process, compared parameter by parameter.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist

from rlhf_fusion.runtime.fused import model_outputs, reference_step
from rlhf_fusion.runtime.sharded_train import data_parallel_step
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


def loss_of(role: str, out: torch.Tensor, mb: dict[str, torch.Tensor]
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss on the model's outputs (the loop's ``loss_fns`` signature)."""
    if role == "actor":   # next-token log-likelihood, as a policy loss reads logprobs
        lp = torch.log_softmax(out[:, :-1].float(), -1)
        tok = lp.gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        loss = -(tok * mb["attention_mask"][:, 1:]).sum() / mb["attention_mask"].sum()
    else:
        loss = ((out - mb["target"].to(out.dtype)) ** 2 * mb["attention_mask"]).mean()
    return loss, {"mean_out": out.detach().float().mean()}


LOSS_FNS = {"actor": lambda out, mb: loss_of("actor", out, mb),
            "critic": lambda out, mb: loss_of("critic", out, mb)}


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)


def train_reference(role: str, model: torch.nn.Module) -> list[dict[str, float]]:
    """STEPS clipped AdamW steps of MICRO micro-batches on this process alone."""
    opt = optimizer(model)
    out = []
    for step in range(STEPS):
        res = reference_step({role: model}, micro_batches(step), {role: opt}, LOSS_FNS,
                             max_grad_norm=0.5, roles=(role,))
        out.append({f"{role}/{k}": v for k, v in res["stats"][role].items()}
                   | {f"{role}/grad_norm": res["grad_norm"][role]})
    return out


def train_sharded(role: str, model: torch.nn.Module, layout: Any, rank: int, groups: Any
                  ) -> list[dict[str, float]]:
    """The same steps with the loop's step function on ``layout`` (sharded in place)."""
    opt = optimizer(model)
    return [data_parallel_step(model, role, layout, rank, micro_batches(step), LOSS_FNS, opt,
                               groups, 0.5) for step in range(STEPS)]


def sharded_rank(rank: int, world: int, kind: str, dtype_name: str,
                 only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every case on the ``world`` ranks laid out as ``kind`` ("tp": one tensor-parallel
    group; "dp_tp": dp=2 x tp=2; "zero3": ZeRO-3 over all), against the same case on this
    process alone; returns the largest differences."""
    from rlhf_fusion.placement.layout import Layout
    from rlhf_fusion.runtime.sharded_state import full_state_dict, load_full_state
    from rlhf_fusion.runtime.sharded_train import layout_groups, shard_for_training

    # CriticModel returns a squeezed view; nothing writes to it in place.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    dtype = getattr(torch, dtype_name)
    ranks = tuple(range(world))
    layout = {"tp": Layout(1, world, ranks=ranks), "dp_tp": Layout(world // 2, 2, ranks=ranks),
              "zero3": Layout(world, 1, 1, 3, ranks)}[kind]
    groups = {g: dist.new_group(list(g)) for g in layout_groups(layout)}
    out = {}
    for name, family, role, tie in CASES:
        if only is not None and name not in only:
            continue
        ref = build(family, role, tie, dtype)
        model = copy.deepcopy(ref)
        mb = micro_batches(0)[0]
        with torch.no_grad():
            want = model_outputs(role, ref, mb)
        shard_for_training(model, role, layout, rank, groups, torch.device("cpu"))
        with torch.no_grad():   # a forward without backward first: ZeRO-3 must reshard
            got = model_outputs(role, model, mb)
        ref_stats = train_reference(role, ref)
        stats = train_sharded(role, model, layout, rank, groups)
        full = full_state_dict(model)
        ref_state = dict(ref.named_parameters())
        assert full.keys() == ref_state.keys(), name
        out[name] = {
            "forward": float((got - want).abs().max()),
            "params": max(float((full[k] - ref_state[k].detach()).abs().max()) for k in full),
            "moved": max(float((full[k] - build(family, role, tie, dtype).state_dict()[k])
                               .abs().max()) for k in full),
            "stats": max(abs(a[k] - b[k]) for a, b in zip(stats, ref_stats, strict=True)
                         for k in a),
            "sharded": sorted({type(p).__name__ for p in model.parameters()}),
        }
        # Whole weights back into the shards (a resume, a sync): the same tensors come out.
        fresh = {k: v.detach().clone() for k, v in build(family, role, tie, dtype)
                 .named_parameters()}
        load_full_state(model, fresh)
        back = full_state_dict(model)
        out[name]["reload"] = max(float((back[k] - fresh[k]).abs().max()) for k in fresh)
    return out


def check_equal(results: list[dict[str, Any]], case: str, tol: float, whole_dtensor: bool
                ) -> None:
    """Every rank's outcome of ``case``: forward, parameters and statistics within ``tol`` of
    one process, the weights moved, sharded as DTensors (every parameter when
    ``whole_dtensor``), a reload exact."""
    for rank_out in results:
        got = rank_out[case]
        assert got["forward"] <= tol, got
        assert got["params"] <= tol, got
        assert got["stats"] <= tol, got  # losses and gradient norms
        assert got["moved"] > 1e-3, "training moved the weights"
        if whole_dtensor:
            assert got["sharded"] == ["DTensor"], "every parameter sharded"
        else:
            assert "DTensor" in got["sharded"]
        assert got["reload"] == 0.0
