"""The placement planning layer: meshes, strategies, presets, Algorithm 1, memory, realloc."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from rlhf_fusion.placement import (
    CALLS,
    CallPlacement,
    Cluster,
    DeviceGroup,
    Estimator,
    ExecutionPlan,
    Layout,
    MeshLayout,
    PlacementError,
    PlacementProblem,
    TNode,
    build_graph,
    enumerate_meshes,
    hardware,
    make_mesh,
    mesh_from_ranks,
    plan_realloc,
    preset_plan,
    ratio_meshes,
    simulate,
    strategies_for,
)
from rlhf_fusion.placement.costs import CostModel, Profile
from rlhf_fusion.placement.models import resolve_model
from rlhf_fusion.placement.presets import Placement, placement_plan

REPO = Path(__file__).resolve().parents[1]


def problem(nodes=1, gpn=2, actor="1b", critic="1b", **kw) -> PlacementProblem:
    cfg = {"models": {"actor": actor, "critic": critic},
           "cluster": {"nodes": nodes, "gpus_per_node": gpn}, "batch": 64, "prompt_len": 256,
           "gen_len": 256}
    cfg.update(kw)
    return PlacementProblem.from_dict(cfg)


# -- imports ---------------------------------------------------------------------------------

def test_placement_imports_no_torch():
    code = ("import sys, rlhf_fusion.placement, rlhf_fusion.placement.cli, "
            "rlhf_fusion.placement.plot, rlhf_fusion.placement.hooks; "
            "assert 'torch' not in sys.modules, 'placement imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_placement_code_imports_no_torch():
    """Only planning code below it: no torch/Lightning/Triton, nothing from the execution
    layers; from rollout only the torch-free planning package (and the exception root,
    ``rlhf_fusion.errors``, which imports nothing)."""
    for path in (REPO / "src" / "rlhf_fusion" / "placement").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = {0: "", 1: "rlhf_fusion.placement.", 2: "rlhf_fusion."}[node.level]
                names = [base + (node.module or "")]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("torch", "lightning", "triton"), \
                    f"{path.name} imports {name}"
                if name.startswith("rlhf_fusion.") and not name.startswith("rlhf_fusion.placement"):
                    assert name.startswith(("rlhf_fusion.schedule", "rlhf_fusion.rollout.planning",
                                            "rlhf_fusion.errors")), \
                        f"{path.name} imports {name}"


# -- topology --------------------------------------------------------------------------------

def test_meshes_are_whole_nodes_or_aligned_node_slices():
    cl = Cluster.uniform(2, 8)
    meshes = enumerate_meshes(cl, 1)
    # per node: 8 + 4 + 2 slices of 1, 2, 4 GPUs; whole nodes: node0, node1, node0-1
    assert len(meshes) == 2 * 14 + 3
    for m in meshes:
        rs = m.ranks
        if len(rs) >= 8:
            assert len(rs) % 8 == 0 and rs[0] % 8 == 0 and list(rs) == list(range(rs[0], rs[0] + len(rs)))
        else:
            assert 8 % len(rs) == 0 and rs[0] % len(rs) == 0 and rs[0] // 8 == rs[-1] // 8
    # slices inside a node nest or are disjoint
    small = [m for m in meshes if m.size < 8]
    for a, b in itertools.combinations(small, 2):
        assert a.rank_set.isdisjoint(b.rank_set) or a.contains(b) or b.contains(a)
    assert len(enumerate_meshes(cl, 4)) == 2 * 2 + 3   # two halves per node


def test_mesh_from_ranks_rejects_what_breaks_the_topology():
    cl = Cluster.uniform(2, 8)
    assert mesh_from_ranks(cl, [2, 3]).name == "main:node0[2:4]"
    assert mesh_from_ranks(cl, range(8, 16)).name == "main:node1"
    for bad in ([1, 2], [0, 1, 2], list(range(12)), list(range(4, 12))):
        with pytest.raises(PlacementError, match="node|slice"):
            mesh_from_ranks(cl, bad)
    with pytest.raises(PlacementError, match="whole nodes"):
        make_mesh(cl, "main", 0, 2, 0, 4)


def test_strategies_keep_tensor_parallel_groups_inside_a_node():
    cl = Cluster.uniform(2, 4)
    model = resolve_model("llama-7b")
    for mesh in enumerate_meshes(cl, 1):
        ss = strategies_for(mesh, model)
        assert ss and all(s.size == mesh.size for s in ss)
        for s in ss:
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(mesh.ranks):
                d, _, p = s.coords(i)
                groups.setdefault((d, p), []).append(r)
            for ranks in groups.values():
                assert len(ranks) == s.tp
                assert len({cl.node_of(r)[1] for r in ranks}) == 1


def test_config_errors_name_the_fix():
    with pytest.raises(PlacementError, match="preset"):
        problem(actor="llama-9b")
    with pytest.raises(PlacementError, match="power of two"):
        problem(gpn=3)
    with pytest.raises(PlacementError, match="unknown config keys"):
        problem(batchsize=3)
    with pytest.raises(PlacementError, match="ppo_minibatches"):
        problem(batch=2)
    with pytest.raises(PlacementError, match="a100-80g"):
        PlacementProblem.from_dict({"models": {"actor": "1b"}, "cluster": {"hardware": "v100"}})


# -- placements ------------------------------------------------------------------------------

def test_presets_rank_sets():
    p = problem(nodes=2, gpn=8)
    allr = set(range(16))
    co = preset_plan(p, "colocated")
    assert all(set(co.calls[c].mesh.ranks) == allr for c in CALLS)
    il = preset_plan(p, "interleaved")
    ref, rew = (set(il.calls[c].mesh.ranks) for c in ("ref_inf", "reward_inf"))
    assert ref.isdisjoint(rew) and ref | rew == allr and len(ref) == 8
    assert set(il.calls["actor_gen"].mesh.ranks) == allr == set(il.calls["critic_train"].mesh.ranks)
    il2 = preset_plan(p, "interleaved2")
    a, c = set(il2.calls["actor_train"].mesh.ranks), set(il2.calls["critic_train"].mesh.ranks)
    assert a.isdisjoint(c) and a | c == allr
    assert set(il2.calls["ref_inf"].mesh.ranks) == a and set(il2.calls["reward_inf"].mesh.ranks) == c
    dis = preset_plan(p, "disaggregated")
    train = set(dis.calls["actor_train"].mesh.ranks)
    infer = set(dis.calls["actor_gen"].mesh.ranks)
    assert train == set(dis.calls["critic_train"].mesh.ranks)
    assert all(set(dis.calls[k].mesh.ranks) == infer
               for k in ("ref_inf", "reward_inf", "critic_inf"))
    assert train.isdisjoint(infer) and train | infer == allr
    # Shadow Actor and Critic: reallocated from the training layout every iteration.
    est = Estimator(p).estimate(dis)
    names = [n.name for n in est.timeline.nodes if n.kind == "realloc"]
    assert names == ["realloc actor->actor_gen@0", "realloc critic->critic_inf@0",
                     "realloc actor->actor_gen@1", "realloc critic->critic_inf@1"]
    nodes = est.timeline.nodes
    sync = next(i for i, n in enumerate(nodes) if n.name == "realloc actor->actor_gen@1")
    assert [nodes[j].name for j, _ in nodes[sync].parents] == ["actor_train@0"]


def test_ratios_pack_left_to_right_and_respect_nodes():
    cl = Cluster.uniform(2, 8)
    m = ratio_meshes(cl, [1, 1, 0.25, 0.25])
    assert m["ref"].name == "main:node0[0:4]" and m["reward"].name == "main:node0[4:8]"
    m = ratio_meshes(cl, [0.5, 0.5, 0.5, 0.5])
    assert m["actor"].name == m["ref"].name == "main:node0"
    assert m["critic"].name == m["reward"].name == "main:node1"
    with pytest.raises(PlacementError, match="node topology"):
        ratio_meshes(cl, [1, 1, 0.75, 0.25])
    with pytest.raises(PlacementError, match="whole number"):
        ratio_meshes(cl, [1, 1, 0.3, 0.5])


def test_explicit_rank_sets_and_heterogeneous_groups():
    cl = Cluster((DeviceGroup("train", 1, hardware("a100-80g"), 4),
                  DeviceGroup("serve", 1, hardware("h100-80g"), 4, inference_only=True)))
    p = PlacementProblem(models={k: resolve_model("1b") for k in ("actor", "critic", "ref", "reward")},
                         cluster=cl, batch=64, prompt_len=256, gen_len=256)
    dis = preset_plan(p, "disaggregated")
    assert dis.calls["actor_gen"].mesh.group == "serve"
    assert dis.calls["actor_train"].mesh.group == "train"
    plan = placement_plan(p, Placement(ranks={"actor": [0, 1], "critic": [2, 3], "ref": [4, 5, 6, 7],
                                              "reward": [4, 5, 6, 7], "actor_gen": [4, 5, 6, 7]}))
    assert plan.calls["actor_gen"].mesh.ranks == (4, 5, 6, 7)
    assert plan.calls["actor_train"].mesh.ranks == (0, 1)
    from rlhf_fusion.placement.search import candidates

    cands = candidates(p, Estimator(p))
    assert all(c.mesh.group == "train" for k in ("actor_train", "critic_train") for c in cands[k])
    assert any(c.mesh.group == "serve" for c in cands["actor_gen"])


# -- graph and Algorithm 1 -------------------------------------------------------------------

def test_graph_has_parameter_version_edges_only_across_iterations():
    g = build_graph(2)
    assert len(g.nodes) == 12
    cross = [(g.nodes[a].name, g.nodes[b].name) for a, b, k in g.edges if k == "param"]
    assert cross == [("actor_train@0", "actor_gen@1"), ("critic_train@0", "critic_inf@1")]
    assert all(g.nodes[a].iteration == g.nodes[b].iteration for a, b, k in g.edges if k == "data")


def test_algorithm1_hand_computed():
    A, B, C, D = (frozenset(x) for x in ({0, 1}, {0}, {1}, {0, 1}))
    nodes = [TNode("a", 2, A), TNode("b", 3, B, [(0, 0.0)]), TNode("c", 1, C, [(0, 0.5)]),
             TNode("d", 1, D, [(1, 0.0), (2, 0.0)])]
    tl = simulate(nodes)
    assert tl.start == [0, 2, 2.5, 5] and tl.end == [2, 5, 3.5, 6]
    # Overlapping meshes serialize in ready order (ties: topological order).
    tl = simulate([TNode("x", 2, frozenset({0})), TNode("y", 1, frozenset({0, 1})),
                   TNode("z", 4, frozenset({1}))])
    assert (tl.start, tl.end) == ([0, 2, 3], [2, 3, 7])
    # Disjoint meshes overlap.
    tl = simulate([TNode("x", 2, frozenset({0})), TNode("z", 4, frozenset({1}))])
    assert tl.makespan == 4
    # Prefetch: the load overlaps the previous call on the GPUs, the rest is exposed.
    tl = simulate([TNode("p", 4, frozenset({0})), TNode("q", 1, frozenset({0}), prefetch_s=3)])
    assert tl.end == [4, 5]
    tl = simulate([TNode("p", 4, frozenset({0})), TNode("q", 1, frozenset({0}), prefetch_s=6)])
    assert tl.end == [4, 7]
    # Steady-state iteration time: last iteration's end minus the previous one's.
    tl = simulate([TNode("i0", 5, frozenset({0}), iteration=0),
                   TNode("i1", 4, frozenset({0}), [(0, 0.0)], iteration=1)])
    assert tl.iteration_time() == 4


def test_actor_generation_overlaps_critic_training_on_disjoint_meshes():
    p = problem(nodes=1, gpn=2)
    half0 = make_mesh(p.cluster, "main", 0, 1, 0, 1)
    half1 = make_mesh(p.cluster, "main", 0, 1, 1, 1)
    one = Layout(1, 1, 1)
    calls = {c: CallPlacement(half1 if c.startswith("critic") else half0, one) for c in CALLS}
    est = Estimator(p).estimate(ExecutionPlan(calls))
    tl = est.timeline
    at = {n.name: i for i, n in enumerate(tl.nodes)}
    assert tl.start[at["actor_gen@1"]] < tl.end[at["critic_train@0"]]
    assert tl.start[at["actor_gen@1"]] == pytest.approx(tl.end[at["actor_train@0"]])
    assert tl.start[at["critic_inf@1"]] >= tl.end[at["critic_train@0"]]


def test_colocated_iteration_time_is_the_sum_of_calls():
    p = problem()
    plan = preset_plan(p, "colocated")
    est = Estimator(p).estimate(plan)
    assert not est.realloc_time
    assert est.iteration_time == pytest.approx(sum(est.call_time.values()))


# -- memory ----------------------------------------------------------------------------------

def test_memory_is_static_plus_peak_dynamic_and_oom_is_penalised():
    p = problem()
    e = Estimator(p)
    plan = preset_plan(p, "colocated")
    c = e.cost
    s = plan.calls["actor_train"].strategy
    static = (c.static_bytes("actor", s, True) + c.static_bytes("critic", s, True)
              + c.static_bytes("ref", s, False) + c.static_bytes("reward", s, False))
    dyn = max(c.dynamic_bytes(k, plan.calls[k].mesh, s, False) for k in CALLS)
    assert e.memory(plan)[0] == pytest.approx(static + dyn)
    one = resolve_model("1b").params
    assert c.static_bytes("actor", Layout(2, 1, 1), True) == pytest.approx(one * (4 + 6))
    assert c.static_bytes("ref", Layout(1, 2, 1), False) == pytest.approx(one)
    ok = e.estimate(plan)
    assert not ok.oom and ok.cost == ok.iteration_time
    # 7B Actor and Critic training on 2 GPUs do not fit: the time is multiplied by the penalty.
    for penalty in (3.0, 5.0):
        big = problem(actor="llama-7b", critic="llama-7b", oom_penalty=penalty)
        est = Estimator(big).estimate(preset_plan(big, "colocated"))
        assert est.oom and est.peak_memory > est.capacity
        assert est.cost == pytest.approx(penalty * est.iteration_time)


def test_offload_moves_frozen_weights_out_of_static_memory_and_prefetches():
    p = problem(actor="llama-7b", critic="llama-7b", nodes=1, gpn=8)
    q = problem(actor="llama-7b", critic="llama-7b", nodes=1, gpn=8, offload_frozen=True)
    a = preset_plan(p, "colocated")
    b = ExecutionPlan(dict(a.calls), offload=("ref", "reward"))
    ea, eb = Estimator(p), Estimator(q)
    ma, mb = ea.memory(a), eb.memory(b)
    s = a.calls["ref_inf"].strategy
    frozen = ea.cost.static_bytes("ref", s, False) + ea.cost.static_bytes("reward", s, False)
    c = ea.cost
    dyn_a = max(c.dynamic_bytes(k, a.calls[k].mesh, s, False) for k in CALLS)
    dyn_b = max(c.dynamic_bytes(k, a.calls[k].mesh, s, k in ("ref_inf", "reward_inf"))
                for k in CALLS)
    # Offloaded weights leave static memory and come back only while their call runs.
    assert ma[0] - mb[0] == pytest.approx(frozen - (dyn_b - dyn_a))
    assert mb[0] < ma[0]
    nodes = eb.estimate(b).timeline.nodes
    pre = [n for n in nodes if n.prefetch_s > 0]
    assert {n.name.split("@")[0] for n in pre} == {"ref_inf", "reward_inf"}


# -- costs -----------------------------------------------------------------------------------

def test_costs_scale_sensibly_and_profiles_interpolate():
    p = problem(nodes=1, gpn=8, actor="llama-7b", critic="llama-7b")
    c = CostModel(p)
    node = make_mesh(p.cluster, "main", 0, 1)
    half = make_mesh(p.cluster, "main", 0, 1, 0, 4)
    t8 = c.time("actor_train", node, Layout(8, 1, 1))
    t4 = c.time("actor_train", half, Layout(4, 1, 1))
    assert 1.7 < t4 / t8 < 2.3
    # Decode is memory-bound: more tensor parallelism makes it faster, pipeline stages do not.
    g_tp = c.time("actor_gen", half, Layout(1, 4, 1))
    g_pp = c.time("actor_gen", half, Layout(1, 1, 4))
    assert g_tp < g_pp
    prof = Profile(forward={1024: 1.0, 4096: 4.0}, backward={1024: 2.0, 4096: 8.0})
    assert prof.layer_forward(1024) == 1.0 and prof.layer_forward(2048) == pytest.approx(2.0)
    assert prof.layer_backward(8192) == pytest.approx(16.0)
    cp = CostModel(p, profiles={"actor": prof})
    s = Layout(1, 1, 1)
    one = make_mesh(p.cluster, "main", 0, 1, 0, 1)
    tokens = p.batch * p.seq_len
    assert cp._layer_compute("actor_train", tokens, s, c.hw(one), backward=False) == \
        pytest.approx(resolve_model("llama-7b").layers * prof.layer_forward(tokens))


def test_fusion_hooks_change_the_estimate():
    base = problem(nodes=1, gpn=8, actor="llama-7b", critic="llama-7b", batch=128,
                   gen_len=512, lengths={"median": 100, "sigma": 1.0})
    fused = problem(nodes=1, gpn=8, actor="llama-7b", critic="llama-7b", batch=128,
                    gen_len=512, lengths={"median": 100, "sigma": 1.0},
                    fusion={"rollout": True, "train": True})
    node = make_mesh(base.cluster, "main", 0, 1)
    s = Layout(2, 2, 2)
    plan = ExecutionPlan({c: CallPlacement(node, s) for c in CALLS})
    e0, e1 = Estimator(base).estimate(plan), Estimator(fused).estimate(plan)
    # Long-tailed responses: the simulator's generation is shorter than every sample at gen_len.
    assert e1.notes["rollout"]["generation_s"] < e0.call_time["actor_gen"]
    assert e1.call_time["ref_inf"] == e1.call_time["reward_inf"] == e1.call_time["critic_inf"] == 0
    assert e1.call_time["critic_train"] == 0 and 0 < e1.notes["fused_train_ratio"] < 1
    assert e1.call_time["actor_train"] < e0.call_time["actor_train"] + e0.call_time["critic_train"]


# -- parameter reallocation ------------------------------------------------------------------

def _layouts(cl: Cluster, layers: int, zero3: bool = False) -> list[MeshLayout]:
    model = resolve_model({"params": 1e6, "layers": layers, "hidden": 64})
    return [MeshLayout(m, s) for m in enumerate_meshes(cl, 1)
            for s in strategies_for(m, model, zero3=zero3)]


def test_reallocation_round_trips_are_exact_and_move_the_minimum():
    cl = Cluster.uniform(2, 2)
    # every tp in {1, 2} and pp in {1, 2, 4} cuts on this grid, and a ZeRO-3 run of 1/dp of a
    # stage's layers (dp <= 4) on the 4x finer layer grid
    layers, cols, fine = 4, 4, 4
    model = resolve_model({"params": 1e6, "layers": layers, "hidden": 64})
    truth = np.arange(layers * fine * cols, dtype=np.float64).reshape(layers * fine, cols) * 1.37
    layouts = _layouts(cl, layers, zero3=True)
    assert len(layouts) > 10 and any(lay.strategy.zero == 3 for lay in layouts)

    def cells(rect):
        l0, l1, c0, c1 = rect
        assert l0 * fine == int(l0 * fine) and l1 * fine == int(l1 * fine)
        return slice(int(l0 * fine), int(l1 * fine)), slice(int(c0 * cols), int(c1 * cols))

    def materialise(lay: MeshLayout) -> dict[int, np.ndarray]:
        out = {}
        for r, rect in lay.shards(layers).items():
            buf = np.full((layers * fine, cols), np.nan)
            buf[cells(rect)] = truth[cells(rect)]
            out[r] = buf
        return out

    def apply(state: dict[int, np.ndarray], src: Layout, dst: Layout) -> dict[int, np.ndarray]:
        rp = plan_realloc(model, src, dst, cl)
        new = {}
        for r, rect in dst.shards(layers).items():
            buf = np.full((layers * fine, cols), np.nan)
            if r in state:   # what a rank already holds stays
                own = state[r]
                mask = ~np.isnan(own)
                keep = np.zeros_like(mask)
                keep[cells(rect)] = True
                buf[mask & keep] = own[mask & keep]
            new[r] = buf
        got = {r: np.zeros((layers * fine, cols), int) for r in new}
        for t in rp.transfers:
            sl = cells((t.layers[0], t.layers[1], t.columns[0], t.columns[1]))
            assert not np.isnan(state[t.src][sl]).any(), "a source sends what it does not hold"
            new[t.dst][sl] = state[t.src][sl]
            got[t.dst][sl] += 1
        assert all((g <= 1).all() for g in got.values()), "a byte arrives twice"
        assert rp.bytes == pytest.approx(rp.min_bytes)
        assert rp.ib_bytes + 1e-9 >= rp.min_ib_bytes
        for r, rect in dst.shards(layers).items():
            exp = np.full((layers * fine, cols), np.nan)
            exp[cells(rect)] = truth[cells(rect)]
            np.testing.assert_array_equal(new[r], exp)
        return new

    for a, b in itertools.product(layouts, repeat=2):
        back = apply(apply(materialise(a), a, b), b, a)
        for r, buf in materialise(a).items():
            np.testing.assert_array_equal(back[r], buf)
    same = plan_realloc(model, layouts[0], layouts[0], cl)
    assert same.bytes == 0 and same.seconds == 0


def test_reallocation_prefers_the_cheapest_source():
    cl = Cluster.uniform(2, 2)
    model = resolve_model({"params": 1e6, "layers": 2, "hidden": 64})
    both = make_mesh(cl, "main", 0, 2)
    node1 = make_mesh(cl, "main", 1, 1)
    src = MeshLayout(both, Layout(2, 2, 1))   # a full replica on each node
    dst = MeshLayout(node1, Layout(1, 1, 2))
    rp = plan_realloc(model, src, dst, cl)
    assert rp.transfers and all(t.link == "nvlink" for t in rp.transfers)
    assert rp.ib_bytes == rp.min_ib_bytes == 0
    assert sum(t.nbytes for t in rp.transfers) == pytest.approx(model.param_bytes / 2)
    assert rp.transfers[0].columns == (Fraction(1, 2), Fraction(1))


# -- ZeRO-3 -------------------------------------------------------------------------------------

def test_zero3_strategy_round_trips_through_a_plan_file():
    p = problem(parallelism="zero3")
    plan = preset_plan(p, "colocated")
    assert plan.calls["actor_train"].strategy == Layout(2, 1, 1, 3)
    assert "zero" in plan.table().splitlines()[0]
    back = ExecutionPlan.from_dict(plan.to_dict(p.cluster), p.cluster)
    assert back.key() == plan.key()
    assert Layout(1, 2, 1, 3) == Layout(1, 2, 1)   # one rank: no sharding
    assert "zero" not in preset_plan(problem(), "colocated").table()
    with pytest.raises(PlacementError, match="parallelism"):
        problem(parallelism="zero2")


def test_zero3_shards_tile_each_replica_once_and_cost_what_zero3_costs():
    cl = Cluster.uniform(2, 8)
    model = resolve_model("llama-7b")
    node0, both = make_mesh(cl, "main", 0, 1), make_mesh(cl, "main", 0, 2)
    z = Layout(16, 1, 1, 3)
    shards = MeshLayout(both, z).shards(model.layers)
    assert sum((l1 - l0) * (c1 - c0) for l0, l1, c0, c1 in shards.values()) == model.layers
    p = PlacementProblem.from_dict({"models": {"actor": "llama-7b"},
                                    "cluster": {"nodes": 2, "gpus_per_node": 8},
                                    "batch": 256, "prompt_len": 256, "gen_len": 256})
    c = CostModel(p)
    # static: everything sharded over dp (16 B/param) against Megatron's replicated weights
    assert c.static_bytes("actor", z, True) == pytest.approx(16 * model.params / 16)
    assert c.static_bytes("actor", Layout(16, 1, 1), True) == pytest.approx(
        model.params * (4 + 12 / 16))
    assert c.static_bytes("ref", z, False) == pytest.approx(2 * model.params / 16)
    # a gather over InfiniBand (two nodes) is slower than over NVLink (one node)
    g_ib = c.zero_gather("actor_train", both, z)
    g_nv = c.zero_gather("actor_train", node0, Layout(8, 1, 1, 3))
    assert g_ib > 5 * g_nv > 0
    assert c.zero_gather("actor_train", both, Layout(16, 1, 1)) == 0
    # training: at least two gathers and a reduce-scatter per micro-batch, never faster than
    # the same compute without ZeRO-3's traffic
    steps = p.ppo_minibatches * p.ppo_epochs
    t = c.train_time("actor_train", both, z)
    assert t >= 3 * steps * g_ib
    assert t > c.train_time("actor_train", both, Layout(16, 1, 1)) - 1e-9
    assert c.inference_time("ref_inf", both, z) >= g_ib
    # generation in a ZeRO-3 layout gathers every decode step: far slower than the hybrid
    # engine's tensor-parallel layout
    assert c.generate_time(both, z) > p.gen_len * g_ib
    assert c.generate_time(both, z) > 10 * c.generate_time(both, Layout(2, 8, 1))


def _zero3_problem(actor: str, nodes: int) -> PlacementProblem:
    return PlacementProblem.from_dict({"models": {"actor": actor, "critic": "llama-7b"},
                                       "cluster": {"nodes": nodes, "gpus_per_node": 8},
                                       "batch": 256, "prompt_len": 256, "gen_len": 256,
                                       "parallelism": "zero3"})


def test_zero3_presets_generate_through_the_hybrid_engine():
    p = _zero3_problem("llama-13b", nodes=1)
    est = Estimator(p)
    plan = preset_plan(p, "colocated", estimator=est)
    for call in CALLS:
        s = plan.calls[call].strategy
        if call == "actor_gen":   # the smallest tp that fits: 1 since generation rounds
            assert s.zero == 0 and s.pp == 1   # leave room for the co-resident models
        else:
            assert s == Layout(8, 1, 1, 3)
    assert est.needs_realloc(plan) == {"actor_gen": "actor"}
    # the engine's gather brings each of the 8 GPUs only the part of its tp shard (P / tp)
    # it lacks: it holds 1/8 of every layer's bytes, so 1/8 of that shard
    tp = plan.calls["actor_gen"].strategy.tp
    rp = plan_realloc(p.models["actor"], MeshLayout(plan.calls["actor_train"].mesh,
                                               plan.calls["actor_train"].strategy),
                      MeshLayout(plan.calls["actor_gen"].mesh, plan.calls["actor_gen"].strategy),
                      p.cluster)
    assert rp.bytes == pytest.approx(rp.min_bytes)
    assert rp.bytes == pytest.approx(8 * p.models["actor"].param_bytes / tp * 7 / 8)


def test_fitting_grows_what_can_grow_when_the_fullest_gpu_cannot():
    # 65B trained with ZeRO-3 on 16 A100s does not fit (16 B/param); the inference ranks must
    # still get a generation layout that fits them
    p = _zero3_problem("llama-65b", nodes=4)
    est = Estimator(p)
    plan = preset_plan(p, "disaggregated", estimator=est)
    mem, cap = est.memory(plan), est.cost.capacity("main")
    train = plan.calls["actor_train"].mesh.rank_set
    assert all(mem[r] > cap for r in train)
    assert all(mem[r] <= cap for r in plan.calls["actor_gen"].mesh.ranks)


def test_zero3_search_proposes_zero3_strategies():
    from rlhf_fusion.placement import candidates

    def zero(par: str) -> bool:
        p = problem(gpn=4, parallelism=par)
        cands = candidates(p, Estimator(p))
        return any(c.strategy.zero == 3 for lst in cands.values() for c in lst)

    assert zero("zero3") and not zero("megatron")


def test_generation_rounds_leave_room_for_co_resident_models():
    """gen_rounds sizes the KV cache against everything resident on the GPU (all four models'
    static memory), so a co-located 13B ZeRO-3 plan on one node splits generation into more
    rounds and fits at batches where sizing against the Actor's weights alone overflowed."""
    for per_gpu in (32, 48, 64):
        p = PlacementProblem.from_dict({
            "models": {"actor": "llama-13b", "critic": "llama-13b"},
            "cluster": {"nodes": 1, "gpus_per_node": 8}, "batch": 8 * per_gpu,
            "prompt_len": 256, "gen_len": 256, "parallelism": "zero3", "ppo_minibatches": 1})
        est = Estimator(p)
        plan = preset_plan(p, "colocated", estimator=est)
        e = est.estimate(plan)
        assert not e.oom, per_gpu
        gen = plan.calls["actor_gen"]
        resident = est.gen_resident(plan)
        assert resident > est.static_memory(plan)[gen.mesh.ranks[0]] > 0
        assert est.cost.gen_rounds(gen.mesh, gen.strategy, resident) > est.cost.gen_rounds(
            gen.mesh, gen.strategy)


