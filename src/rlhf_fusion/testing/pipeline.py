"""The fused PPO pipeline under test: synthetic experience, exactness cases, rank workers.

Worker functions live here (not in test files) so spawned processes can import them by module
path (``rlhf_fusion.launch.run_ranks`` pickles them by reference).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..runtime.fused import (
    canonical_state_dict,
    default_loss_fns,
    fused_problem,
    pipelined_step,
    plan_from,
    reference_step,
    setup_rank,
)
from ..runtime.microbatch import split_micro_batches
from ..runtime.ppo import PPOConfig
from .models import VOCAB, build_models


def make_experience(
    rows: int,
    *,
    max_len: int = 24,
    micro_batch_rows: int = 2,
    seed: int = 0,
    vocab: int = VOCAB,
    prompt_len: int = 4,
) -> dict[str, Tensor]:
    """Synthetic PPO experience, right-padded, whose micro-batches have different lengths.

    Each group of ``micro_batch_rows`` rows gets its own maximum length, so after
    :func:`split_micro_batches` trims padding the pipeline moves differently shaped tensors.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, max_len), generator=g)
    lengths = torch.empty(rows, dtype=torch.long)
    for start in range(0, rows, micro_batch_rows):
        top = int(torch.randint(prompt_len + 3, max_len + 1, (1,), generator=g))
        n = min(micro_batch_rows, rows - start)
        lengths[start : start + n] = torch.randint(prompt_len + 2, top + 1, (n,), generator=g)
        lengths[start] = top
    pos = torch.arange(max_len)[None]
    attention_mask = (pos < lengths[:, None]).long()
    ids = ids * attention_mask
    action_mask = ((pos >= prompt_len) & (pos < lengths[:, None])).long()

    def rnd(scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return (torch.randn(rows, max_len, generator=g) * scale + shift) * action_mask

    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "old_logprobs": rnd(0.3, -4.6),
        "ref_logprobs": rnd(0.3, -4.6),
        "advantages": rnd(),
        "old_values": rnd(0.1),
        "returns": rnd(),
    }


@dataclass
class Case:
    """One exactness configuration."""

    name: str
    models: dict[str, tuple]
    stage_groups: int
    actor_stages: int
    critic_stages: int
    micro_batches: int  # per replica per step
    replicas: int = 1
    steps: int = 3
    solver: str = "greedy"
    micro_batch_rows: int = 2
    ppo: dict[str, Any] = field(default_factory=dict)
    lr: float = 1e-3
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.replicas * self.stage_groups

    def ppo_config(self) -> PPOConfig:
        return PPOConfig(micro_batches=self.micro_batches * self.replicas, **self.ppo)

    def batches(self) -> list[dict[str, Tensor]]:
        """One global batch (all replicas) per step."""
        rows = self.micro_batches * self.replicas * self.micro_batch_rows
        return [
            make_experience(rows, micro_batch_rows=self.micro_batch_rows, seed=self.seed * 100 + s)
            for s in range(self.steps)
        ]

    def problem(self):  # noqa: ANN201
        return fused_problem(
            stage_groups=self.stage_groups,
            micro_batches=self.micro_batches,
            actor_stages=self.actor_stages,
            critic_stages=self.critic_stages,
            actor_times=(1.0, 2.0),
            critic_times=(1.0, 2.0),
        )


def _optimizers(models_params: Mapping[str, Any], lr: float) -> dict[str, torch.optim.Optimizer]:
    return {n: torch.optim.AdamW(p, lr=lr, weight_decay=0.01) for n, p in models_params.items()}


def run_reference(case: Case, models: Mapping[str, nn.Module] | None = None) -> dict[str, Any]:
    """Train ``case`` on this process without pipelining; returns the final state and stats."""
    models = dict(models) if models is not None else build_models(case.models, case.seed)
    cfg = case.ppo_config()
    opts = _optimizers({n: m.parameters() for n, m in models.items()}, case.lr)
    stats = []
    for batch in case.batches():
        mbs = split_micro_batches(batch, case.micro_batches * case.replicas)
        stats.append(
            reference_step(
                models, mbs, opts, default_loss_fns(cfg), max_grad_norm=cfg.max_grad_norm
            )
        )
    state = {}
    for name, m in models.items():
        for k, v in m.state_dict().items():
            state[f"{name}.{k}"] = v.detach().clone()
    return {"state": state, "stats": stats}


