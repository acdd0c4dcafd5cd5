"""One RLHF iteration on one rank, read top to bottom: sync, generate + score, advantages, train.

The algorithm (``cfg.algorithm``) is PPO (an Actor and a Critic, GAE) or a critic-free one
(GRPO, RLOO, REINFORCE++: ``n`` samples per prompt, group advantages, the clipped policy loss
of :mod:`rlhf_fusion.algorithms`); a critic-free run has no Critic anywhere (not built, placed,
synced, trained or checkpointed) and otherwise runs every step below alike. Its pieces are the
pure functions of :mod:`.critic_free`.

Every rank of the default process group runs :meth:`PPOWorker.iteration` with the same prompts.
Who does what is the run's :class:`~rlhf_fusion.loop.placement.LoopPlacement`: the worker asks
it which calls this rank holds and how each is laid out, and has no other mode. By default
every call runs on every rank and Actor and Critic train on the fused pipeline; a preset or a
plan puts each call on its own ranks. With one process (no process group) every call is on
rank 0 and training runs unpipelined: that run is the exactness reference of the others.
Every rank takes part in every collective of the default group in the same order; groups are
created once, in one order, at construction.

1. **Weight sync**: the trained Actor reaches the generation copies, the trained Critic the
   Critic-inference copies. From the fused pipeline each stage is broadcast from its owner
   (:mod:`.reallocate`); from data-parallel training by
   :func:`rlhf_fusion.runtime.realloc_execute.execute`: a rank that trains the model keeps its
   own weights, every other destination receives each byte once, from the least-loaded
   training rank (ReaLHF's reallocation; under ``disaggregated`` these are the shadow models).
2. **Generation + inference** on the generation ranks (their own process group when not every
   rank): with inter-stage fusion the long tail migrates to ``m`` ranks once ``R_t`` samples
   remain. If the three inference calls share the generation ranks, the freed ranks score
   finished samples as they stream in (:func:`rlhf_fusion.rollout.run_rollout`). Otherwise
   every finished sample goes, as it finishes, into one queue per inference call
   (:mod:`.call_queues`), and the call's ranks score what arrives while generation goes on;
   the scores are gathered back. Frozen models offloaded to host memory
   (``placement.offload``) are prefetched as generation starts, waited for by their first
   scoring call, and offloaded again once scoring ends (:mod:`rlhf_fusion.runtime.offload`).
3. **Advantages** on every rank from the whole batch (cheap, identical everywhere): KL in the
   reward or the loss, GAE, whitening (:mod:`.advantages`); critic-free: group advantages fed
   in the order the samples were scored (:func:`.critic_free.critic_free_batch`). The KL
   coefficient is the run's controller's (fixed, or adaptive: updated after each iteration).
4. **Training**: PPO epochs x mini-batches, each laid out as the training calls' kind: one
   fused Actor/Critic pipeline step (or the serial 1F1B order with intra-stage fusion off)
   planned once from profiled stage times and activation memory and reused; or data parallel
   on each training call's ranks (the replica's micro-batches shared in order, gradients
   summed over the call's group, then one clipped step: the arithmetic of one device).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..algorithms import kl_controller
from ..errors import RLHFFusionError
from ..launch import note_stage
from ..rollout.backend_registry import BackendRequest, make_backend
from ..rollout.inference import Experience, InferenceModels, merge_parts
from ..rollout.local import LocalFusedRollout
from ..rollout.rt_control import (
    RtPlanner,
    ScoringCall,
    TimedBackend,
    scoring_call,
    timed_scoring,
)
from ..rollout.types import SampleSpec
from ..runtime.fused import ROLES
from ..runtime.microbatch import split_micro_batches
from ..runtime.offload import HostOffload, OffloadSet
from ..runtime.ppo import PPOConfig
from ..runtime.training_engine import ENGINES, EngineSpec, TrainingEngine, engine_for
from ..runtime.weight_sync import full_state
from . import advantages as adv
from .algorithm_config import samples_per_iteration
from .call_queues import CallQueues, NoGeneration, Publishing
from .config import RLHFConfig
from .critic_free import critic_free_batch, group_specs, policy_loss_fn
from .errors import LoopConfigError, LoopLaunchError
from .models import Models, build_models
from .placement import (
    INFERENCE_CALLS,
    SYNC_TARGET,
    TRAIN_CALL,
    LoopPlacement,
    check_micro_batches,
    check_trainable,
)
from .resolve import ResolvedRun, resolve_run
from .reward_functions import RewardFunctions


class LoopStageError(RLHFFusionError, RuntimeError):
    """A stage of an iteration failed on this rank; the message names the rank and the stage."""




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
    """One rank's share of an iteration under a placement (see the module docstring): its
    models, generation instance, scorers, training stages or copies, and optimizers.

    ``cfg``: the :class:`~rlhf_fusion.loop.resolve.ResolvedRun` (or a config, resolved here).
    ``placement``: the run's :class:`~rlhf_fusion.loop.placement.LoopPlacement`; by default
    the resolved run's (every call on every rank unless a preset or a plan says otherwise).
    The training layouts' kind picks the training engine
    (:func:`rlhf_fusion.runtime.training_engine.engine_for`); the worker asks the engine."""

    def __init__(self, cfg: RLHFConfig | ResolvedRun, *, models: Models | None = None,
                 device: torch.device | str = "cpu",
                 placement: LoopPlacement | None = None) -> None:
        # Resolved once before the processes started (rlhf_fusion.loop.train) and handed over
        # as it is; a bare config (a caller that owns its processes) is resolved here.
        run = resolve_run(cfg)
        cfg = self.cfg = run.config
        self.hooks = run.hooks
        self.device = torch.device(device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.world != cfg.world_size and self.distributed:
            raise LoopConfigError(f"world_size: the config says {cfg.world_size}, the process "
                                  f"group has {self.world} ranks")
        self.placement = self._placement(placement if placement is not None else run.placement)
        # The algorithm decides the models, the samples, the advantages, the loss and the KL
        # coefficient; a critic-free one (GRPO, RLOO, REINFORCE++) has no Critic anywhere.
        self.algo = cfg.algorithm.resolved(cfg.ppo)
        self.critic_free = cfg.algorithm.critic_free
        # The trained roles, as data: each one a training call of the placement.
        self.roles: tuple[str, ...] = ("actor",) if self.critic_free else tuple(ROLES)
        # Every rank creates every group, in the same order (new_group is collective): the
        # calls' rank sets, and the tensor-parallel and data-parallel groups inside sharded
        # training calls.
        every = tuple(range(self.world))
        sets = set(self.placement.groups())
        for role in self.roles:
            lay = self.placement.layout(TRAIN_CALL[role])
            sets |= set(ENGINES[lay.kind].groups(lay)) - {every}
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted(sets)}
        self.models = (models if models is not None
                       else build_models(cfg.models, critic=not self.critic_free))
        if self.critic_free:
            self.models.critic = None
        self.tokenizer = self.models.tokenizer
        a = self.algo
        # The coefficient of whichever KL term is on (in the reward, else in the loss), fixed
        # or adapted towards algorithm.target_kl after each iteration (the same for PPO).
        self.kl = kl_controller(a.kl_coef if a.kl_in_reward else a.kl_loss_coef,
                                adaptive=a.adaptive_kl, target=a.target_kl,
                                horizon=a.kl_horizon)
        self._finish_order: list[int] = []
        self._scoring: list[ScoringCall] = []
        self._scoring_cpu: list[float] = []
        self._train_events: list[tuple[str, float, float]] = []
        self.ppo = ppo_config(cfg)
        self.engine = self._engine()
        self._setup_rollout()
        self._setup_offload()
        self._setup_training()
        self.rt_planner = self._rt_planner()
        self.iteration_index = 0

    def _placement(self, given: LoopPlacement | None) -> LoopPlacement:
        lp = given
        if lp is not None:   # cheap, and a caller may hand the worker any placement
            check_micro_batches(self.cfg.ppo, self.cfg.generation.prompts_per_iteration, lp)
            check_trainable(lp)
        if lp is None:
            raise LoopConfigError("placement.search: search the plan before building the "
                                  "workers (rlhf_fusion.loop.train does, once)")
        if not self.distributed and lp.world_size > 1:
            if lp.name != "default":
                raise LoopLaunchError("a placement needs torch.distributed initialised with "
                                      f"world_size={self.cfg.world_size} ranks "
                                      "(rlhf_fusion.loop.train starts them)")
            # One process without a process group: every call here.
            lp = LoopPlacement.default(1, 1, offload=lp.offload)
        return lp

    # -- queries on the placement ----------------------------------------------------------------
    def _holds(self, call: str) -> bool:
        return self.placement.holds(call, self.rank)

    def _group(self, ranks: tuple[int, ...]) -> Any:
        """The process group of ``ranks`` (the default group, ``None``, for every rank)."""
        return self.groups.get(ranks)

    # -- set-up ----------------------------------------------------------------------------------
    def _setup_rollout(self) -> None:
        """Whole copies for generation and the inference calls this rank holds; training owns
        the originals. A rank keeps only the frozen models it serves."""
        m, pad = self.models, self.tokenizer.pad_token_id
        generates = self.placement.generates(self.rank)
        self.backend = TimedBackend(self._generation_backend()) if generates else NoGeneration()
        held = {call: self._holds(call) for call in INFERENCE_CALLS}
        models = {"ref_inf": m.ref if held["ref_inf"] else None,
                  "reward_inf": self._reward() if held["reward_inf"] else None,
                  "critic_inf": copy.deepcopy(m.critic) if held["critic_inf"] else None}
        self.scorers: dict[str, InferenceModels] = {}
        if self.placement.streamed_inference:
            self.inference: InferenceModels | None = InferenceModels(
                models["ref_inf"], models["reward_inf"], models["critic_inf"], micro_batch=4,
                device=self.device, pad_id=pad, values=not self.critic_free)
            if generates:
                self.inference.score = self._recording(timed_scoring(
                    self.inference.score, self._scoring, self._scoring_cpu))
        else:
            self.inference = None
            # One scorer per call this rank serves, holding that call's model only.
            self.scorers = {c: InferenceModels(*(models[k] if k == c else None
                                                 for k in INFERENCE_CALLS),
                                               micro_batch=4, device=self.device, pad_id=pad,
                                               values=not self.critic_free)
                            for c in INFERENCE_CALLS if held[c]}
        if not held["ref_inf"]:
            m.ref = None

    def _recording(self, score: Any) -> Any:
        """``score`` that also notes the sample ids in the order they were scored (the group
        tracker takes them so: a group's advantages once its last sample is scored)."""
        def run(samples: Sequence[Any]) -> list[Experience]:
            out = score(samples)
            self._finish_order.extend(s.sample_id for s in samples)
            return out

        return run

    def _setup_offload(self) -> None:
        """The frozen models this rank scores with that live in host memory between their
        calls (``placement.offload``): offloaded now, before the first iteration."""
        held = {}
        for inf in self._inference_models():
            for name in self.placement.offload:
                model = getattr(inf, name)
                if isinstance(model, torch.nn.Module):   # a rule reward has no weights
                    held[name] = HostOffload(model, self.device, name=name)
        self.frozen = OffloadSet(held)
        self.frozen.offload()
        self.frozen.take_stats()   # the one-time copy to host is no iteration's

    def _inference_models(self) -> list[InferenceModels]:
        """The scorers of this rank (one per inference call when they are placed apart)."""
        return [self.inference] if self.inference is not None else list(self.scorers.values())

    def _engine(self) -> TrainingEngine:
        """The training engine of the training layouts' kind (one class per kind)."""
        lp, f, s = self.placement, self.cfg.fusion, self.cfg.ppo
        layouts = {role: lp.layout(TRAIN_CALL[role]) for role in self.roles}
        spec = EngineSpec(
            layouts=layouts, targets={r: lp.layout(SYNC_TARGET[r]) for r in self.roles},
            rank=self.rank, world=self.world, ppo=self.ppo, make_optimizers=self._optimizers,
            groups=self.groups, device=self.device, distributed=self.distributed,
            replicas=lp.replicas, stage_groups=lp.stage_groups, intra=f.intra,
            solver=f.solver, solver_time_limit=f.solver_time_limit, timeout_s=f.timeout_s,
            loss_fns={"actor": self._policy_loss} if self.critic_free else None)
        assert s.micro_batches == self.ppo.micro_batches
        return engine_for(layouts)(spec)

    def _setup_training(self) -> None:
        m = self.models
        self.engine.setup({role: getattr(m, role) for role in self.roles})
        for role in self.roles:
            if role not in self.engine.roles:
                setattr(m, role, None)  # trained elsewhere
        self.optimizers = self.engine.optimizers
        off = sorted({f"{role} on {q.device}" for role, opt in self.optimizers.items()
                      for g in opt.param_groups for q in g["params"]
                      if q.device.type != self.device.type})
        if off:   # a model left behind trains correctly and silently slowly (found on a GPU)
            raise LoopStageError(f"rank {self.rank}: trained parameters are not on "
                                 f"{self.device}: {', '.join(off)}")

    def _optimizers(self, params: dict[str, list[torch.nn.Parameter]]
                    ) -> dict[str, torch.optim.Optimizer]:
        p = self.cfg.ppo
        lr = {"actor": p.learning_rate, "critic": p.critic_learning_rate or p.learning_rate}
        return {role: torch.optim.AdamW(ps, lr=lr[role], eps=1e-5, weight_decay=p.weight_decay)
                for role, ps in params.items()}

    def _rt_planner(self) -> RtPlanner:
        g, gen = self.cfg.generation, self.placement.generators
        return RtPlanner(samples_per_iteration(self.cfg), len(gen), bs_max=g.bs_max,
                         kv_capacity_tokens=g.kv_capacity_tokens,
                         fixed=self.cfg.rt_samples(None), src=gen[0])

    @property
    def schedule(self) -> Any:
        """The training pipeline's planned schedule (``None`` unless one was planned)."""
        return self.engine.schedule

    def training_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose parameters this rank trains (what its checkpoint holds)."""
        return self.engine.modules()

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
        if isinstance(r, RewardFunctions):   # TRL's signature: the token ids beside the text
            return lambda prompt_ids, response_ids: r.score(
                tok.decode(prompt_ids), tok.decode(response_ids), response_ids)
        return lambda prompt_ids, response_ids: float(r(tok.decode(prompt_ids),
                                                        tok.decode(response_ids)))

    def specs(self, prompts: Sequence[Sequence[int]], iteration: int) -> list[SampleSpec]:
        """``algorithm.n`` samples per prompt (PPO: one), each with its own sampling stream."""
        return group_specs(prompts, self.algo.n, iteration=iteration, cfg=self.cfg,
                           eos=int(self.tokenizer.eos_token_id))

    # -- 1. weight sync --------------------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Training layout -> generation layout, for the Actor (backend) and the Critic."""
        params, metrics = self.engine.sync_weights()
        for role, p in params.items():
            self._load(role, self._sync_dst(role), p)
        return metrics

    def _sync_dst(self, role: str) -> torch.nn.Module | None:
        """The copy ``role``'s weights go to (a vLLM engine holds its own: ``None``)."""
        if role == "actor":
            return getattr(self.backend, "model", None)
        scorer = self.inference if self.inference is not None else self.scorers["critic_inf"]
        return scorer.critic

    def _load(self, role: str, dst: torch.nn.Module | None, params: dict[str, Tensor]) -> None:
        # The Actor's copy belongs to the generation backend: weights go in through its API.
        if role == "actor":
            self.backend.update_weights(params if dst is None else full_state(dst, params))
        else:
            dst.load_state_dict(full_state(dst, params))

    def offload_metrics(self) -> dict[str, float]:
        """This iteration's ``offload/*`` over every rank (none when nothing is offloaded):
        bytes brought back to the device (summed), the prefetch copy, the wait for it and
        the offload (seconds, the slowest rank's)."""
        if not self.placement.offload:
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
                             sum(c[2] for c in self._scoring), sum(self._scoring_cpu),
                             compute]], dtype=torch.float64)
        if self.distributed:
            rows = [torch.zeros_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row)
            row = torch.cat(rows)
        tot = row.sum(0).tolist()
        out = {"time/decode": tot[0], "time/decode_cpu": tot[1], "time/scoring": tot[2],
               "time/scoring_cpu": tot[3],
               "time/rollout_idle": max(self.world * rollout_s - tot[0] - tot[2], 0.0)}
        if self.engine.traced:
            out["time/train_compute"] = tot[4]
            out["time/train_idle"] = max(self.world * train_s - tot[4], 0.0)
        return out

    # -- 2. generation + inference ---------------------------------------------------------------
    def rollout(self, specs: list[SampleSpec]) -> tuple[list[Experience], dict[str, Any]]:
        """Generation + inference; every rank returns the whole batch, sorted by sample id."""
        gen = self.placement.generators
        f = self.cfg.fusion
        fused = f.inter and len(gen) > 1
        rt = self.rt_planner.rt() if fused else None  # collective over every rank
        fused = fused and bool(rt)   # R_t = 0: the planner predicts no gain from migrating
        self._t0 = time.perf_counter()   # every rank leaves the collective above together
        self._scored_at: list[float] = []
        # Inference elsewhere: every finished sample goes to one queue per inference call as
        # it finishes, and the calls' ranks score it while generation goes on.
        stream = None if self.placement.streamed_inference else CallQueues(
            self.iteration_index, f.timeout_s, self.placement.inference_calls)
        out_box: list[Any] = [None]
        if self.placement.generates(self.rank):
            from ..rollout import RolloutConfig, run_rollout

            backend = self.backend if stream is None else Publishing(self.backend, stream.push)
            if len(gen) == 1:
                res = LocalFusedRollout([backend], self.inference).run(specs)
                out_box[0] = (res.results, res.experiences, {"ranks": []})
            else:
                rcfg = RolloutConfig(fused=fused, rt=rt if fused else None,
                                     mechanism=f.mechanism, timeout_s=f.timeout_s,
                                     report_every=16, balance_scoring=f.balance_scoring)
                out = run_rollout(backend, self.inference, specs, rcfg,
                                  bs_max=self.cfg.generation.bs_max, group=self._group(gen))
                moved = len(out.assignment.moved_ids) if out.assignment is not None else 0
                out_box[0] = (out.results, out.experiences, {**out.stats, "migrated": moved})
            if stream is not None:
                stream.generation_done()
        scored = self._consume(stream, len(gen)) if stream is not None else None
        if len(gen) < self.world:   # the generation ranks' first hands the batch to everyone
            dist.broadcast_object_list(out_box, src=gen[0])
        results, exps, stats = out_box[0]
        if exps is None:
            exps, scorers = self._gather_scores(results, scored or {})
            stats = {**stats, "scorers": scorers}
        if stream is not None and self.rank == 0:
            stream.clear()
        return exps or [], {**stats, "rt": rt}

    def _consume(self, stream: CallQueues, generators: int
                 ) -> dict[str, list[tuple[int, dict[str, object]]]]:
        """Score this rank's inference calls' samples as they arrive, until generation is done
        on every generation rank and the queues are empty."""
        mine: dict[str, list[tuple[int, dict[str, object]]]] = {c: [] for c in self.scorers}
        idle = 0.001
        while True:
            busy = False
            for call, scorer in self.scorers.items():
                batch = stream.pop(call, scorer.micro_batch)
                if batch:
                    busy = True
                    t = time.perf_counter()
                    self._scored_at.append(t - self._t0)
                    parts = scorer.score_parts(batch)
                    self._scoring.append(scoring_call(batch, time.perf_counter() - t))
                    mine[call].extend((x.sample_id, q) for x, q in zip(batch, parts))
                    if call == "reward_inf":
                        self._finish_order.extend(x.sample_id for x in batch)
            if busy:
                idle = 0.001
                stream.progressed()
                continue
            if stream.finished(generators, list(self.scorers)):
                return mine
            stream.check_deadline(self.rank)
            time.sleep(idle)
            idle = min(2 * idle, 0.008)

    def _gather_scores(self, results: Sequence[Any],
                       mine: dict[str, list[tuple[int, dict[str, object]]]]
                       ) -> tuple[list[Experience], list[dict[str, Any]]]:
        """Every rank gets every score (each call's samples were scored once, somewhere), and
        when each rank scored (seconds since the rollout started: first and last batch)."""
        at = self._scored_at
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (mine, (min(at), max(at)) if at else None))
        by_id: dict[int, list[dict[str, object]]] = {s.sample_id: [] for s in results}
        scorers = []
        for rank, (rep, span) in enumerate(gathered):
            for pairs in rep.values():
                for sid, part in pairs:
                    by_id[sid].append(part)
            if span is not None:
                scorers.append({"rank": rank, "first_score_s": span[0], "last_score_s": span[1]})
        return [merge_parts(s, by_id[s.sample_id], values=not self.critic_free)
                for s in results], scorers

    # -- 3. advantages ---------------------------------------------------------------------------
    def batch(self, exps: list[Experience]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The training batch and its metrics, with the KL coefficient now in effect:
        group advantages (fed in the order the samples were scored) for a critic-free
        algorithm, GAE from the Critic's values for PPO."""
        pad = int(self.tokenizer.pad_token_id or 0)
        if self.critic_free:
            ids = {e.sample_id for e in exps}
            order = [sid for sid in self._finish_order if sid in ids]
            if sorted(order) != sorted(ids):
                order = None   # other ranks scored some: any order gives the same advantages
            return critic_free_batch(exps, self.algo, kl_coef=self.kl.value, pad_id=pad,
                                     order=order)
        p = self.cfg.ppo
        coef = self.kl.value if p.kl_mode == "reward" else 0.0
        if p.kl_mode == "loss":
            self.ppo.kl_coef = self.kl.value   # the engine's actor loss reads it
        rb = adv.response_batch(exps)
        rewards = adv.token_rewards(rb, kl_coef=coef, kl_mode=p.kl_mode,
                                    estimator=p.kl_estimator)
        a, r = adv.advantages_and_returns(rb, rewards, gamma=p.gamma, lam=p.lam,
                                          whiten_advantages=p.whiten_advantages)
        batch = adv.training_batch(exps, a, r, rb, pad_id=pad)
        metrics = adv.rollout_metrics(rb, kl_coef=coef, estimator=p.kl_estimator)
        metrics["objective/kl_coef"] = float(self.kl.value)
        return batch, metrics

    def _policy_loss(self, logits: Tensor, mb: dict[str, Tensor]
                     ) -> tuple[Tensor, dict[str, Tensor]]:
        """A critic-free micro-batch's clipped policy loss, normalised by its mini-batch's
        tokens and sequences (``loss_tokens``/``loss_seqs``, set by :meth:`train`) and times
        the engine's divisor (the replica's micro-batches): the engine's micro-batch losses
        then sum to the mini-batch's whatever the split."""
        fn = policy_loss_fn(self.algo, kl_loss_coef=self._kl_loss_coef(),
                            horizon=self.cfg.generation.max_new_tokens)
        loss, stats = fn(logits, mb, float(mb["loss_tokens"][0]), float(mb["loss_seqs"][0]))
        return loss * self.ppo.micro_batches, stats

    def _kl_loss_coef(self) -> float:
        a = self.algo
        return self.kl.value if not a.kl_in_reward and a.kl_loss_coef else 0.0

    # -- 4. training -----------------------------------------------------------------------------
    def plan_training(self, prompt_len: float) -> float:
        """Plan the training now, before the first iteration (the fused pipeline profiles its
        stages and solves its schedule, or builds the serial order). Collective. Planning is
        one-time work, so it is charged to no iteration. The profile runs on micro-batches
        of the loop's rows and ``prompt_len`` plus a quarter of ``max_new_tokens`` tokens:
        only the ratios of the stage times steer the schedule, and shorter rows profile
        faster. Returns its seconds."""
        return self.engine.prepare(self._planning_micro_batches(prompt_len))

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
        """PPO epochs x mini-batches; every rank holds the whole batch and takes its rows.
        Each mini-batch is split into ``micro_batches`` per replica; this rank's replica takes
        its own and runs them in the training calls' layout."""
        p, lp = self.cfg.ppo, self.placement
        sums: dict[str, float] = {}
        steps = 0
        replica = lp.replica(self.rank)
        for mbs in self.mini_batches(batch, iteration, p.micro_batches * lp.replicas):
            mine = mbs[replica * p.micro_batches: (replica + 1) * p.micro_batches]
            if self.critic_free:
                mine = [_with_loss_norm(mb, mbs) for mb in mine]
            out = self.engine.step(mine)
            self._train_events.extend(self.engine.trace_events())
            steps += 1
            for name, v in out.items():
                sums[name] = sums.get(name, 0.0) + v
        sums = self.engine.reduce_stats(sums)
        means = {k: v / max(steps, 1) for k, v in sums.items()}
        return trl_training_metrics(means)

    def mini_batches(self, batch: dict[str, Tensor], iteration: int, micro_batches: int
                     ) -> Iterator[list[dict[str, Tensor]]]:
        """PPO epochs x mini-batches, each split into ``micro_batches`` micro-batches: the
        rows are shuffled per epoch by a key every rank (and a serial run) shares."""
        p = self.cfg.ppo
        rows = batch["input_ids"].shape[0]
        mini = rows // p.num_mini_batches
        for epoch in range(self.algo.epochs):
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
        hooks = getattr(self, "hooks", None)   # (set in __init__; absent on a bare stand-in)
        if hooks is not None and hooks.on_stage is not None:
            hooks.on_stage(name, self.rank, self.iteration_index)
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
        self._finish_order.clear()
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
        # verl's apply_kl_penalty: the KL per token, averaged per response, then over the batch
        self.kl.update(metrics["objective/kl_per_token"], len(exps))
        lengths = [len(e.response_ids) for e in exps]
        rollout_s = t2 - t1
        self.rt_planner.observe(lengths, self.backend, self._scoring,
                                prompt_len=sum(len(p) for p in prompts) / max(len(prompts), 1),
                                rollout_s=rollout_s)
        bound = self.simulated_speedup(lengths, stats.get("rt"))
        if bound is not None:
            metrics["fusion/simulated_speedup"] = bound
        offload = self.offload_metrics()   # a collective: every rank, in this order
        busy = self.busy_metrics(rollout_s, t4 - t3)   # a collective too
        gen_end = _max_stat(stats, "generation_end_s")
        inf_start = _min_stat(stats, "inference_start_s")
        gen_s = gen_end if gen_end is not None else rollout_s
        metrics.update({
            "time/weight_sync": t1 - t0,
            "time/generation": gen_s,
            "time/inference": max(rollout_s - (inf_start or gen_s), 0.0),
            "time/rollout": rollout_s,
            # (inside time/rollout: rank 0's R_t sweep, which every rank waits for; 0 between)
            "time/rt_sweep": self.rt_planner.last_sweep_s,
            "time/advantages": t3 - t2,
            "time/training": t4 - t3,
            "time/iteration": t4 - t0,
            "samples_per_s": len(exps) / (t4 - t0),
            "fusion/rt": float(stats.get("rt") or 0),
            "fusion/migrated": float(stats.get("migrated", 0)),   # samples moved (TRL's name)
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

    def simulated_speedup(self, lengths: Sequence[int], rt: int | None) -> float | None:
        """R_t's simulator's serial/fused time of this batch's generation + scoring on the
        costs fitted so far, groups included (:func:`~rlhf_fusion.rollout.planning.groups.
        simulate_groups`): the ceiling inter-stage fusion has for these lengths."""
        if not rt or len(self.placement.generators) < 2:
            return None
        import numpy as np

        from ..rollout.planning.groups import simulate_groups

        g = simulate_groups(np.asarray(lengths), self.rt_planner.cluster(), rt, self.algo.n)
        return float(g.speedup) if np.isfinite(g.fused_s) else None

    # -- state for checkpoints and exactness checks ----------------------------------------------
    def canonical_state(self) -> dict[str, Tensor]:
        """This rank's share of ``{actor.*, critic.*}`` (every entry once over all ranks)."""
        return self.engine.canonical_state()

    def set_fusion(self, *, inter: bool, intra: bool) -> None:
        """Switch the plugins between iterations (the training is re-planned if needed)."""
        f = self.cfg.fusion
        f.inter, f.intra = inter, intra
        self.engine.set_intra(intra)

    def close(self) -> None:
        self.engine.close()
        if hasattr(self.backend, "close"):  # a vLLM engine's processes end with it
            self.backend.close()


def _with_loss_norm(mb: dict[str, Tensor], mini: Sequence[dict[str, Tensor]]
                    ) -> dict[str, Tensor]:
    """``mb`` with its mini-batch's response tokens and sequences (``loss_tokens``,
    ``loss_seqs``, one per row: they travel with the rows), what a critic-free loss divides
    by."""
    acts = [m["action_mask"].bool() for m in mini]
    tokens = float(sum(int(a.sum()) for a in acts))
    seqs = float(sum(int((a.sum(-1) > 0).sum()) for a in acts))
    rows = mb["input_ids"].shape[0]
    return {**mb, "loss_tokens": torch.full((rows,), tokens, dtype=torch.float64),
            "loss_seqs": torch.full((rows,), seqs, dtype=torch.float64)}


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
