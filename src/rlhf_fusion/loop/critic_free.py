"""GRPO, RLOO and REINFORCE++ in the loop, as a thin layer beside :class:`PPOWorker`.

:class:`CriticFreeWorker` runs one iteration on one rank of a data-parallel group (or one
process): ``n`` samples per prompt, generation + Ref and reward scoring streamed per sample
(:func:`rlhf_fusion.rollout.run_rollout`, inter-stage fusion with ``fusion.inter`` on 2+
ranks), group advantages from :class:`~rlhf_fusion.algorithms.GroupTracker` fed in the order
the samples finished, the clipped policy loss of :mod:`rlhf_fusion.algorithms`, and an adaptive
or fixed KL coefficient. No Critic is built, placed, synced or checkpointed.

Every rank holds the whole Actor (data parallel): each mini-batch's micro-batches are dealt
round-robin over the ranks, their gradients summed over the group, then one clipped AdamW step
on every rank. Each micro-batch's loss is normalised by its *mini-batch's* tokens and sequences
(:func:`~rlhf_fusion.algorithms.agg_loss`'s ``num_tokens``/``num_seqs``), so the summed gradient
is the mini-batch's loss gradient whatever the split: one micro-batch per rank on 2 ranks gives
one device's parameters bit for bit (``a + b`` either way); more per rank reorders a float sum.

This module is the layer the worker's training-engine refactor will call (the specs, the batch,
the loss); :func:`train_critic_free` runs it meanwhile (``rlhf-fusion demo --algo grpo``).
Placement presets, plans and pipeline stages are PPOWorker's; a critic-free run is data
parallel on every rank and refuses them (:func:`check_critic_free_run`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..algorithms import GroupTracker, clipped_policy_loss, kl_controller, kl_penalty
from ..rollout.backend_registry import BackendRequest, make_backend
from ..rollout.inference import Experience, InferenceModels
from ..rollout.local import LocalFusedRollout
from ..rollout.rt_control import RtPlanner, TimedBackend, timed_scoring
from ..rollout.types import SampleResult, SampleSpec
from ..runtime.ppo import logprobs_from_logits
from . import advantages as adv
from .algorithm_config import ResolvedAlgorithm, samples_per_iteration
from .config import RLHFConfig
from .errors import LoopConfigError
from .models import BUILTIN_REWARDS, causal_lm, load_tokenizer, value_model
from .reward_functions import RewardFunctions, is_function_spec, resolve_reward_spec

__all__ = ["CriticFreeScorer", "CriticFreeWorker", "check_critic_free_run",
           "critic_free_batch", "group_specs", "policy_loss_fn", "train_critic_free"]


def check_critic_free_run(cfg: RLHFConfig) -> None:
    """What this layer does not run yet, refused before any rank starts."""
    if cfg.placement.given or cfg.placement.offload:
        raise LoopConfigError("placement: a critic-free run is data parallel on every rank "
                              "for now; remove placement.preset/plan/search/offload")
    if cfg.fusion.pipeline_stages not in (None, 1) and cfg.world_size > 1:
        raise LoopConfigError("fusion.pipeline_stages: a critic-free run trains the Actor data "
                              "parallel for now; remove it")
    if cfg.generation.backend != "reference":
        raise LoopConfigError("generation.backend: a critic-free run uses the reference "
                              "backend for now")


class CriticFreeScorer(InferenceModels):
    """Ref logprobs and the reward of each finished sample; no Critic (values are zeros)."""

    def __init__(self, ref: torch.nn.Module, reward: Any, *, micro_batch: int = 4,
                 device: torch.device | str = "cpu", pad_id: int = 0) -> None:
        super().__init__(ref, reward, None, micro_batch=micro_batch, device=device,
                         pad_id=pad_id)
        self.finish_order: list[int] = []   # sample ids, in the order they were scored

    def score(self, samples: Sequence[SampleResult]) -> list[Experience]:
        parts = self.score_parts(samples)
        self.finish_order.extend(s.sample_id for s in samples)
        return [Experience(sample_id=s.sample_id, prompt_ids=s.prompt_ids,
                           response_ids=s.token_ids, finish_reason=s.finish_reason,
                           logprobs=torch.tensor(s.logprobs, dtype=torch.float64),
                           ref_logprobs=p["ref_logprobs"],  # type: ignore[arg-type]
                           values=torch.zeros(len(s.token_ids), dtype=torch.float64),
                           reward=float(p["reward"]))  # type: ignore[arg-type]
                for s, p in zip(samples, parts, strict=True)]


def group_specs(prompts: Sequence[Sequence[int]], n: int, *, iteration: int,
                cfg: RLHFConfig, eos: int) -> list[SampleSpec]:
    """``n`` samples per prompt: prompt ``p``'s are sample ids ``p*n .. p*n + n - 1`` (their
    group), each with its own sampling stream (keyed on the sample id)."""
    g = cfg.generation
    seed = g.seed * 1_000_003 + iteration
    return [SampleSpec(sample_id=p * n + k, prompt_ids=tuple(ids), max_new_tokens=g.max_new_tokens,
                       seed=seed, temperature=g.temperature, stop_token_ids=(eos,))
            for p, ids in enumerate(prompts) for k in range(n)]


def critic_free_batch(exps: Sequence[Experience], algo: ResolvedAlgorithm, *, kl_coef: float,
                      pad_id: int, order: Sequence[int] | None = None
                      ) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The training batch and TRL-named metrics of one iteration's experience.

    ``exps`` sorted by sample id; ``order``: the sample ids in the order they were scored (the
    tracker takes them so; the result does not depend on it). ``kl_coef``: the KL
    coefficient now (the controller's): subtracted in the reward when ``algo.kl_in_reward``,
    reported either way.
    """
    exps = sorted(exps, key=lambda e: e.sample_id)
    rb = adv.response_batch(exps)
    mask = rb.mask
    kl = kl_penalty(rb.logprobs, rb.ref_logprobs, algo.kl_penalty) * mask
    token_rewards = torch.zeros_like(rb.logprobs)
    last = mask.sum(-1).long() - 1
    rows = torch.arange(len(exps))
    token_rewards[rows, last.clamp(min=0)] = rb.scores
    if algo.kl_in_reward:
        token_rewards = token_rewards - kl_coef * kl
    scores = token_rewards.sum(-1)   # verl's token_level_rewards.sum(-1)
    pos = {e.sample_id: i for i, e in enumerate(exps)}
    tracker = GroupTracker([e.sample_id // algo.n for e in exps], algo.name,
                           scale_rewards=algo.scale_rewards, epsilon=algo.epsilon)
    for sid in (order if order is not None else [e.sample_id for e in exps]):
        tracker.add(pos[sid], float(scores[pos[sid]]))
    a, r = tracker.finish(mask, token_rewards, gamma=algo.gamma)
    batch = adv.training_batch(exps, a, r, rb, pad_id=pad_id)
    lengths = mask.sum(1).to(torch.float64)
    per_token_kl = (kl.sum(1) / lengths.clamp(min=1)).mean()
    groups = rb.scores.view(-1, algo.n) if len(exps) % algo.n == 0 else rb.scores[None]
    metrics = {
        "objective/scores": float(rb.scores.mean()),
        "objective/kl": float(kl.sum(1).mean()),
        "objective/rlhf_reward": float(scores.mean()),   # minus the in-reward KL, if any
        "objective/kl_per_token": float(per_token_kl),
        "objective/kl_coef": float(kl_coef),   # the controller's, for whichever KL term is on
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        # the groups whose samples all scored the same: no GRPO signal from them
        "frac_reward_zero_std": float((groups.std(1) == 0).to(torch.float64).mean())
        if algo.n > 1 else 0.0,
    }
    return batch, metrics


def policy_loss_fn(algo: ResolvedAlgorithm, *, kl_loss_coef: float, horizon: int
                   ) -> Callable[[Tensor, Mapping[str, Tensor], float, float],
                                 tuple[Tensor, dict[str, Tensor]]]:
    """``loss(logits, micro_batch, num_tokens, num_seqs)``: the clipped policy loss of one
    micro-batch, normalised by its mini-batch's ``num_tokens``/``num_seqs`` (summing the
    micro-batches' losses gives the mini-batch's)."""

    def loss(logits: Tensor, mb: Mapping[str, Tensor], num_tokens: float,
             num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
        lp = logprobs_from_logits(logits, mb["input_ids"]).to(torch.float64)
        return clipped_policy_loss(
            lp, mb["old_logprobs"].to(torch.float64), mb["advantages"].to(torch.float64),
            mb["action_mask"], clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c,
            loss_agg_mode=algo.loss_agg_mode, ref_logprobs=mb["ref_logprobs"].to(torch.float64),
            kl_loss_coef=kl_loss_coef, kl_loss_type=algo.kl_loss_type,
            num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)

    return loss


def _reward(src: Any, vocab: int, seed: int) -> Any:
    if callable(src) or isinstance(src, RewardFunctions):
        return src
    if is_function_spec(src):
        return resolve_reward_spec(src)
    if isinstance(src, str) and src in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[src]
    return value_model(src, vocab, seed).requires_grad_(False).eval()


class CriticFreeWorker:
    """One rank of a critic-free run (the default process group, or one process)."""

    def __init__(self, cfg: RLHFConfig, *, device: torch.device | str = "cpu") -> None:
        cfg.validate()
        if not cfg.algorithm.critic_free:
            raise LoopConfigError("algorithm.name: ppo runs on PPOWorker; CriticFreeWorker "
                                  "runs grpo, rloo, reinforce_pp and reinforce_pp_baseline")
        check_critic_free_run(cfg)
        self.cfg, self.device = cfg, torch.device(device)
        self.algo = cfg.algorithm.resolved(cfg.ppo)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        m = cfg.models
        self.tokenizer = load_tokenizer(m)
        vocab = int(self.tokenizer.vocab_size)
        # Actor, Ref and the reward only: no Critic.
        self.actor = causal_lm(m.actor, vocab, m.seed).to(self.device).train()
        ref = (copy.deepcopy(self.actor) if m.ref is None else causal_lm(m.ref, vocab, m.seed))
        ref.requires_grad_(False).eval()
        reward = _reward(m.reward, vocab, m.seed + 2)
        tok = self.tokenizer
        if isinstance(reward, RewardFunctions):
            score = reward

            def reward_fn(p: Sequence[int], c: Sequence[int]) -> float:
                return score.score(tok.decode(p), tok.decode(c), c)
        elif isinstance(reward, torch.nn.Module):
            reward_fn = reward   # type: ignore[assignment]
        else:
            rule = reward

            def reward_fn(p: Sequence[int], c: Sequence[int]) -> float:
                return float(rule(tok.decode(p), tok.decode(c)))
        pad = int(self.tokenizer.pad_token_id or 0)
        self.scorer = CriticFreeScorer(ref, reward_fn, device=self.device, pad_id=pad)
        g = cfg.generation
        self.backend = TimedBackend(make_backend(g.backend, BackendRequest(
            copy_model=lambda: copy.deepcopy(self.actor), instance_id=self.rank,
            max_batch_size=g.bs_max, seed=g.seed, checkpoint=str(m.actor), device=self.device,
            kv_capacity_tokens=g.kv_capacity_tokens)))
        # Decode steps and scoring calls timed: R_t's simulator fits its costs to them.
        self._scoring: list[tuple[int, float]] = []
        self.scorer.score = timed_scoring(self.scorer.score, self._scoring)  # type: ignore[method-assign]
        fixed = self._fixed_rt()
        self.rt_planner = RtPlanner(samples_per_iteration(cfg), max(self.world, 1),
                                    bs_max=g.bs_max, kv_capacity_tokens=g.kv_capacity_tokens,
                                    fixed=fixed, src=0)
        p = cfg.ppo
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=p.learning_rate, eps=1e-5,
                                           weight_decay=p.weight_decay)
        a = self.algo
        start = a.kl_coef if a.kl_in_reward else a.kl_loss_coef
        self.kl = kl_controller(start, adaptive=a.adaptive_kl, target=a.target_kl,
                                horizon=a.kl_horizon)
        self.iteration_index = 0

    # -- one iteration -----------------------------------------------------------------------
    def _fixed_rt(self) -> int | None:
        """``fusion.rt`` in samples (a count, or a fraction of ``prompts x n``); None: auto."""
        f = self.cfg.fusion
        if f.rt == "auto":
            return None
        samples = samples_per_iteration(self.cfg)
        rt = float(f.rt)
        return max(1, round(rt * samples)) if rt < 1 else min(int(rt), samples)

    def rt(self) -> int | None:
        """R_t in samples for this rollout (None: no inter-stage fusion): ``fusion.rt`` fixed,
        or ``auto``, chosen by R_t's simulator from the lengths and timings seen so far
        (:class:`~rlhf_fusion.rollout.rt_control.RtPlanner`, collective; 0: no gain
        predicted, the serial rollout)."""
        if not (self.cfg.fusion.inter and self.world > 1):
            return None
        return self.rt_planner.rt() or None

    def bound(self, lengths: Sequence[int], rt: int | None) -> float | None:
        """The simulator's serial/fused time of this batch's generation + scoring, on the
        costs fitted so far, with groups (:func:`~rlhf_fusion.rollout.planning.groups.
        simulate_groups`): the ceiling inter-stage fusion has for these lengths."""
        if not rt or self.world < 2:
            return None
        import numpy as np

        from ..rollout.planning.groups import simulate_groups

        g = simulate_groups(np.asarray(lengths), self.rt_planner.cluster(), rt, self.algo.n)
        return float(g.speedup) if np.isfinite(g.fused_s) else None

    def rollout(self, specs: list[SampleSpec]) -> tuple[list[Experience], dict[str, Any]]:
        self.scorer.finish_order = []
        f = self.cfg.fusion
        if self.world == 1:
            out = LocalFusedRollout([self.backend], self.scorer).run(specs)
            return list(out.experiences), {}
        from ..rollout import RolloutConfig, run_rollout

        rt = self.rt()   # collective
        rcfg = RolloutConfig(fused=rt is not None, rt=rt, mechanism=f.mechanism,
                             timeout_s=f.timeout_s, report_every=16)
        out = run_rollout(self.backend, self.scorer, specs, rcfg,
                          bs_max=self.cfg.generation.bs_max)
        moved = len(out.assignment.moved_ids) if out.assignment is not None else 0
        return list(out.experiences), {"rt": rt or 0, "migrated": moved}

    def train(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Epochs x mini-batches; micro-batches dealt round-robin over the ranks, gradients
        summed, one clipped step per mini-batch on every rank."""
        p, a = self.cfg.ppo, self.algo
        kl_loss = self.kl.value if not a.kl_in_reward and a.kl_loss_coef else 0.0
        fn = policy_loss_fn(a, kl_loss_coef=kl_loss, horizon=self.cfg.generation.max_new_tokens)
        rows = batch["input_ids"].shape[0]
        per_mini = rows // p.num_mini_batches
        stats: dict[str, float] = {}
        steps = 0
        for _ in range(a.epochs):
            for m in range(p.num_mini_batches):
                sl = slice(m * per_mini, (m + 1) * per_mini)
                mini = {k: v[sl] for k, v in batch.items()}
                act = mini["action_mask"].bool()
                num_tokens = float(act.sum())
                num_seqs = float((act.sum(-1) > 0).sum())
                chunks = _split(mini, p.micro_batches)
                self.optimizer.zero_grad(set_to_none=True)
                for c, mb in enumerate(chunks):
                    if c % self.world != self.rank:
                        continue
                    mb = {k: v.to(self.device) for k, v in mb.items()}
                    logits = self.actor(input_ids=mb["input_ids"],
                                        attention_mask=mb["attention_mask"],
                                        use_cache=False).logits
                    loss, st = fn(logits, mb, num_tokens, num_seqs)
                    loss.backward()
                    for k, v in st.items():
                        stats[k] = stats.get(k, 0.0) + float(v)
                    stats["loss/policy"] = stats.get("loss/policy", 0.0) + float(loss.detach())
                if self.distributed:
                    for q in self.actor.parameters():
                        if q.grad is None:
                            q.grad = torch.zeros_like(q)
                        dist.all_reduce(q.grad)
                if p.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.actor.parameters(), p.max_grad_norm)
                self.optimizer.step()
                steps += 1
        return {f"policy/{k}" if not k.startswith("loss/") else k: v / max(steps, 1)
                for k, v in stats.items()}

    def iteration(self, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
        t0 = time.perf_counter()
        specs = group_specs(prompts, self.algo.n, iteration=self.iteration_index, cfg=self.cfg,
                            eos=int(self.tokenizer.eos_token_id))
        exps, stats = self.rollout(specs)
        t_roll = time.perf_counter() - t0
        lengths = [len(e.response_ids) for e in sorted(exps, key=lambda e: e.sample_id)]
        self.rt_planner.observe(lengths, self.backend, self._scoring,
                                prompt_len=sum(map(len, prompts)) / max(len(prompts), 1))
        bound = self.bound(lengths, stats.get("rt"))
        if bound is not None:
            stats["simulated_speedup"] = bound
        self.backend.reset_timing()
        self._scoring.clear()
        order = [sid for sid in self.scorer.finish_order if sid in {e.sample_id for e in exps}]
        if sorted(order) != sorted(e.sample_id for e in exps):
            order = None   # another rank scored some: any order gives the same advantages
        a = self.algo
        batch, metrics = critic_free_batch(exps, a, kl_coef=self.kl.value,
                                           pad_id=int(self.tokenizer.pad_token_id or 0),
                                           order=order)
        t1 = time.perf_counter()
        metrics.update(self.train(batch))
        t_train = time.perf_counter() - t1
        self.backend.update_weights({k: v.detach() for k, v in self.actor.state_dict().items()})
        # the controller reads the KL per token, averaged per response then over the batch
        self.kl.update(metrics["objective/kl_per_token"], len(exps))
        self.iteration_index += 1
        metrics.update({"time/rollout": t_roll, "time/train": t_train,
                        "time/iteration": time.perf_counter() - t0,
                        **{f"rollout/{k}": float(v) for k, v in stats.items()}})
        self.experiences = exps
        return metrics

    def canonical_state(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.actor.state_dict().items()}


def _split(batch: dict[str, Tensor], parts: int) -> list[dict[str, Tensor]]:
    rows = batch["input_ids"].shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i]:bounds[i + 1]] for k, v in batch.items()}
            for i in range(parts) if bounds[i + 1] > bounds[i]]


def _rank_main(rank: int, world: int, cfg: RLHFConfig, prompt_ids: list[list[int]],
               keep: bool) -> dict[str, Any]:
    worker = CriticFreeWorker(cfg)
    history, kept = [], []
    ppi = cfg.generation.prompts_per_iteration
    for it in range(cfg.iterations):
        start = (it * ppi) % len(prompt_ids)
        prompts = [prompt_ids[(start + i) % len(prompt_ids)] for i in range(ppi)]
        history.append({"iteration": it, **worker.iteration(prompts)})
        if keep:
            kept.append([(e.sample_id, e.response_ids, e.reward) for e in worker.experiences])
    return {"history": history, "state": worker.canonical_state(), "experiences": kept}


def train_critic_free(cfg: RLHFConfig, prompts: Sequence[str], *, keep_experiences: bool = False
                      ) -> dict[str, Any]:
    """``cfg.iterations`` iterations on ``cfg.world_size`` ranks (one process when 1).
    Returns rank 0's ``history`` and ``experiences`` (per iteration: sample id, tokens,
    reward) and every rank's ``states``."""
    cfg.validate()
    if not cfg.algorithm.critic_free:
        raise LoopConfigError("algorithm.name: ppo trains with rlhf_fusion.loop.train")
    check_critic_free_run(cfg)
    tok = load_tokenizer(cfg.models)
    prompt_ids = [tok.encode(p) for p in prompts]
    if not prompt_ids or any(not p for p in prompt_ids):
        raise LoopConfigError("prompts: empty, or a prompt encodes to no tokens")
    if cfg.world_size == 1:
        out = _rank_main(0, 1, cfg, prompt_ids, keep_experiences)
        out["states"] = [out["state"]]
        return out
    from ..launch import run_ranks

    results = run_ranks(_rank_main, cfg.world_size, cfg, prompt_ids, keep_experiences,
                        collective_timeout=cfg.fusion.timeout_s,
                        timeout=cfg.fusion.timeout_s * max(cfg.iterations, 1) * 4 + 300)
    out = results[0].value
    out["states"] = [r.value["state"] for r in results]
    return out



def train_critic_free_to(cfg: RLHFConfig, prompts: Sequence[str], out_dir: str | None, *,
                         overwrite: bool = False, checkpoint_every: int = 0,
                         resume: bool = False, joined: bool = False) -> dict[str, Any]:
    """``rlhf-fusion train`` for a critic-free config: :func:`train_critic_free`, then
    ``metrics.jsonl`` (one row per iteration) and ``config.json`` in ``out_dir``. What the
    layer does not do yet is refused before any rank starts, naming the option."""
    import json
    from pathlib import Path

    if resume:
        raise LoopConfigError(f"--resume: algorithm.name {cfg.algorithm.name} runs without "
                              "checkpoints for now; start afresh (drop --resume)")
    if checkpoint_every:
        import sys

        print(f"rlhf-fusion train: algorithm.name {cfg.algorithm.name} writes no checkpoints "
              "yet (--checkpoint-every is ignored)", file=sys.stderr)
    if joined:
        raise LoopConfigError(f"algorithm.name {cfg.algorithm.name}: started by torchrun/srun; "
                              "a critic-free run starts its own ranks for now: run "
                              "rlhf-fusion train without torchrun")
    from .run import prepare_out_dir

    prepare_out_dir(out_dir, cfg.world_size, resume=False, overwrite=overwrite)
    res = train_critic_free(cfg, prompts)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "w") as f:
            for row in res["history"]:
                f.write(json.dumps(row) + "\n")
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    for row in res["history"]:
        print(f"iteration {row['iteration']}: reward {row['objective/scores']:.3f}, KL/token "
              f"{row['objective/kl_per_token']:.3f}, length {row['response_length/mean']:.1f}, "
              f"{row['time/iteration']:.2f} s")
    return res