def exactness_worker(rank: int, world: int, cases: list[Case], timeout: float = 60.0) -> list[dict]:
    """Train every case pipelined on this rank; return this rank's canonical parameters."""
    out = []
    for case in cases:
        assert case.world_size == world, (case.name, case.world_size, world)
        models = build_models(case.models, case.seed)
        plan = plan_from(case.problem(), replicas=case.replicas, solver=case.solver)
        cfg = case.ppo_config()
        fr = setup_rank(plan, models, loss_fns=default_loss_fns(cfg), timeout=timeout)
        opts = _optimizers({n: s.parameters() for n, s in fr.stages.items()}, case.lr)
        replica, _ = plan.coords(rank)
        stats = []
        t0 = time.perf_counter()
        for batch in case.batches():
            mbs = split_micro_batches(batch, case.micro_batches * case.replicas)
            mine = mbs[replica * case.micro_batches : (replica + 1) * case.micro_batches]
            stats.append(pipelined_step(fr, mine, opts, max_grad_norm=cfg.max_grad_norm))
        seconds = time.perf_counter() - t0
        state = canonical_state_dict(fr, {"actor": "actor.", "critic": "critic."})
        fr.comm.barrier("finishing the case")
        fr.close()
        out.append({"case": case.name, "state": state, "stats": stats, "seconds": seconds})
    return out


def merge_states(rank_values: list[list[dict]], case_index: int) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for per_rank in rank_values:
        merged.update(per_rank[case_index]["state"])
    return merged


def max_abs_diff(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> tuple[float, bool]:
    """Largest elementwise difference over the shared keys, and whether all are bit-identical."""
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))
        raise AssertionError(f"state dict keys differ: {missing[:10]}")
    worst, identical = 0.0, True
    for k in a:
        if a[k].is_floating_point():
            d = float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
            worst = max(worst, d)
            identical &= torch.equal(a[k], b[k])
    return worst, identical


def clone_models(models: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    return {k: copy.deepcopy(v) for k, v in models.items()}


def fault_case() -> Case:
    return Case("fault", {"actor": ("llama", 2), "critic": ("llama", 2)}, 2, 2, 2, 4, steps=2)


def _swap_micro_batches(stream: list, model: str, a: int, b: int) -> list:
    from dataclasses import replace

    def fix(x):  # noqa: ANN001, ANN202
        if x.model != model or x.micro_batch not in (a, b):
            return x
        return replace(x, micro_batch=b if x.micro_batch == a else a)

    return [fix(x) for x in stream]


def fault_worker(rank: int, world: int, mode: str, victim: int, timeout: float) -> dict[str, Any]:
    """One normal step, then the victim misbehaves (``stall``, ``die`` or ``mismatch``) and
    every other rank reports how, and how fast, the next step failed."""
    import os

    from ..runtime.errors import PipelineError

    case = fault_case()
    models = build_models(case.models, case.seed)
    plan = plan_from(case.problem(), solver=case.solver)
    cfg = case.ppo_config()
    fr = setup_rank(plan, models, loss_fns=default_loss_fns(cfg), timeout=timeout)
    opts = _optimizers({n: s.parameters() for n, s in fr.stages.items()}, case.lr)
    batches = [split_micro_batches(b, case.micro_batches) for b in case.batches()]
    pipelined_step(fr, batches[0], opts)
    stream = None
    if rank == victim:
        if mode == "stall":
            time.sleep(timeout * 10)
            return {"error_type": None, "elapsed": 0.0, "message": "stalled"}
        if mode == "die":
            os._exit(3)
        if mode == "mismatch":
            stream = _swap_micro_batches(plan.stream(rank), "actor", 0, 1)
    t0 = time.perf_counter()
    try:
        fr.engine.run(batches[1], stream=stream)
        fr.engine.sync_gradients()
        fr.engine.reduced_stats()
    except PipelineError as exc:
        return {
            "error_type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.perf_counter() - t0,
        }
    return {"error_type": None, "elapsed": time.perf_counter() - t0, "message": ""}
