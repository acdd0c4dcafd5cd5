"""One PPO iteration under a placement: each model function call on its own ranks.

:class:`PlacedPPOWorker` is :class:`~rlhf_fusion.loop.iteration.PPOWorker` with the six calls
placed as :mod:`rlhf_fusion.loop.placement` resolved them (a FlexRLHF preset or a plan file).
The iteration reads the same top to bottom; what changes is who does each part:

1. **Weight sync**: the trained Actor reaches the generation copies, the trained Critic the
   Critic-inference copies, by :func:`rlhf_fusion.runtime.realloc_execute.execute` from the
   training layout to the inference layout: a rank that trains the model keeps its own
   weights, every other destination receives each byte once, from the least-loaded training
   rank (ReaLHF's reallocation; under ``disaggregated`` these are the shadow models). With the
   fused pipeline (every rank trains a stage) each stage is broadcast from its owner as in the
   co-located loop.
2. **Generation + inference** on the generation ranks (their own process group: inter-stage
   fusion migrates the tail among them). If the three inference calls share those ranks, they
   score finished samples while the tail decodes (the co-located loop's streaming). Otherwise
   every finished sample goes, as it finishes, into one queue per inference call (the c10d
   store), and the call's ranks score what arrives while generation goes on (a rank that also
   generates joins once its generation is done); the scores are gathered back.
3. **Advantages** on every rank from the whole batch (cheap, identical everywhere).
4. **Training**: data parallel on each training call's ranks (the mini-batch's micro-batches
   shared in order, gradients summed over the call's group), or the fused pipeline.

Every rank takes part in every collective of the default group in the same order; groups are
created once, in one order, at construction.
"""

from __future__ import annotations

import copy
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..rollout.inference import Experience, InferenceModels, merge_parts
from ..rollout.local import LocalFusedRollout
from ..rollout.rt_control import RtPlanner, TimedBackend, timed_scoring
from ..rollout.types import SampleSpec
from ..runtime.engine import clip_grad_norm_
from ..runtime.fused import ROLES, default_loss_fns, reference_step
from .config import RLHFConfig
from .iteration import PPOWorker, trl_training_metrics
from .models import Models
from .placement import INFERENCE_CALLS, TRAIN_CALL, LoopPlacement

# The Critic-inference copy is the model ``critic_inf`` scores with; the Actor's generation
# copy lives in the backend.
SYNC_TARGET = {"actor": "actor_gen", "critic": "critic_inf"}
INFERENCE_MODEL = {"ref_inf": "ref", "reward_inf": "reward", "critic_inf": "critic"}