def _flex_problem(size: str, nodes: int, **kw) -> PlacementProblem:
    cfg = {"models": {"actor": size, "critic": size},
           "cluster": {"nodes": nodes, "gpus_per_node": 8,
                       "hardware": {"base": "a100-80g", "ib_bw": 12.5e9}},
           "batch": 8 * nodes, "prompt_len": 256, "gen_len": 256, "ppo_minibatches": 1,
           "lora_dim": 4, "whole_batch": True, "parallelism": "deepspeed-chat"}
    cfg.update(kw)
    return PlacementProblem.from_dict(cfg)


def test_lora_charges_gradients_and_adam_state_to_the_adapters_only():
    p = _flex_problem("llama-7b", 1)
    c = CostModel(p)
    m = p.models["actor"]
    h, ffn, r = 4096, 11008, 4
    adapters = m.layers * r * (4 * 2 * h + 3 * (h + ffn))   # q k v o, gate up down
    assert c.trainable_params("actor") == pytest.approx(adapters, rel=0.01)
    z2 = Layout(8, 1, 1, 2)
    assert c.static_bytes("actor", z2, True) == pytest.approx(
        2 * m.params + c.trainable_params("actor") * (2 + 14 / 8))
    full = CostModel(_flex_problem("llama-7b", 1, lora_dim=0))
    assert full.static_bytes("actor", z2, True) == pytest.approx(m.params * (2 + 14 / 8))
    # frozen weights get no weight gradients: 6 instead of 8 FLOPs per param and token
    s = Layout(8, 1, 1)
    node = make_mesh(p.cluster, "main", 0, 1)
    assert c._layer_compute("actor_train", 1e4, s, c.hw(node), True) == pytest.approx(
        0.75 * full._layer_compute("actor_train", 1e4, s, c.hw(node), True))


