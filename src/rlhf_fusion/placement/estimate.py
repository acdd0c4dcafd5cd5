"""The estimator: an execution plan in, its iteration time and memory out.

It builds the augmented dataflow graph of ``problem.iterations`` iterations (the problem's
calls: six for PPO, fewer without a Critic or a reward model; a parameter-reallocation node wherever a trainable model's generation or inference layout
differs from its training layout, occupying both meshes; data-transfer delays on edges
between different meshes), runs Algorithm 1 (``timeline.simulate``) on it and checks memory
on every GPU: the static memory of the models resident there plus the largest dynamic memory
of the calls that run there. A plan that does not fit is not dropped but its time is
multiplied by ``oom_penalty``, as ReaLHF does, so the search can walk through it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .costs import CostModel
from .errors import PlacementError
from .graph import CALL_KIND, CALL_MODEL, TRAIN_CALL, data_edges, param_edges, train_calls
from .hooks import fused_train_ratio, rollout_time
from .layout import Layout
from .plan import CallPlacement, ExecutionPlan
from .problem import PlacementProblem
from .realloc_plan import MeshLayout, plan_realloc
from .timeline import Timeline, TNode, simulate

STREAM_CHUNKS = 8   # data between meshes is streamed per micro-batch: only the last chunk waits


@dataclass
class Estimate:
    cost: float                      # what the search minimises
    iteration_time: float            # steady-state seconds per iteration
    makespan: float                  # seconds for all simulated iterations
    oom: bool
    peak_memory: float               # bytes, the fullest GPU
    capacity: float                  # bytes usable on that GPU
    call_time: dict[str, float]
    realloc_time: dict[str, float]
    notes: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline | None = None
    memory: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time, "makespan_s": self.makespan,
                "oom": self.oom, "peak_memory_gb": self.peak_memory / 1e9,
                "capacity_gb": self.capacity / 1e9, "cost": self.cost,
                "call_time_s": self.call_time, "realloc_time_s": self.realloc_time,
                "notes": self.notes}


class Estimator:
    def __init__(self, problem: PlacementProblem, cost: CostModel | None = None):
        self.p = problem
        self.cost = cost or CostModel(problem)
        self.calls = problem.calls
        self.train_call = train_calls(problem.models)
        self._data_edges = data_edges(self.calls)
        self._param_edges = param_edges(self.calls)
        self._realloc: dict[tuple, float] = {}
        self._rollout: dict[tuple, tuple[float, dict]] = {}
        self.evaluations = 0

    # -- pieces ----------------------------------------------------------------------------
    def realloc_seconds(self, model: str, src: CallPlacement, dst: CallPlacement) -> float:
        """Seconds to move ``model`` from ``src``'s layout into ``dst``'s. A sharded training
        layout measured on its ranks (``Profile.layout`` with ``gather``) is gathered whole on
        its ranks first, as the loop does, and moves on from whole copies there."""
        key = (model, src.mesh.ranks, src.strategy, dst.mesh.ranks, dst.strategy)
        t = self._realloc.get(key)
        if t is None:
            m, s = self.p.models[model], src.strategy
            lay = self.cost.measured_layout(TRAIN_CALL[model], s) if model in TRAIN_CALL else None
            gather = 0.0
            if lay is not None and lay.gather:
                gather = lay.gather_seconds(m.params)
                s = Layout(src.mesh.size, 1, 1)
            t = gather + plan_realloc(m, MeshLayout(src.mesh, s), MeshLayout(dst.mesh, dst.strategy),
                                      self.p.cluster, detail=False).seconds
            self._realloc[key] = t
        return t

    def _data_delay(self, a: CallPlacement, b: CallPlacement, parent_call: str) -> float:
        if a.mesh.ranks == b.mesh.ranks:
            return 0.0
        hw = self.cost.hw(b.mesh)
        same_node = (a.mesh.n_nodes == 1 and b.mesh.n_nodes == 1 and a.mesh.group == b.mesh.group
                     and a.mesh.node_start == b.mesh.node_start)
        bw = (hw.nvlink_bw if same_node else hw.ib_bw) * hw.comm_efficiency
        lanes = min(a.mesh.size, b.mesh.size)
        return self.cost.data_bytes(parent_call) / (bw * lanes) / STREAM_CHUNKS + hw.link_latency_s

    def gen_resident(self, plan: ExecutionPlan, static: dict[int, float] | None = None) -> float:
        """Bytes resident on the fullest generation GPU while it generates: every model's
        static memory there plus the Actor's reallocated copy."""
        static = self.static_memory(plan) if static is None else static
        gen = plan.calls["actor_gen"]
        out = max(static.get(r, 0.0) for r in gen.mesh.ranks)
        if "actor_gen" in self.needs_realloc(plan):
            m, s = self.p.models["actor"], gen.strategy
            out += m.param_bytes / (s.tp * s.pp) / (s.dp if s.zero3 else 1)
        return out

    def call_durations(self, plan: ExecutionPlan, static: dict[int, float] | None = None
                       ) -> tuple[dict[str, float], dict[str, Any]]:
        c, p = self.cost, self.p
        resident = self.gen_resident(plan, static)
        d = {k: c.time(k, plan.calls[k].mesh, plan.calls[k].strategy,
                       resident if k == "actor_gen" else None) for k in self.calls}
        notes: dict[str, Any] = {}
        if p.fusion.rollout:
            gen = plan.calls["actor_gen"]
            absorbed = tuple(k for k in ("ref_inf", "reward_inf", "critic_inf")
                             if k in plan.calls and plan.calls[k].same_layout(gen))
            key = (gen.mesh.ranks, gen.strategy, absorbed,
                   c.gen_rounds(gen.mesh, gen.strategy, resident))
            if key not in self._rollout:
                self._rollout[key] = rollout_time(c, gen.mesh, gen.strategy, absorbed, resident)
            d["actor_gen"], info = self._rollout[key]
            for k in absorbed:
                d[k] = 0.0
            notes["rollout"] = info
        if p.fusion.train and "critic_train" in plan.calls:   # fusion pairs Actor and Critic
            a, b = plan.calls["actor_train"], plan.calls["critic_train"]
            if a.mesh.ranks == b.mesh.ranks:
                r = fused_train_ratio(c, a.strategy, b.strategy)
                if r < 1.0:
                    d["actor_train"] = r * (d["actor_train"] + d["critic_train"])
                    d["critic_train"] = 0.0
                    notes["fused_train_ratio"] = r
        return d, notes

    def needs_realloc(self, plan: ExecutionPlan) -> dict[str, str]:
        """call -> model, for calls of a trainable model not in its training layout."""
        out = {}
        for model, train_call in self.train_call.items():
            for k in self.calls:
                if (CALL_MODEL[k] == model and CALL_KIND[k] != "train"
                        and not plan.calls[k].same_layout(plan.calls[train_call])):
                    out[k] = model
        return out

    # -- memory ----------------------------------------------------------------------------
    def static_memory(self, plan: ExecutionPlan) -> dict[int, float]:
        """Bytes per GPU that live between calls: trainable models' training state, frozen
        models' weights unless offloaded."""
        c = self.cost
        static: dict[int, float] = defaultdict(float)
        for model, train_call in self.train_call.items():
            pl = plan.calls[train_call]
            b = c.static_bytes(model, pl.strategy, True)
            for r in pl.mesh.ranks:
                static[r] += b
        for k in self.calls:
            pl = plan.calls[k]
            model = CALL_MODEL[k]
            if model in ("ref", "reward") and model not in plan.offload:
                b = c.static_bytes(model, pl.strategy, False)
                for r in pl.mesh.ranks:
                    static[r] += b
        return static

    def memory(self, plan: ExecutionPlan, static: dict[int, float] | None = None
               ) -> dict[int, float]:
        """Bytes per GPU: static + the largest dynamic. Fused training is assumed to peak as the
        larger of the two models alone (the schedule's memory pass holds it near serial 1F1B)."""
        c = self.cost
        static = self.static_memory(plan) if static is None else static
        resident = self.gen_resident(plan, static)
        dyn: dict[int, float] = defaultdict(float)
        copies = self.needs_realloc(plan)
        for k in self.calls:
            pl = plan.calls[k]
            offloaded = CALL_MODEL[k] in plan.offload
            x = c.dynamic_bytes(k, pl.mesh, pl.strategy, holds_copy=k in copies or offloaded,
                                resident=resident if k == "actor_gen" else None)
            for r in pl.mesh.ranks:
                dyn[r] = max(dyn[r], x)
        return {r: static[r] + dyn[r] for r in set(static) | set(dyn)}

    # -- the whole plan --------------------------------------------------------------------
    def estimate(self, plan: ExecutionPlan, *, keep_timeline: bool = True) -> Estimate:
        self.evaluations += 1
        p = self.p
        if plan.call_names != self.calls:
            raise PlacementError(
                f"plan {plan.name!r} places {list(plan.call_names)} but the problem's models "
                f"{list(p.roles)} have the calls {list(self.calls)}; plan for the same models")
        static = self.static_memory(plan)
        d, notes = self.call_durations(plan, static)
        reallocs = self.needs_realloc(plan)
        rtime = {k: self.realloc_seconds(m, plan.calls[TRAIN_CALL[m]], plan.calls[k])
                 for k, m in reallocs.items()}
        nodes: list[TNode] = []
        index: dict[tuple[str, int], int] = {}
        for t in range(p.iterations):
            for k in self.calls:
                pl = plan.calls[k]
                parents: list[tuple[int, float]] = []
                for a, b in self._data_edges:
                    if b == k:
                        parents.append((index[(a, t)], self._data_delay(plan.calls[a], pl, a)))
                param_parents = [index[(a, t - 1)] for a, b in self._param_edges
                                 if b == k and t > 0]
                if k in reallocs:
                    src = plan.calls[TRAIN_CALL[reallocs[k]]]
                    nodes.append(TNode(f"realloc {reallocs[k]}->{k}@{t}", rtime[k],
                                       src.mesh.rank_set | pl.mesh.rank_set,
                                       [(i, 0.0) for i in param_parents], iteration=t,
                                       kind="realloc", call=k, model=reallocs[k]))
                    parents.append((len(nodes) - 1, 0.0))
                else:
                    parents.extend((i, 0.0) for i in param_parents)
                prefetch = 0.0
                if CALL_MODEL[k] in plan.offload:
                    m = p.models[CALL_MODEL[k]]
                    hw = self.cost.hw(pl.mesh)
                    prefetch = m.param_bytes / (pl.strategy.tp * pl.strategy.pp) / hw.pcie_bw
                nodes.append(TNode(f"{k}@{t}", d[k], pl.mesh.rank_set, parents, prefetch, t,
                                   call=k, model=CALL_MODEL[k]))
                index[(k, t)] = len(nodes) - 1
        tl = simulate(nodes)
        mem = self.memory(plan, static)
        oom = False
        peak, cap = 0.0, 0.0
        for r, b in mem.items():
            group, _ = p.cluster.node_of(r)
            capacity = self.cost.capacity(group)
            if b / capacity > (peak / cap if cap else -1):
                peak, cap = b, capacity
            oom = oom or b > capacity
        it = tl.iteration_time()
        return Estimate(it * (p.oom_penalty if oom else 1.0), it, tl.makespan, oom, peak, cap, d,
                        rtime, notes, tl if keep_timeline else None,
                        mem if keep_timeline else {})