class _NoGeneration:
    """Stands in for the backend on ranks outside the generation mesh."""

    steps: list[tuple[int, float]] = []
    model = None

    def wake_up(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def reset_timing(self) -> None:
        pass


class PlacedPPOWorker(PPOWorker):
    """A rank's share of an iteration under ``cfg.placement`` (see the module docstring)."""

    def __init__(self, cfg: RLHFConfig, *, models: Models | None = None,
                 device: torch.device | str = "cpu") -> None:
        cfg.validate()
        self.placement: LoopPlacement = cfg.loop_placement()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("a placement needs torch.distributed initialised with "
                               f"world_size={cfg.world_size} ranks (rlhf_fusion.loop.train "
                               "starts them)")
        # Every rank creates every group, in the same order (new_group is collective).
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in self.placement.groups()}
        super().__init__(cfg, models=models, device=device)

    # -- set-up ----------------------------------------------------------------------------------
    def _layout(self, call: str) -> Any:
        return self.placement.calls[call]

    def _holds(self, call: str) -> bool:
        return self.placement.holds(call, self.rank)

    def _setup_rollout(self) -> None:
        from ..runtime.realloc_execute import param_table

        m, pad = self.models, self.tokenizer.pad_token_id
        # What the weight sync moves, known on every rank (before unplaced models are dropped).
        self._tables = {role: param_table(getattr(m, role), role) for role in ROLES}
        self.backend = (TimedBackend(self._generation_backend()) if self._holds("actor_gen")
                        else _NoGeneration())
        held = {call: self._holds(call) for call in INFERENCE_CALLS}
        models = {"ref_inf": m.ref if held["ref_inf"] else None,
                  "reward_inf": self._reward() if held["reward_inf"] else None,
                  "critic_inf": copy.deepcopy(m.critic) if held["critic_inf"] else None}
        if self.placement.streamed_inference:
            self.inference = InferenceModels(models["ref_inf"], models["reward_inf"],
                                             models["critic_inf"], micro_batch=4,
                                             device=self.device, pad_id=pad)
            if self._holds("actor_gen"):
                self.inference.score = timed_scoring(self.inference.score, self._scoring)
            self.scorers: dict[str, InferenceModels] = {}
        else:
            self.inference = None  # type: ignore[assignment]
            # One scorer per call this rank serves, holding that call's model only.
            self.scorers = {c: InferenceModels(*(models[k] if k == c else None
                                                 for k in INFERENCE_CALLS),
                                               micro_batch=4, device=self.device, pad_id=pad)
                            for c in INFERENCE_CALLS if held[c]}
        # A rank keeps only the frozen models it serves.
        if not held["ref_inf"]:
            m.ref = None

    def _offload_names(self) -> tuple[str, ...]:
        return self.cfg.offloaded(self.placement)

    def _inference_models(self) -> list[InferenceModels]:
        return [self.inference] if self.inference is not None else list(self.scorers.values())

    def _setup_training(self) -> None:
        if self.placement.fused_training:
            super()._setup_training()
            return
        params = {}
        for role, call in TRAIN_CALL.items():
            if self._holds(call):
                params[role] = list(getattr(self.models, role).parameters())
            else:
                setattr(self.models, role, None)  # trained elsewhere
        self.optimizers = self._optimizers(params)

    def _rt_planner(self) -> RtPlanner:
        g, gen = self.cfg.generation, self._layout("actor_gen")
        return RtPlanner(g.prompts_per_iteration, len(gen.ranks), bs_max=g.bs_max,
                         kv_capacity_tokens=g.kv_capacity_tokens,
                         fixed=self.cfg.rt_samples(None), src=gen.ranks[0])

    def training_modules(self) -> dict[str, torch.nn.Module]:
        if self.fused is not None:
            return super().training_modules()
        return {role: getattr(self.models, role) for role, call in TRAIN_CALL.items()
                if self._holds(call)}

    # -- 1. weight sync --------------------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        if self.fused is not None:
            return super().sync_weights()
        from ..placement import Cluster, Layout, ParallelStrategy, mesh_from_ranks
        from ..runtime.realloc_execute import execute

        cluster = Cluster.uniform(1, self.world)

        def layout(call: str) -> Layout:
            lay = self._layout(call)
            return Layout(mesh_from_ranks(cluster, lay.ranks), ParallelStrategy(lay.dp, 1, 1))

        moved = minimum = 0
        for role in ROLES:
            train, target = TRAIN_CALL[role], SYNC_TARGET[role]
            local = (dict(getattr(self.models, role).named_parameters())
                     if self._holds(train) else None)
            # Whole copies on both sides: every piece comes from the least-loaded holder.
            res = execute(self._tables[role], layout(train), layout(target), local, cluster,
                          device=self.device, timeout=self.cfg.fusion.timeout_s)
            moved += res.bytes
            minimum += res.min_bytes
            if res.shard is not None:
                self._load(role, self._sync_dst(role), res.shard)
        return {"realloc/bytes": float(moved), "realloc/min_bytes": float(minimum)}

    def _sync_dst(self, role: str) -> torch.nn.Module | None:
        if role == "actor":
            return getattr(self.backend, "model", None)
        scorer = self.inference if self.inference is not None else self.scorers["critic_inf"]
        return scorer.critic

    def _receives(self, role: str) -> bool:
        return self._holds(SYNC_TARGET[role])

    # -- 2. generation + inference ---------------------------------------------------------------
    def rollout(self, specs: list[SampleSpec]) -> tuple[list[Experience], dict[str, Any]]:
        gen = self._layout("actor_gen")
        f = self.cfg.fusion
        fused = f.inter and len(gen.ranks) > 1
        rt = self.rt_planner.rt() if fused else None  # collective over every rank
        fused = fused and bool(rt)   # R_t = 0: the planner predicts no gain from migrating
        self._t0 = time.perf_counter()   # every rank leaves the collective above together
        self._scored_at: list[float] = []
        # Inference elsewhere: every finished sample goes to one queue per inference call as
        # it finishes, and the calls' ranks score it while generation goes on.
        stream = None if self.placement.streamed_inference else _CallQueues(
            self.iteration_index, self.cfg.fusion.timeout_s)
        out_box: list[Any] = [None]
        if self._holds("actor_gen"):
            from ..rollout import RolloutConfig, run_rollout

            backend = self.backend if stream is None else _Publishing(self.backend, stream.push)
            rcfg = RolloutConfig(fused=fused, rt=rt, mechanism=f.mechanism,
                                 timeout_s=f.timeout_s, report_every=16)
            if len(gen.ranks) == 1:
                res = LocalFusedRollout([backend], self.inference).run(specs)
                out_box[0] = (res.results, res.experiences, {"ranks": []})
            else:
                out = run_rollout(backend, self.inference, specs, rcfg,
                                  bs_max=self.cfg.generation.bs_max,
                                  group=self.groups[gen.ranks])
                out_box[0] = (out.results, out.experiences, out.stats)
            if stream is not None:
                stream.generation_done()
        scored = self._consume(stream, len(gen.ranks)) if stream is not None else None
        # The generation ranks' first member hands the batch to everyone.
        dist.broadcast_object_list(out_box, src=gen.ranks[0])
        results, exps, stats = out_box[0]
        if exps is None:
            exps, scorers = self._gather_scores(results, scored or {})
            stats = {**stats, "scorers": scorers}
        if stream is not None and self.rank == 0:
            stream.clear()
        return exps, {**stats, "rt": rt}

    def _consume(self, stream: _CallQueues, generators: int
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

    # -- 4. training -----------------------------------------------------------------------------
    def train(self, batch: dict[str, Tensor], iteration: int) -> dict[str, float]:
        if self.fused is not None:
            return super().train(batch, iteration)
        p = self.cfg.ppo
        loss_fns = default_loss_fns(self.ppo)
        sums: dict[str, float] = {}
        steps = 0
        for mbs in self.mini_batches(batch, iteration, p.micro_batches):
            steps += 1
            for role, call in TRAIN_CALL.items():
                if not self._holds(call):
                    continue
                for name, v in self._dp_step(role, call, mbs, loss_fns).items():
                    sums[name] = sums.get(name, 0.0) + v
        # Each training call's first rank reports its model's statistics to everyone.
        lead = {role: self._holds(call) and self._layout(call).ranks[0] == self.rank
                for role, call in TRAIN_CALL.items()}
        mine = {k: v for k, v in sums.items() if lead[k.split("/")[0]]}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        means = {k: v / max(steps, 1) for rep in gathered for k, v in rep.items()}
        return trl_training_metrics(means)

    def _dp_step(self, role: str, call: str, mbs: Sequence[dict[str, Tensor]],
                 loss_fns: dict[str, Any]) -> dict[str, float]:
        """This rank's share of one mini-batch for ``role``, gradients summed over the call's
        ranks, then one clipped optimizer step (the same arithmetic as one device)."""
        lay = self._layout(call)
        per = len(mbs) // lay.dp
        i = lay.index(self.rank)
        model = getattr(self.models, role)
        out = reference_step({role: model}, mbs[i * per: (i + 1) * per], None, loss_fns,
                             loss_denominator=len(mbs), step=False, roles=(role,))
        group = self.groups[lay.ranks]
        grads = [q.grad for q in model.parameters() if q.grad is not None]
        if lay.dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            off = 0
            for g in grads:
                g.copy_(flat[off: off + g.numel()].view_as(g))
                off += g.numel()
        stats = out["stats"][role]
        keys = sorted(stats)
        vals = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
        if lay.dp > 1:
            dist.all_reduce(vals, group=group)
        norm = clip_grad_norm_(model.parameters(), self.cfg.ppo.max_grad_norm)
        opt = self.optimizers[role]
        opt.step()
        opt.zero_grad(set_to_none=True)
        res = {f"{role}/{k}": float(v) for k, v in zip(keys, vals)}
        res[f"{role}/grad_norm"] = float(norm)
        return res

    # -- state -----------------------------------------------------------------------------------
    def canonical_state(self) -> dict[str, Tensor]:
        if self.fused is not None:
            return super().canonical_state()
        out: dict[str, Tensor] = {}
        for role, call in TRAIN_CALL.items():
            if self._holds(call) and self._layout(call).ranks[0] == self.rank:
                for k, v in getattr(self.models, role).named_parameters():
                    out[f"{role}.{k}"] = v.detach().clone()
        return out

    def set_fusion(self, *, inter: bool, intra: bool) -> None:
        if self.fused is not None:
            super().set_fusion(inter=inter, intra=intra)
            return
        self.cfg.fusion.inter, self.cfg.fusion.intra = inter, intra


class _Publishing:
    """A generation backend that hands every sample it finishes to ``publish`` (a migrated
    sample finishes, and is published, once: on the rank that decoded its last token)."""

    def __init__(self, inner: Any, publish: Any) -> None:
        self._inner = inner
        self._publish = publish

    def step(self) -> Any:
        finished = self._inner.step()
        if finished:
            self._publish(finished)
        return finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CallQueues:
    """One c10d-store queue per inference call for one iteration, and a count of the
    generation ranks that are done."""

    def __init__(self, iteration: int, timeout_s: float) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"rlhf_fusion/placed/{iteration}/"
        self.timeout_s = timeout_s
        self.progressed()

    def key(self, name: str) -> str:
        return self.prefix + name

    def push(self, samples: Sequence[Any]) -> None:
        for x in samples:
            blob = pickle.dumps(x)
            for call in INFERENCE_CALLS:
                self.store.queue_push(self.key(call), blob)

    def pop(self, call: str, most: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < most:
            try:
                out.append(pickle.loads(self.store.queue_pop(self.key(call), False)))
            except dist.QueueEmptyError:
                break
        return out

    def generation_done(self) -> None:
        self.store.add(self.key("generation_done"), 1)

    def finished(self, generators: int, calls: Sequence[str]) -> bool:
        if int(self.store.add(self.key("generation_done"), 0)) < generators:
            return False
        return all(self.store.queue_len(self.key(c)) == 0 for c in calls)

    def progressed(self) -> None:
        self.deadline = time.perf_counter() + self.timeout_s

    def check_deadline(self, rank: int) -> None:
        if time.perf_counter() > self.deadline:
            raise TimeoutError(
                f"rank {rank}: no generated sample to score for {self.timeout_s:g}s "
                "(fusion.timeout_s) and generation not done; a generation rank died or hung")

    def clear(self) -> None:
        for name in (*INFERENCE_CALLS, "generation_done"):
            try:
                self.store.delete_key(self.key(name))
            except Exception:
                pass  # best effort: keys are namespaced per iteration


def make_worker(cfg: RLHFConfig, *, models: Models | None = None,
                device: torch.device | str = "cpu") -> PPOWorker:
    """The worker for ``cfg``: placed when ``cfg.placement`` names a preset or a plan."""
    cls = PlacedPPOWorker if cfg.placement.given else PPOWorker
    return cls(cfg, models=models, device=device)
