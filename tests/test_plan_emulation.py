"""The emulated plan executor (``rlhf_fusion.testing.emulate``) on 4 gloo processes.

One plan that exercises every path: data between meshes of different sizes (4 -> 2, 2 -> 1,
1 -> 4, ...), reallocations between a tensor-parallel training layout and data-parallel
layouts on overlapping and on disjoint meshes. Durations are scaled down 100x: the checks are
about behaviour (what ran where, in which order, which bytes moved), not speed (the speed
figures live in ``benchmarks/placement_measured.py``).
"""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_fusion.launch import DistributedRunError, run_ranks
from rlhf_fusion.placement import (
    A100_80G,
    CallPlacement,
    Cluster,
    DeviceGroup,
    Estimator,
    ExecutionPlan,
    Layout,
    MeshLayout,
    ModelShape,
    PlacementProblem,
    make_mesh,
    plan_realloc,
)
from rlhf_fusion.placement.graph import TRAIN_CALL
from rlhf_fusion.testing.emulate import (
    LinkMeasurement,
    _emulate_worker,
    build_program,
    emulate_plan,
    local_hardware,
)

ACTOR = ModelShape(2e6, 4, 256, name="tiny-actor")     # 4 MB of bf16: reallocations are quick
CRITIC = ModelShape(1e6, 2, 256, name="tiny-critic")


def _setup(pcie_bw: float | None = None) -> tuple[Estimator, ExecutionPlan]:
    # A fixed link figure: the test needs durations of a sensible scale, not a measurement.
    link = LinkMeasurement(5e-5, 2e9, 1e9, 1 << 20, 2)
    hw = local_hardware(flops=2e12, hbm_bw=2e11, link=link, base=A100_80G)
    if pcie_bw is not None:
        hw = dataclasses.replace(hw, pcie_bw=pcie_bw)
    cluster = Cluster((DeviceGroup("main", 1, dataclasses.replace(hw, gpus_per_node=4), 4),))
    p = PlacementProblem(models={"actor": ACTOR, "critic": CRITIC, "ref": ACTOR,
                                 "reward": CRITIC}, cluster=cluster, batch=16, prompt_len=32,
                         gen_len=32, ppo_minibatches=2, micro_batch_tokens=256)
    m = lambda start, n: make_mesh(cluster, "main", 0, 1, start, n)  # noqa: E731
    s = Layout
    calls = {
        "actor_train": CallPlacement(m(0, 4), s(2, 2, 1)),
        "actor_gen": CallPlacement(m(2, 2), s(2, 1, 1)),      # overlapping the training mesh
        "ref_inf": CallPlacement(m(0, 2), s(2, 1, 1)),
        "reward_inf": CallPlacement(m(0, 1), s(1, 1, 1)),
        "critic_inf": CallPlacement(m(2, 2), s(1, 2, 1)),
        "critic_train": CallPlacement(m(0, 2), s(2, 1, 1)),  # disjoint from its inference
    }
    return Estimator(p), ExecutionPlan(calls, "mixed")


