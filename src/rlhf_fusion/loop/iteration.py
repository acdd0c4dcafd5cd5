"""One PPO iteration on one rank, read top to bottom: sync, generate + score, advantages, train.

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
   reward or the loss, GAE, whitening (:mod:`.advantages`).
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import RLHFFusionError
from ..launch import note_stage
from ..rollout.backend_registry import BackendRequest, make_backend
from ..rollout.inference import Experience, InferenceModels, merge_parts
from ..rollout.local import LocalFusedRollout
from ..rollout.rt_control import RtPlanner, TimedBackend, timed_scoring
from ..rollout.types import SampleSpec
from ..runtime.fused import (
    ROLES,
    default_loss_fns,
    partition_rank,
    pipelined_step,
)
from ..runtime.microbatch import split_micro_batches
from ..runtime.offload import HostOffload, OffloadSet
from ..runtime.ppo import PPOConfig
from ..runtime.sharded_state import full_state_dict
from ..runtime.sharded_train import (
    TrainLayout,
    data_parallel_step,
    layout_groups,
    shard_for_training,
)
from ..runtime.weight_sync import (
    broadcast_parameters,
    full_state,
    minimum_bytes,
    ownership,
    shapes_of,
    stage_parameters,
    tied_aliases,
)
from ..schedule.problem import fused_problem
from . import advantages as adv
from .call_queues import CallQueues, NoGeneration, Publishing
from .config import RLHFConfig
from .errors import LoopConfigError, LoopLaunchError
from .models import Models, build_models
from .placement import (
    FUSED_PIPELINE,
    INFERENCE_CALLS,
    SYNC_TARGET,
    TENSOR_PARALLEL,
    TRAIN_CALL,
    TRAINING_KINDS,
    ZERO3,
    LoopPlacement,
    PlacementConfigError,
    check_micro_batches,
    placement_of,
)
from .reward_functions import RewardFunctions


class LoopStageError(RLHFFusionError, RuntimeError):
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
    """One rank's share of an iteration under a placement (see the module docstring): its
    models, generation instance, scorers, training stages or copies, and optimizers.

    ``placement``: the run's :class:`~rlhf_fusion.loop.placement.LoopPlacement`; by default
    the config's (``placement_of(cfg)``: every call on every rank unless a preset or a plan
    says otherwise)."""

    def __init__(self, cfg: RLHFConfig, *, models: Models | None = None,
                 device: torch.device | str = "cpu",
                 placement: LoopPlacement | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.world != cfg.world_size and self.distributed:
            raise LoopConfigError(f"world_size: the config says {cfg.world_size}, the process "
                                  f"group has {self.world} ranks")
        self.placement = self._placement(placement)
        # Every rank creates every group, in the same order (new_group is collective): the
        # calls' rank sets, and the tensor-parallel and data-parallel groups inside sharded
        # training calls.
        every = tuple(range(self.world))
        sets = set(self.placement.groups())
        for role in ROLES:
            if self._sharded(role):
                sets |= set(layout_groups(self._train_layout(role))) - {every}
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted(sets)}
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

    def _placement(self, given: LoopPlacement | None) -> LoopPlacement:
        if given is not None:
            check_micro_batches(self.cfg.ppo, self.cfg.generation.prompts_per_iteration, given)
        lp = given if given is not None else placement_of(self.cfg)
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

    def _train_layout(self, role: str) -> TrainLayout:
        lay = self.placement.layout(TRAIN_CALL[role])
        return TrainLayout(lay.ranks, lay.dp, lay.tp, lay.zero)

    def _sharded(self, role: str) -> bool:
        """``role`` trains as DTensor shards (tensor parallel or ZeRO-3)."""
        return self.placement.layout(TRAIN_CALL[role]).kind in (TENSOR_PARALLEL, ZERO3)

    def _train_groups(self, role: str) -> dict[tuple[int, ...], Any]:
        """The process groups of ``role``'s training layout (the whole world's included)."""
        world = dist.group.WORLD
        return {g: self.groups.get(g, world) for g in layout_groups(self._train_layout(role))}

    # -- set-up ----------------------------------------------------------------------------------
    def _setup_rollout(self) -> None:
        """Whole copies for generation and the inference calls this rank holds; training owns
        the originals. A rank keeps only the frozen models it serves."""
        m, pad = self.models, self.tokenizer.pad_token_id
        if not self.placement.fused_training and self.distributed:
            from ..runtime.realloc_execute import param_table

            # What the weight sync moves, known on every rank (before unplaced models go).
            self._tables = {role: param_table(getattr(m, role), role) for role in ROLES}
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
                device=self.device, pad_id=pad)
            if generates:
                self.inference.score = timed_scoring(self.inference.score, self._scoring,
                                                     self._scoring_cpu)
        else:
            self.inference = None
            # One scorer per call this rank serves, holding that call's model only.
            self.scorers = {c: InferenceModels(*(models[k] if k == c else None
                                                 for k in INFERENCE_CALLS),
                                               micro_batch=4, device=self.device, pad_id=pad)
                            for c in INFERENCE_CALLS if held[c]}
        if not held["ref_inf"]:
            m.ref = None

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

    def _setup_training(self) -> None:
        lp, m = self.placement, self.models
        for kind in lp.training_kinds():
            if kind not in TRAINING_KINDS:
                raise PlacementConfigError(f"placement {lp.name}: training layout {kind!r}; "
                                           f"the loop runs {', '.join(TRAINING_KINDS)}")
        if lp.fused_training:
            actor, critic = lp.layout("actor_train"), lp.layout("critic_train")
            problem = fused_problem(stage_groups=lp.stage_groups,
                                    micro_batches=self.cfg.ppo.micro_batches,
                                    actor_stages=actor.pp, critic_stages=critic.pp)
            self.fused = partition_rank(problem, {"actor": m.actor, "critic": m.critic},
                                        self.rank, loss_fns=default_loss_fns(self.ppo),
                                        replicas=lp.replicas, device=self.device)
            params = {role: list(self.fused.stages[role].parameters())
                      for role in self.fused.stages}
        else:
            params = {}
            for role, call in TRAIN_CALL.items():
                if not self._holds(call):
                    setattr(m, role, None)  # trained elsewhere
                    continue
                if self._sharded(role):   # (tp checked against the model by validate)
                    shard_for_training(getattr(m, role), role, self._train_layout(role),
                                       self.rank, self._train_groups(role), self.device)
                else:
                    getattr(m, role).to(self.device)
                params[role] = list(getattr(m, role).parameters())
        off = sorted({f"{role} on {q.device}" for role, ps in params.items() for q in ps
                      if q.device.type != self.device.type})
        if off:   # a model left behind trains correctly and silently slowly (found on a GPU)
            raise LoopStageError(f"rank {self.rank}: trained parameters are not on "
                                 f"{self.device}: {', '.join(off)}")
        self.optimizers = self._optimizers(params)

    def _optimizers(self, params: dict[str, list[torch.nn.Parameter]]
                    ) -> dict[str, torch.optim.Optimizer]:
        p = self.cfg.ppo
        lr = {"actor": p.learning_rate, "critic": p.critic_learning_rate or p.learning_rate}
        return {role: torch.optim.AdamW(ps, lr=lr[role], eps=1e-5, weight_decay=p.weight_decay)
                for role, ps in params.items()}

    def _rt_planner(self) -> RtPlanner:
        g, gen = self.cfg.generation, self.placement.generators
        return RtPlanner(g.prompts_per_iteration, len(gen), bs_max=g.bs_max,
                         kv_capacity_tokens=g.kv_capacity_tokens,
                         fixed=self.cfg.rt_samples(None), src=gen[0])

    def training_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose parameters this rank trains (what its checkpoint holds)."""
        if self.fused is not None:
            return {role: st.module for role, st in self.fused.stages.items()}
        return {role: getattr(self.models, role) for role in self.placement.trains(self.rank)}

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
        g = self.cfg.generation
        # A new sampling key per iteration; within one, a sample's tokens depend only on it.
        seed = g.seed * 1_000_003 + iteration
        return [SampleSpec(sample_id=i, prompt_ids=tuple(p), max_new_tokens=g.max_new_tokens,
                           seed=seed, temperature=g.temperature,
                           stop_token_ids=(int(self.tokenizer.eos_token_id),))
                for i, p in enumerate(prompts)]

    # -- 1. weight sync --------------------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Training layout -> generation layout, for the Actor (backend) and the Critic."""
        if self.fused is not None:
            return self._sync_from_pipeline()
        if not self.distributed:   # every copy on this rank
            for role in ROLES:
                self._load(role, self._sync_dst(role),
                           dict(getattr(self.models, role).named_parameters()))
            return {"realloc/bytes": 0.0, "realloc/min_bytes": 0.0}
        return self._sync_from_data_parallel()

    def _sync_from_pipeline(self) -> dict[str, float]:
        """Each stage broadcast from its owner (replica 0, copy 0) to every copy."""
        assert self.fused is not None
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
            if self.placement.receives(role, self.rank):
                self._load(role, self._sync_dst(role), params)
        totals = torch.tensor([float(moved)], dtype=torch.float64)
        dist.all_reduce(totals)
        return {"realloc/bytes": float(totals[0]), "realloc/min_bytes": float(minimum)}

    def _sync_from_data_parallel(self) -> dict[str, float]:
        """Whole copies on both sides: every piece comes from the least-loaded holder."""
        from ..placement import Cluster, Layout, ParallelStrategy, mesh_from_ranks
        from ..runtime.realloc_execute import execute

        cluster = Cluster.uniform(1, self.world)

        def layout(call: str) -> Layout:
            lay = self.placement.layout(call)
            return Layout(mesh_from_ranks(cluster, lay.ranks),
                          ParallelStrategy(len(lay.ranks), 1, 1))

        moved = minimum = 0
        for role in ROLES:
            train, target = TRAIN_CALL[role], SYNC_TARGET[role]
            local = (self._whole_weights(role) if self._holds(train) else None)
            # A sharded layout's ranks each hold whole weights once gathered: whole copies.
            res = execute(self._tables[role], layout(train), layout(target), local, cluster,
                          device=self.device, timeout=self.cfg.fusion.timeout_s)
            moved += res.bytes
            minimum += res.min_bytes
            if res.shard is not None:
                self._load(role, self._sync_dst(role), res.shard)
        return {"realloc/bytes": float(moved), "realloc/min_bytes": float(minimum)}

    def _whole_weights(self, role: str) -> dict[str, Tensor]:
        """``role``'s trained weights, whole, on a rank that trains it: a sharded layout
        gathers them (a collective over the call's ranks: every one of them asks, in the
        same order)."""
        model = getattr(self.models, role)
        if self._sharded(role):
            return full_state_dict(model)
        return dict(model.named_parameters())

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
            self.iteration_index, f.timeout_s)
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
                                     report_every=16)
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
                    self._scoring.append((sum(len(x.prompt_ids) + len(x.token_ids)
                                              for x in batch), time.perf_counter() - t))
                    mine[call].extend((x.sample_id, q) for x, q in zip(batch, parts))
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
        return [merge_parts(s, by_id[s.sample_id]) for s in results], scorers

    # -- 3. advantages ---------------------------------------------------------------------------
    def batch(self, exps: list[Experience]) -> tuple[dict[str, Tensor], dict[str, float]]:
        p = self.cfg.ppo
        rb = adv.response_batch(exps)
        rewards = adv.token_rewards(rb, kl_coef=p.kl_coef, kl_mode=p.kl_mode,
                                    estimator=p.kl_estimator)
        a, r = adv.advantages_and_returns(rb, rewards, gamma=p.gamma, lam=p.lam,
                                          whiten_advantages=p.whiten_advantages)
        batch = adv.training_batch(exps, a, r, rb, pad_id=self.tokenizer.pad_token_id)
        return batch, adv.rollout_metrics(rb, kl_coef=p.kl_coef, estimator=p.kl_estimator)

    # -- 4. training -----------------------------------------------------------------------------
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
        """PPO epochs x mini-batches; every rank holds the whole batch and takes its rows.
        Each mini-batch is split into ``micro_batches`` per replica; this rank's replica takes
        its own and runs them in the training calls' layout."""
        p, lp = self.cfg.ppo, self.placement
        sums: dict[str, float] = {}
        steps = 0
        replica = lp.replica(self.rank)
        for mbs in self.mini_batches(batch, iteration, p.micro_batches * lp.replicas):
            mine = mbs[replica * p.micro_batches: (replica + 1) * p.micro_batches]
            out = (self._pipeline_step(mine) if lp.training_kind == FUSED_PIPELINE
                   else self._data_parallel_step(mine))
            steps += 1
            for name, v in out.items():
                sums[name] = sums.get(name, 0.0) + v
        if lp.training_kind != FUSED_PIPELINE and self.distributed:
            # Each training call's first rank reports its model's statistics to everyone.
            lead = {role: self._holds(TRAIN_CALL[role]) and lp.leads(role, self.rank)
                    for role in ROLES}
            report = {k: v for k, v in sums.items() if lead[k.split("/")[0]]}
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, report)
            sums = {k: v for rep in gathered for k, v in rep.items()}
        means = {k: v / max(steps, 1) for k, v in sums.items()}
        return trl_training_metrics(means)

    def _pipeline_step(self, mbs: list[dict[str, Tensor]]) -> dict[str, float]:
        """One fused Actor/Critic pipeline step over this replica's micro-batches."""
        assert self.fused is not None
        if self.fused.engine is None:
            self._plan(mbs)
        out = pipelined_step(self.fused, mbs, self.optimizers,
                             max_grad_norm=self.cfg.ppo.max_grad_norm)
        tr = self.fused.engine.last_trace if self.fused.engine is not None else None
        if tr is not None:
            self._train_events.extend(tr.events)
        return _flat_stats(out)

    def _data_parallel_step(self, mbs: list[dict[str, Tensor]]) -> dict[str, float]:
        """Each training call this rank holds: its share of the micro-batches, gradients
        summed over the call's ranks, then one clipped optimizer step (the arithmetic of one
        device)."""
        loss_fns = default_loss_fns(self.ppo)
        out: dict[str, float] = {}
        for role, call in TRAIN_CALL.items():
            if self._holds(call):
                out.update(self._dp_step(role, call, mbs, loss_fns))
        return out

    def _dp_step(self, role: str, call: str, mbs: Sequence[dict[str, Tensor]],
                 loss_fns: dict[str, Any]) -> dict[str, float]:
        mbs = [{k: v.to(self.device) for k, v in mb.items()} for mb in mbs]
        return data_parallel_step(getattr(self.models, role), role, self._train_layout(role),
                                  self.rank, mbs, loss_fns, self.optimizers[role],
                                  self._train_groups(role), self.cfg.ppo.max_grad_norm)

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

    # -- state for checkpoints and exactness checks ----------------------------------------------
    def canonical_state(self) -> dict[str, Tensor]:
        """This rank's share of ``{actor.*, critic.*}`` (every entry once over all ranks)."""
        out: dict[str, Tensor] = {}
        if self.fused is None:   # whole copies: each training call's first rank saves
            for role in self.placement.trains(self.rank):
                whole = self._whole_weights(role)   # every holder: a sharded one gathers
                if self.placement.leads(role, self.rank):
                    for k, v in whole.items():
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


def _flat_stats(out: dict[str, Any]) -> dict[str, float]:
    """A training step's ``{"stats": {role: {name: v}}, "grad_norm": {role: v}}`` as
    ``{"role/name": v}``."""
    flat = {f"{role}/{name}": float(v) for role, st in out["stats"].items()
            for name, v in st.items()}
    flat.update({f"{role}/grad_norm": float(v)
                 for role, v in (out.get("grad_norm") or {}).items()})
    return flat


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
