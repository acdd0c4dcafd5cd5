"""One PPO iteration on one rank, read top to bottom: sync, generate + score, advantages, train.

Every rank of the default process group runs :meth:`PPOWorker.iteration` with the same prompts.
With one process (no process group) the same code runs unpipelined on one device: that run
is the exactness reference of the distributed ones.

1. **Weight sync**: the Actor's and the Critic's training stages are broadcast to the whole
   copies that generation and inference use (:mod:`.reallocate`).
2. **Generation + inference**: every rank is a generation instance; with inter-stage fusion the
   long tail migrates to ``m`` ranks once ``R_t`` samples remain and the freed ranks score
   finished samples as they stream in (:func:`rlhf_fusion.rollout.run_rollout`). Frozen
   models offloaded to host memory (``placement.offload``) are prefetched as generation
   starts, waited for by their first scoring call, and offloaded again once scoring ends
   (:mod:`rlhf_fusion.runtime.offload`).
3. **Advantages**: KL in the reward or the loss, GAE, whitening (:mod:`.advantages`).
4. **Training**: PPO epochs x mini-batches; each mini-batch is one fused Actor/Critic pipeline
   step (or the serial 1F1B order with intra-stage fusion off) planned once from profiled
   stage times and activation memory and reused.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..launch import note_stage
from ..rollout.backend_registry import BackendRequest, make_backend
from ..rollout.inference import Experience, InferenceModels
from ..rollout.local import LocalFusedRollout
from ..rollout.rt_control import RtPlanner, TimedBackend, timed_scoring
from ..rollout.types import SampleSpec
from ..runtime.fused import (
    ROLES,
    default_loss_fns,
    fused_problem,
    partition_rank,
    pipelined_step,
    reference_step,
)
from ..runtime.microbatch import split_micro_batches
from ..runtime.offload import HostOffload, OffloadSet
from ..runtime.ppo import PPOConfig
from ..runtime.weight_sync import (
    broadcast_parameters,
    full_state,
    minimum_bytes,
    ownership,
    shapes_of,
    stage_parameters,
    tied_aliases,
)
from . import advantages as adv
from .config import RLHFConfig
from .models import Models, build_models


class LoopStageError(RuntimeError):
    """A stage of an iteration failed on this rank; the message names the rank and the stage."""


# Tests only: called with (stage, rank, iteration) as each stage starts, to inject faults.
_stage_hook: Callable[[str, int, int], None] | None = None


def ppo_config(cfg: RLHFConfig) -> PPOConfig:
    p = cfg.ppo
    return PPOConfig(
        micro_batches=p.micro_batches, clip_eps=p.cliprange, value_clip_eps=p.cliprange_value,
        kl_mode=p.kl_mode,  # type: ignore[arg-type]
        kl_coef=p.kl_coef if p.kl_mode == "loss" else 0.0,
        kl_estimator=p.kl_estimator,  # type: ignore[arg-type]
        max_grad_norm=p.max_grad_norm,
    )


@dataclass
class IterationResult:
    """What one iteration produced: metrics (TRL names), the experience, per-rank timings."""

    metrics: dict[str, float]
    experiences: list[Experience]
    timeline: dict[str, Any] = field(default_factory=dict)


class PPOWorker:
    """One rank's models, generation instance, training stages and optimizers."""

    def __init__(self, cfg: RLHFConfig, *, models: Models | None = None,
                 device: torch.device | str = "cpu") -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.world != cfg.world_size and self.distributed:
            raise ValueError(f"world_size: the config says {cfg.world_size}, the process group "
                             f"has {self.world} ranks")
        self.models = models if models is not None else build_models(cfg.models)
        self.tokenizer = self.models.tokenizer
        self._scoring: list[tuple[int, float]] = []
        self._scoring_cpu: list[float] = []
        self._train_events: list[tuple[str, float, float]] = []
        self.ppo = ppo_config(cfg)
        self.fused = None
        self._shapes = {role: shapes_of(getattr(self.models, role)) for role in ROLES}
        # Read from the whole models: training cuts them into stages in place.
        self._tied = {role: tied_aliases(getattr(self.models, role)) for role in ROLES}
        self._setup_rollout()
        self._setup_offload()
        self._setup_training()
        self.rt_planner = self._rt_planner()
        self._owners: dict[str, Any] | None = None
        self.iteration_index = 0
        self.schedule = None

    # -- set-up (a placed worker overrides these) ------------------------------------------------
    def _setup_rollout(self) -> None:
        """Whole copies for generation and inference; training owns the originals."""
        m = self.models
        self.backend = TimedBackend(self._generation_backend())
        self.inference = InferenceModels(m.ref, self._reward(), copy.deepcopy(m.critic),
                                         micro_batch=4, device=self.device,
                                         pad_id=self.tokenizer.pad_token_id)
        self.inference.score = timed_scoring(self.inference.score, self._scoring,
                                             self._scoring_cpu)

    def _setup_offload(self) -> None:
        """The frozen models this rank scores with that live in host memory between their
        calls (``cfg.offloaded()``): offloaded now, before the first iteration."""
        held = {}
        for inf in self._inference_models():
            for name in self._offload_names():
                model = getattr(inf, name)
                if isinstance(model, torch.nn.Module):   # a rule reward has no weights
                    held[name] = HostOffload(model, self.device, name=name)
        self.frozen = OffloadSet(held)
        self.frozen.offload()
        self.frozen.take_stats()   # the one-time copy to host is no iteration's

    def _offload_names(self) -> tuple[str, ...]:
        return self.cfg.offloaded()

    def _inference_models(self) -> list[InferenceModels]:
        """The scorers of this rank (a placed worker may hold one per inference call)."""
        return [self.inference]

    def _setup_training(self) -> None:
        cfg, m = self.cfg, self.models
        if self.world > 1:
            n = cfg.stages()
            problem = fused_problem(stage_groups=n, micro_batches=cfg.ppo.micro_batches,
                                    actor_stages=n, critic_stages=cfg.fusion.critic_stages or n)
            self.fused = partition_rank(problem, {"actor": m.actor, "critic": m.critic},
                                        self.rank, loss_fns=default_loss_fns(self.ppo),
                                        replicas=self.world // n, device=self.device)
            params = {role: list(self.fused.stages[role].parameters())
                      for role in self.fused.stages}
        else:
            params = {role: list(getattr(m, role).parameters()) for role in ROLES}
        self.optimizers = self._optimizers(params)

    def _optimizers(self, params: dict[str, list[torch.nn.Parameter]]
                    ) -> dict[str, torch.optim.Optimizer]:
        p = self.cfg.ppo
        lr = {"actor": p.learning_rate, "critic": p.critic_learning_rate or p.learning_rate}
        return {role: torch.optim.AdamW(ps, lr=lr[role], eps=1e-5, weight_decay=p.weight_decay)
                for role, ps in params.items()}

    def _rt_planner(self) -> RtPlanner:
        g = self.cfg.generation
        return RtPlanner(g.prompts_per_iteration, self.world, bs_max=g.bs_max,
                         kv_capacity_tokens=g.kv_capacity_tokens, fixed=self.cfg.rt_samples(None))

    def training_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose parameters this rank trains (what its checkpoint holds)."""
        if self.fused is None:
            return {role: getattr(self.models, role) for role in ROLES}
        return {role: st.module for role, st in self.fused.stages.items()}

    # -- pieces ----------------------------------------------------------------------------------
    def _generation_backend(self) -> Any:
        g = self.cfg.generation
        return make_backend(g.backend, BackendRequest(
            copy_model=lambda: copy.deepcopy(self.models.actor), instance_id=self.rank,
            max_batch_size=g.bs_max, seed=g.seed, checkpoint=str(self.cfg.models.actor),
            device=self.device, kv_capacity_tokens=g.kv_capacity_tokens,
            engine_kwargs=g.vllm_engine_kwargs))

    def _reward(self) -> Any:
        r = self.models.reward
        if isinstance(r, torch.nn.Module):
            return r
        tok = self.tokenizer
        return lambda prompt_ids, response_ids: float(r(tok.decode(prompt_ids),
                                                        tok.decode(response_ids)))

    def specs(self, prompts: Sequence[Sequence[int]], iteration: int) -> list[SampleSpec]:
        g = self.cfg.generation
        # A new sampling key per iteration; within one, a sample's tokens depend only on it.
        seed = g.seed * 1_000_003 + iteration
        return [SampleSpec(sample_id=i, prompt_ids=tuple(p), max_new_tokens=g.max_new_tokens,
                           seed=seed, temperature=g.temperature,
                           stop_token_ids=(int(self.tokenizer.eos_token_id),))
                for i, p in enumerate(prompts)]

    def sync_weights(self) -> dict[str, float]:
        """Training layout -> generation layout, for the Actor (backend) and the Critic."""
        if self.fused is None:
            for role in ROLES:
                self._load(role, self._sync_dst(role),
                           dict(getattr(self.models, role).named_parameters()))
            return {"realloc/bytes": 0.0, "realloc/min_bytes": 0.0}
        stage_params = {r: stage_parameters(s.module, self._tied[r])
                        for r, s in self.fused.stages.items()}
        if self._owners is None:
            canonical = {r: self._canonical(r) for r in stage_params}
            self._owners = ownership(stage_params, canonical)
        moved = minimum = 0
        for role in ROLES:
            own = self._owners[role]
            params, got = broadcast_parameters(own, stage_params.get(role, {}),
                                               self._shapes[role], self.device)
            moved += got
            minimum += minimum_bytes(own, self._shapes[role], self.world)
            if self._receives(role):
                self._load(role, self._sync_dst(role), params)
        totals = torch.tensor([float(moved)], dtype=torch.float64)
        dist.all_reduce(totals)
        return {"realloc/bytes": float(totals[0]), "realloc/min_bytes": float(minimum)}

    def offload_metrics(self) -> dict[str, float]:
        """This iteration's ``offload/*`` over every rank (none when nothing is offloaded):
        bytes brought back to the device (summed), the prefetch copy, the wait for it and
        the offload (seconds, the slowest rank's)."""
        if not self._offload_names():
            return {}
        st = self.frozen.take_stats()
        row = torch.tensor([[st.bytes, st.prefetch_s, st.wait_s, st.offload_s]],
                           dtype=torch.float64)
        if self.distributed:
            rows = [torch.zeros_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row)
            row = torch.cat(rows)
        return {"offload/bytes": float(row[:, 0].sum()),
                "offload/prefetch_s": float(row[:, 1].max()),
                "offload/wait_s": float(row[:, 2].max()),
                "offload/offload_s": float(row[:, 3].max())}

    def busy_metrics(self, rollout_s: float, train_s: float) -> dict[str, float]:
        """Where the ranks' time went this iteration, in rank-seconds summed over the ranks:
        decode steps and scoring calls (wall and thread CPU: wall above CPU is time spent
        waiting for a core, e.g. two processes on one core), the rest of the rollout
        (``time/rollout_idle``: waiting for peers, migration, the stream), and the pipeline's
        forward/backward instructions against the rest of training (``time/train_idle``:
        bubbles, transfers, the optimizer step)."""
        steps = getattr(self.backend, "steps", [])
        compute = sum(b - a for name, a, b in self._train_events if _is_compute(name))
        row = torch.tensor([[sum(s for _, s in steps), getattr(self.backend, "cpu_s", 0.0),
                             sum(s for _, s in self._scoring), sum(self._scoring_cpu),
                             compute]], dtype=torch.float64)
        if self.distributed:
            rows = [torch.zeros_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row)
            row = torch.cat(rows)
        tot = row.sum(0).tolist()
        out = {"time/decode": tot[0], "time/decode_cpu": tot[1], "time/scoring": tot[2],
               "time/scoring_cpu": tot[3],
               "time/rollout_idle": max(self.world * rollout_s - tot[0] - tot[2], 0.0)}
        if self.fused is not None:
            out["time/train_compute"] = tot[4]
            out["time/train_idle"] = max(self.world * train_s - tot[4], 0.0)
        return out

    def _sync_dst(self, role: str) -> torch.nn.Module | None:
        """The copy ``role``'s weights go to (a vLLM engine holds its own: ``None``)."""
        if role == "actor":
            return getattr(self.backend, "model", None)
        return self.inference.critic

    def _receives(self, role: str) -> bool:
        """Whether this rank holds a generation/inference copy of ``role``."""
        return True

    def _load(self, role: str, dst: torch.nn.Module | None, params: dict[str, Tensor]) -> None:
        # The Actor's copy belongs to the generation backend: weights go in through its API.
        if role == "actor":
            self.backend.update_weights(params if dst is None else full_state(dst, params))
        else:
            dst.load_state_dict(full_state(dst, params))

    def rollout(self, specs: list[SampleSpec]) -> tuple[list[Experience], dict[str, Any]]:
        """Generation + inference; every rank returns the whole batch, sorted by sample id."""
        f = self.cfg.fusion
        if self.world == 1:
            out = LocalFusedRollout([self.backend], self.inference).run(specs)
            return out.experiences or [], {"ranks": [], "rt": None}
        from ..rollout import RolloutConfig, run_rollout

        rt = self.rt_planner.rt() if f.inter else None
        fused = bool(rt)   # R_t = 0: the planner predicts no gain from migrating
        rcfg = RolloutConfig(fused=fused, rt=rt if fused else None, mechanism=f.mechanism,
                             timeout_s=f.timeout_s, report_every=16)
        out = run_rollout(self.backend, self.inference, specs, rcfg,
                          bs_max=self.cfg.generation.bs_max)
        return out.experiences or [], {**out.stats, "rt": rt}

    def batch(self, exps: list[Experience]) -> tuple[dict[str, Tensor], dict[str, float]]:
        p = self.cfg.ppo
        rb = adv.response_batch(exps)
        rewards = adv.token_rewards(rb, kl_coef=p.kl_coef, kl_mode=p.kl_mode,
                                    estimator=p.kl_estimator)
        a, r = adv.advantages_and_returns(rb, rewards, gamma=p.gamma, lam=p.lam,
                                          whiten_advantages=p.whiten_advantages)
        batch = adv.training_batch(exps, a, r, rb, pad_id=self.tokenizer.pad_token_id)
        return batch, adv.rollout_metrics(rb, kl_coef=p.kl_coef, estimator=p.kl_estimator)

    def _plan(self, mbs: list[dict[str, Tensor]]) -> None:
        assert self.fused is not None
        f = self.cfg.fusion
        # The engine traces every instruction (a perf_counter pair each): the iteration's
        # timeline shows the fused Actor/Critic pipeline and time/train_compute counts it.
        if f.intra:
            self.schedule = self.fused.plan(mbs, solver=f.solver, time_limit=f.solver_time_limit,
                                            timeout=f.timeout_s, device=self.device, trace=True)
        else:
            from ..schedule import solve

            # RLHFuse-Base: the Actor's 1F1B step, then the Critic's (a barrier between them).
            serial = solve(self.fused.problem, "concatenated_1f1b", time_limit=1.0)
            self.schedule = self.fused.plan(mbs, schedule=serial, timeout=f.timeout_s,
                                            device=self.device, serial=True, trace=True)

    def plan_training(self, prompt_len: float) -> float:
        """Plan the training pipeline now, before the first iteration: profile the stages and
        solve the fused schedule (or build the serial order). Collective. Planning is one-time
        work, so it is charged to no iteration. The profile runs on micro-batches of the
        loop's rows and ``prompt_len`` plus a quarter of ``max_new_tokens`` tokens: only the
        ratios of the stage times steer the schedule, and shorter rows profile faster.
        Returns its seconds."""
        if self.fused is None or self.fused.engine is not None:
            return 0.0
        t = time.perf_counter()
        self._plan(self._planning_micro_batches(prompt_len))
        return time.perf_counter() - t

    def _planning_micro_batches(self, prompt_len: float) -> list[dict[str, Tensor]]:
        g, p = self.cfg.generation, self.cfg.ppo
        rows = max(1, g.prompts_per_iteration // p.num_mini_batches // p.micro_batches
                   ) * p.micro_batches
        prompt = max(1, round(prompt_len))
        seq = prompt + max(1, g.max_new_tokens // 4)
        act = torch.zeros(rows, seq, dtype=torch.long)
        act[:, prompt:] = 1
        zeros = torch.zeros(rows, seq, dtype=torch.float32)
        batch = {"input_ids": torch.full((rows, seq), int(self.tokenizer.pad_token_id or 0)),
                 "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                 "action_mask": act,
                 **{k: zeros.clone() for k in ("old_logprobs", "ref_logprobs", "old_values",
                                               "advantages", "returns")}}
        return split_micro_batches(batch, p.micro_batches)

    def train(self, batch: dict[str, Tensor], iteration: int) -> dict[str, float]:
        """PPO epochs x mini-batches; every rank holds the whole batch and takes its rows."""
        p = self.cfg.ppo
        replicas = self.world // self.cfg.stages() if self.fused is not None else 1
        replica = self.rank // self.cfg.stages() if self.fused is not None else 0
        sums: dict[str, float] = {}
        steps = 0
        for mbs in self.mini_batches(batch, iteration, p.micro_batches * replicas):
            if self.fused is None:
                out = reference_step(
                    {"actor": self.models.actor, "critic": self.models.critic}, mbs,
                    self.optimizers, default_loss_fns(self.ppo), max_grad_norm=p.max_grad_norm)
            else:
                mine = mbs[replica * p.micro_batches: (replica + 1) * p.micro_batches]
                if self.fused.engine is None:
                    self._plan(mine)
                out = pipelined_step(self.fused, mine, self.optimizers,
                                     max_grad_norm=p.max_grad_norm)
                tr = self.fused.engine.last_trace if self.fused.engine is not None else None
                if tr is not None:
                    self._train_events.extend(tr.events)
            steps += 1
            for role, st in out["stats"].items():
                for name, v in st.items():
                    key = f"{role}/{name}"
                    sums[key] = sums.get(key, 0.0) + float(v)
            for role, v in (out.get("grad_norm") or {}).items():
                sums[f"{role}/grad_norm"] = sums.get(f"{role}/grad_norm", 0.0) + float(v)
        means = {k: v / max(steps, 1) for k, v in sums.items()}
        return trl_training_metrics(means)

    def mini_batches(self, batch: dict[str, Tensor], iteration: int, micro_batches: int
                     ) -> Iterator[list[dict[str, Tensor]]]:
        """PPO epochs x mini-batches, each split into ``micro_batches`` micro-batches: the
        rows are shuffled per epoch by a key every rank (and a serial run) shares."""
        p = self.cfg.ppo
        rows = batch["input_ids"].shape[0]
        mini = rows // p.num_mini_batches
        for epoch in range(p.num_ppo_epochs):
            gen = torch.Generator().manual_seed(self.cfg.generation.seed * 7919 + iteration * 101
                                                + epoch)
            order = torch.randperm(rows, generator=gen)
            for k in range(p.num_mini_batches):
                idx = order[k * mini: (k + 1) * mini]
                yield split_micro_batches({key: v[idx] for key, v in batch.items()},
                                          micro_batches)

    # -- the iteration ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        note_stage(f"{name} of iteration {self.iteration_index}")
        if _stage_hook is not None:
            _stage_hook(name, self.rank, self.iteration_index)
        try:
            yield
        except LoopStageError:
            raise
        except Exception as exc:
            raise LoopStageError(
                f"rank {self.rank} of {self.world}: {name} of iteration {self.iteration_index} "
                f"failed: {type(exc).__name__}: {exc}") from exc

    def iteration(self, prompts: Sequence[Sequence[int]]) -> IterationResult:
        it = self.iteration_index
        t0 = time.perf_counter()
        # Generation and scoring keep their own precision (float64 by default) under a
        # Trainer's mixed-precision context; only training runs under it.
        no_autocast = torch.autocast(self.device.type, enabled=False)
        with self._stage("weight sync"), no_autocast:
            self.backend.wake_up()
            realloc = self.sync_weights()
        t1 = time.perf_counter()
        specs = self.specs(prompts, it)
        self.backend.reset_timing()
        self._scoring.clear()
        self._scoring_cpu.clear()
        self._train_events.clear()
        with self._stage("generation + inference"), no_autocast:
            self.frozen.prefetch()  # offloaded Ref/Reward come back while generation runs
            exps, stats = self.rollout(specs)
            self.backend.sleep()  # the generation copy's KV is freed while training runs
            self.frozen.offload()  # and the frozen models go back to host memory
        t2 = time.perf_counter()
        with no_autocast:
            batch, metrics = self.batch(exps)
        t3 = time.perf_counter()
        with self._stage("training"):
            metrics.update(self.train(batch, it))
        t4 = time.perf_counter()
        self.rt_planner.observe([len(e.response_ids) for e in exps], self.backend, self._scoring,
                                prompt_len=sum(len(p) for p in prompts) / max(len(prompts), 1))
        offload = self.offload_metrics()   # a collective: every rank, in this order
        busy = self.busy_metrics(t2 - t1, t4 - t3)   # a collective too
        gen_end = _max_stat(stats, "generation_end_s")
        inf_start = _min_stat(stats, "inference_start_s")
        rollout_s = t2 - t1
        gen_s = gen_end if gen_end is not None else rollout_s
        metrics.update({
            "time/weight_sync": t1 - t0,
            "time/generation": gen_s,
            "time/inference": max(rollout_s - (inf_start or gen_s), 0.0),
            "time/rollout": rollout_s,
            "time/advantages": t3 - t2,
            "time/training": t4 - t3,
            "time/iteration": t4 - t0,
            "samples_per_s": len(exps) / (t4 - t0),
            "fusion/rt": float(stats.get("rt") or 0),
            "episode": float((it + 1) * len(exps)),
            **realloc,
            **offload,
            **busy,
        })
        self.iteration_index += 1
        timeline = {"iteration": it, "t0": t0, "sync": (0.0, t1 - t0),
                    "rollout": (t1 - t0, t2 - t0), "advantages": (t2 - t0, t3 - t0),
                    "training": (t3 - t0, t4 - t0),
                    "ranks": stats.get("ranks", []), "scorers": stats.get("scorers", []),
                    # This rank's pipeline instructions (F/B: compute), seconds since t0.
                    "train_events": [(name, a - t0, b - t0) for name, a, b in self._train_events
                                     if _is_compute(name)]}
        return IterationResult(metrics, exps, timeline)

    # -- state for checkpoints and exactness checks ----------------------------------------------
    def canonical_state(self) -> dict[str, Tensor]:
        """This rank's share of ``{actor.*, critic.*}`` (every entry once over all ranks)."""
        out: dict[str, Tensor] = {}
        if self.fused is None:
            for role in ROLES:
                for k, v in getattr(self.models, role).named_parameters():
                    out[f"{role}.{k}"] = v.detach().clone()
            return out
        for role, st in self.fused.stages.items():
            if self._canonical(role):
                for k, v in stage_parameters(st.module, self._tied[role]).items():
                    out[f"{role}.{k}"] = v.detach().clone()
        return out

    def _canonical(self, role: str) -> bool:
        """Replica 0, copy 0: the rank whose stage of ``role`` is the one saved and sent."""
        return self.fused is None or self.fused.is_canonical(role)

    def set_fusion(self, *, inter: bool, intra: bool) -> None:
        """Switch the plugins between iterations (the pipeline is re-planned if needed)."""
        f = self.cfg.fusion
        rebuild = self.fused is not None and intra != f.intra
        f.inter, f.intra = inter, intra
        if rebuild:
            assert self.fused is not None
            self.fused.close()
            if not intra:  # the serial order needs no profiling: build it now, off the clock
                from ..schedule import solve

                serial = solve(self.fused.problem, "concatenated_1f1b", time_limit=1.0)
                self.fused.build(serial, timeout=f.timeout_s, device=self.device, serial=True,
                                 trace=True)

    def close(self) -> None:
        if self.fused is not None:
            self.fused.close()
        if hasattr(self.backend, "close"):  # a vLLM engine's processes end with it
            self.backend.close()


def trl_training_metrics(means: dict[str, float]) -> dict[str, float]:
    """The training stats under TRL's PPO names (plus ours under their own)."""
    names = {
        "actor/loss": "loss/policy_avg",
        "critic/loss": "loss/value_avg",
        "actor/approx_kl": "policy/approxkl_avg",
        "actor/clip_frac": "policy/clipfrac_avg",
        "critic/clip_frac": "val/clipfrac_avg",
        "critic/value_mean": "val/value_avg",
        "actor/grad_norm": "policy/grad_norm",
        "critic/grad_norm": "val/grad_norm",
    }
    return {names.get(k, k): v for k, v in means.items()}


def _is_compute(name: str) -> bool:
    """Whether a traced pipeline instruction (``actor0:1F3``) is a forward or backward."""
    op = name.split(":", 1)[-1].lstrip("0123456789")
    return op[:1] in ("F", "B")


def _max_stat(stats: dict[str, Any], key: str) -> float | None:
    vals = [r.get(key) for r in stats.get("ranks", []) if r.get(key) is not None]
    return max(vals) if vals else None


def _min_stat(stats: dict[str, Any], key: str) -> float | None:
    vals = [r.get(key) for r in stats.get("ranks", []) if r.get(key) is not None]
    return min(vals) if vals else None