@pytest.mark.parametrize("size, stage, gen_zero, realloc", [
    ("llama-7b", 2, 2, False),     # ZeRO-2, Ref/Reward replicated, generation in place
    ("llama-13b", 3, 0, True),     # ZeRO-3, the hybrid engine gathers the Actor once
    ("llama-33b", 3, 3, False),    # gathered 33B does not fit beside the shards: per step
])
def test_deepspeed_chat_picks_its_zero_stage_and_hybrid_engine_mode_by_fit(size, stage,
                                                                           gen_zero, realloc):
    p = _flex_problem(size, 1)
    est = Estimator(p)
    plan = preset_plan(p, "colocated", estimator=est)
    assert plan.calls["actor_train"].strategy == Layout(8, 1, 1, stage)
    assert plan.calls["ref_inf"].strategy.zero == (3 if stage == 3 else 0)
    gen = plan.calls["actor_gen"]
    assert gen.strategy == Layout(8, 1, 1, gen_zero)
    assert ("actor_gen" in est.needs_realloc(plan)) == realloc
    assert not est.estimate(plan).oom
    if gen_zero == 3:   # every decode step gathers every layer
        assert est.cost.generate_time(gen.mesh, gen.strategy) > p.gen_len * est.cost.zero_gather(
            "actor_gen", gen.mesh, gen.strategy)


def test_max_batch_is_the_largest_that_fits_and_interleaving_frees_room():
    from rlhf_fusion.placement import max_batch
    from rlhf_fusion.placement.presets import preset_placement

    p = _flex_problem("llama-7b", 1)
    out = {}
    for name in ("colocated", "interleaved"):
        r = max_batch(p, lambda q, e, n=name: placement_plan(q, preset_placement(n),
                                                              estimator=e), refit=False)
        assert r is not None and not r.estimate.oom
        assert r.throughput == pytest.approx(r.batch / r.estimate.iteration_time)
        bigger = dataclasses.replace(p, batch=r.batch + 8)
        assert Estimator(bigger).estimate(r.plan).oom
        out[name] = r
    # FlexRLHF V-B1: interleaving halves the frozen models' memory, so the batch grows
    assert out["interleaved"].per_gpu > out["colocated"].per_gpu
    assert out["interleaved"].throughput > out["colocated"].throughput