def test_emulated_plan_runs_the_estimators_graph() -> None:
    est, plan = _setup()
    res = emulate_plan(plan, est, repeats=2, duration_scale=0.01, timeout=30.0,
                       run_timeout=120.0)
    prog = res.program
    nodes = prog.nodes
    tl = res.predicted.timeline
    assert tl is not None and len(nodes) == len(tl.nodes)
    assert any(n.kind == "realloc" for n in nodes) and prog.data_in, "plan exercises both paths"
    p = est.p
    for run in res.runs:
        # Every node exactly once on exactly the ranks of its mesh.
        for i, n in enumerate(nodes):
            assert run.ranks[i] == list(n.ranks), n.name
            assert run.runs[i] == len(n.ranks), n.name
        for r, done in run.per_rank.items():
            assert set(done) == {i for i, n in enumerate(nodes) if r in n.ranks}
        # No node started before each parent ended (one CLOCK_MONOTONIC for all processes).
        for i, n in enumerate(nodes):
            for j in n.parents:
                assert run.start[i] >= run.end[j], (n.name, nodes[j].name)
        # Nodes on overlapping meshes never overlapped on the GPUs they share.
        for i, a in enumerate(nodes):
            for j, b in enumerate(nodes):
                shared = set(a.ranks) & set(b.ranks)
                if i == j or not shared or run.start[i] > run.start[j]:
                    continue
                if run.start[i] == run.start[j] and i > j:
                    continue
                a_end = max(run.per_rank[r][i][1] for r in shared)
                assert run.start[j] >= a_end, (a.name, b.name)
        # Each reallocation received exactly the bytes of the plan's transfers.
        for i, n in enumerate(nodes):
            if n.kind != "realloc":
                continue
            model, rest = n.name.split(" ", 1)[1].split("->")
            src, dst = plan.calls[TRAIN_CALL[model]], plan.calls[rest.split("@")[0]]
            rp = plan_realloc(p.models[model], MeshLayout(src.mesh, src.strategy),
                              MeshLayout(dst.mesh, dst.strategy), p.cluster)
            assert rp.transfers, n.name
            assert run.recv_bytes[i] == sum(max(1, round(t.nbytes)) for t in rp.transfers)
            assert abs(run.recv_bytes[i] - rp.bytes) <= len(rp.transfers)
        assert run.iteration_time > 0


def test_a_missing_message_names_node_and_rank() -> None:
    est, plan = _setup()
    prog = build_program(plan, est, duration_scale=0.01)
    # Drop one data chunk on the producer side: its consumer must time out, not hang.
    consumer, msgs = next(iter(prog.data_in.items()))
    lost = msgs[0]
    prog.data_out[lost.producer] = [m for m in prog.data_out[lost.producer] if m.tag != lost.tag]
    with pytest.raises(DistributedRunError) as info:
        run_ranks(_emulate_worker, prog.world, prog, 1, 2.0, timeout=60.0,
                  collective_timeout=2.0)
    failed = info.value.failed
    assert lost.dst in failed
    msg = failed[lost.dst].error
    assert failed[lost.dst].error_type == "EmulationError"
    assert prog.nodes[consumer].name in msg and f"rank {lost.dst}" in msg


def test_offload_prefetch_overlaps_the_previous_node_as_the_estimator_assumes() -> None:
    """plan.offload: the Ref (ranks 0-1) and the Reward (rank 0) load over a slow PCIe link
    (0.3 s and 0.15 s) from the start of the previous node on their GPUs. Each such call starts
    no earlier than that start plus its prefetch, and on rank 0 the Reward's load overlaps the
    Ref's call (0.1 s) before it: it starts near 0.15 s after the Ref's start, not 0.25 s."""
    est, plan = _setup(pcie_bw=CRITIC.param_bytes / 0.15)
    off = ExecutionPlan(dict(plan.calls), "mixed-offload", ("ref", "reward"))
    scale = 0.1 / est.estimate(off).call_time["ref_inf"]   # the Ref's call: 0.1 s
    res = emulate_plan(off, est, repeats=1, warmup=0, duration_scale=scale, timeout=30.0,
                       run_timeout=120.0)
    prog, tl = res.program, res.predicted.timeline
    assert tl is not None
    for n, t in zip(prog.nodes, tl.nodes, strict=True):
        assert n.prefetch_s == t.prefetch_s
        assert (n.prefetch_s > 0) == (t.model in ("ref", "reward") and n.kind == "call")
    run = res.runs[0]
    overlapped = 0
    for r, order in prog.order.items():
        for k, i in enumerate(order):
            node = prog.nodes[i]
            if node.prefetch_s == 0 or k == 0:
                continue
            prev = order[k - 1]
            p_start, p_end = run.per_rank[r][prev]
            start = run.per_rank[r][i][0]
            # Never before its weights could have loaded (1 ms: the clock, not the model) ...
            assert start >= p_start + node.prefetch_s - 1e-3, (node.name, r)
            if node.name.startswith("reward_inf") and prog.nodes[prev].name.startswith("ref_inf"):
                # ... and loaded during the previous call, not after it.
                assert start < p_end + node.prefetch_s - 0.05, (node.name, start - p_start)
                overlapped += 1
    assert overlapped == 2   # rank 0, both iterations
