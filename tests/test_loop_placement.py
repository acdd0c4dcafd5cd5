"""The loop under a placement: every preset and a searched plan give the co-located run.

Four gloo processes, three iterations each: identical token ids, experience and Actor/Critic
parameters within 1e-6 of the default loop (every model on every rank, the fused 4-stage
pipeline), every sample exactly once; bad placements are rejected before any process starts.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from test_loop import assert_same_run, run, tiny  # noqa: E402

from rlhf_fusion.loop import LoopConfigError, PlacementSection  # noqa: E402
from rlhf_fusion.loop.placement import resolve  # noqa: E402
from rlhf_fusion.loop.resolve import resolve_run  # noqa: E402
from rlhf_fusion.placement import (  # noqa: E402
    Cluster,
    PlacementProblem,
    make_mesh,
    search,
)
from rlhf_fusion.placement.layout import Layout  # noqa: E402
from rlhf_fusion.placement.plan import CallPlacement, ExecutionPlan  # noqa: E402

WORLD = 4
MICRO = 4   # micro-batches per mini-batch: every training call's dp (1, 2 or 4) divides it


@pytest.fixture(scope="module")
def colocated():
    return run(tiny(WORLD, pipeline_stages=WORLD, micro_batches=MICRO))


@pytest.fixture(scope="module")
def preset_runs():
    """The run under each preset, once per module (two tests read interleaved2's)."""
    cache: dict[str, dict] = {}

    def get(preset: str) -> dict:
        if preset not in cache:
            cache[preset] = run(tiny(WORLD, micro_batches=MICRO,
                                     placement=PlacementSection(preset=preset)))
        return cache[preset]

    return get


@pytest.mark.parametrize("preset", ["colocated", "interleaved", "interleaved2", "disaggregated"])
def test_preset_equals_colocated(colocated, preset_runs, preset):
    res = preset_runs(preset)
    assert_same_run(colocated, res)
    h = res["history"][-1]
    # Weights move only to ranks that lack them, once each.
    assert h["realloc/bytes"] == h["realloc/min_bytes"]
    if preset == "disaggregated":   # shadow Actor and Critic on the two inference ranks
        assert h["realloc/bytes"] > 0


def test_inference_on_other_ranks_scores_while_generation_runs(preset_runs):
    """interleaved2: ranks 2 and 3 hold the Reward and the Critic, not the generator; they
    score samples streamed from ranks 0 and 1 before the last one is generated."""
    res = preset_runs("interleaved2")
    for tl in res["timelines"]:
        gen_end = max(r["generation_end_s"] for r in tl["ranks"])
        others = [s for s in tl["scorers"] if s["rank"] in (2, 3)]
        assert {s["rank"] for s in others} == {2, 3}
        assert min(s["first_score_s"] for s in others) < gen_end


def tiny_problem() -> PlacementProblem:
    return PlacementProblem.from_dict({
        "models": {"actor": {"params": 2e5, "layers": 4, "hidden": 32, "vocab": 64,
                             "heads": 4}},
        "cluster": {"nodes": 1, "gpus_per_node": WORLD, "hardware": "a100-80g"},
        "batch": 16, "prompt_len": 8, "gen_len": 40, "ppo_minibatches": 2, "ppo_epochs": 2,
        "micro_batch_tokens": 256})


def test_searched_plan_equals_colocated(colocated, tmp_path):
    prob = tiny_problem()
    found = search(prob, time_limit=2.0, seed=0)
    path = tmp_path / "plan.json"
    found.plan.save(path, prob.cluster)
    res = run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(plan=str(path))))
    assert_same_run(colocated, res)


def test_plan_searched_at_start_equals_colocated(colocated, tmp_path):
    """placement.search: one search before the ranks start, among what the loop executes."""
    res = run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(search=2.0)),
              out_dir=tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert all(c["tp"] == 1 and c["pp"] == 1 for c in plan["calls"].values())
    assert_same_run(colocated, res)


KINDS = {"tp=2": ("tensor_parallel", "tensor_parallel"), "zero3": ("zero3", "zero3"),
         "split": ("tensor_parallel", "zero3")}


@pytest.mark.parametrize("name, override", [
    # Two data-parallel replicas of a tp=2 Actor and Critic (DTensor Megatron plans), the
    # generation and inference calls data parallel on all four ranks.
    ("tp=2", {"actor_train": (0, 4, 2, 2, 1), "critic_train": (0, 4, 2, 2, 1)}),
    # ZeRO-3 (FSDP2) Actor and Critic over all four ranks.
    ("zero3", {"actor_train": (0, 4, 4, 1, 1, 3), "critic_train": (0, 4, 4, 1, 1, 3)}),
    # tp=2 Actor on ranks 0-1 beside a ZeRO-3 Critic on ranks 2-3; generation on 0-1, so
    # the Critic's gathered weights travel to the other ranks' inference copies.
    ("split", {"actor_train": (0, 2, 1, 2, 1), "critic_train": (2, 2, 2, 1, 1, 3),
               "actor_gen": (0, 2, 2, 1, 1), "critic_inf": (0, 2, 2, 1, 1)}),
])
def test_sharded_training_plans_equal_colocated(colocated, tmp_path, name, override):
    """Tensor-parallel and ZeRO-3 training calls (torch's DTensor and FSDP2 engines) equal
    the co-located run within the loop's data-parallel bound (float32 weights: the sums
    over tp shards and data-parallel ranks run in another order than one device's)."""
    from rlhf_fusion.loop.placement import placement_of

    cfg = tiny(WORLD, micro_batches=MICRO,
               placement=PlacementSection(plan=_plan_file(tmp_path, **override)))
    assert placement_of(cfg).training_kinds() == KINDS[name]
    res = run(cfg)
    assert_same_run(colocated, res)
    h = res["history"][-1]
    assert h["realloc/bytes"] == h["realloc/min_bytes"]
    if name == "split":   # whole Critic weights to ranks 0-1
        assert h["realloc/bytes"] > 0


def test_sharded_training_resumes_bit_exact(tmp_path):
    """A checkpoint holds each rank's DTensor shards and optimizer state (a tp=2 Actor and a
    ZeRO-3 Critic on 2 ranks); resumed after iteration 2, the run equals the uninterrupted
    one bit for bit."""
    from test_loop import merged

    path = _plan_file(tmp_path, world=2, actor_train=(0, 2, 1, 2, 1),
                      critic_train=(0, 2, 2, 1, 1, 3))
    cfg = tiny(2, micro_batches=2, placement=PlacementSection(plan=path))
    whole = run(cfg)
    run(cfg, out_dir=tmp_path / "out", checkpoint_every=1, stop_after=2)
    resumed = run(cfg, out_dir=tmp_path / "out", checkpoint_every=1, resume=True)
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2]
    sa, sb = merged(resumed), merged(whole)
    assert sa.keys() == sb.keys()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) == 0.0
    assert resumed["history"][2]["objective/scores"] == whole["history"][2]["objective/scores"]


def test_data_parallel_replicas_save_one_copy_and_resume_bit_exact(tmp_path):
    """Whole data-parallel copies of the Actor and Critic on 2 ranks hold equal weights and
    optimizer state: rank 1's checkpoint file refers to rank 0's instead of repeating them,
    and the run resumed from it equals the uninterrupted one bit for bit."""
    import torch
    from test_loop import merged

    from rlhf_fusion.loop.checkpoint import checkpoint_dir

    cfg = tiny(2, micro_batches=2, placement=PlacementSection(plan=_plan_file(tmp_path, world=2)))
    whole = run(cfg)
    out = tmp_path / "out"
    run(cfg, out_dir=out, checkpoint_every=1, stop_after=2)
    folder = checkpoint_dir(out, 2)
    marker = json.loads((folder / "COMPLETE").read_text())
    assert marker["same_as"] == {"1": {"actor": 0, "critic": 0}}
    ck1 = torch.load(folder / "rank1.pt", weights_only=False)
    assert ck1["models"] == {} and ck1["optimizers"] == {}
    ck0 = torch.load(folder / "rank0.pt", weights_only=False)
    assert sorted(ck0["models"]) == ["actor", "critic"]
    assert (folder / "rank1.pt").stat().st_size * 20 < (folder / "rank0.pt").stat().st_size
    resumed = run(cfg, out_dir=out, checkpoint_every=1, resume=True)
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2]
    sa, sb = merged(resumed), merged(whole)
    assert sa.keys() == sb.keys()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) == 0.0
    assert resumed["history"][2]["objective/scores"] == whole["history"][2]["objective/scores"]


def test_two_rank_disaggregated_generates_on_one_instance():
    base = run(tiny(2, inter=False, pipeline_stages=2, micro_batches=2))
    res = run(tiny(2, micro_batches=2, placement=PlacementSection(preset="disaggregated")))
    assert_same_run(base, res)


def _ref_bytes() -> int:
    """The tiny Ref as scored (float64): what one rank holding it prefetches per iteration."""
    from rlhf_fusion.loop.models import build_models

    ref = build_models(tiny(WORLD).models).ref
    return 8 * sum(t.numel() for t in [*ref.parameters(), *ref.buffers()])


def test_preset_with_offload_equals_colocated(colocated):
    """placement: {preset: interleaved, offload: true}: the Ref (ranks 0-1) lives in host
    memory between its calls (the rule reward has no weights); the same run."""
    res = run(tiny(WORLD, micro_batches=MICRO,
                   placement=PlacementSection(preset="interleaved", offload=True)))
    assert_same_run(colocated, res)
    assert all(h["offload/bytes"] == 2 * _ref_bytes() for h in res["history"])


def test_a_plans_offload_is_honoured(colocated, tmp_path):
    path = _plan_file(tmp_path, offload=("ref", "reward"))
    assert tiny(WORLD, micro_batches=MICRO,
                placement=PlacementSection(plan=path, offload=False)).offloaded() == ()
    cfg = tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(plan=path))
    assert cfg.offloaded() == ("ref", "reward")
    res = run(cfg)
    assert_same_run(colocated, res)
    assert all(h["offload/bytes"] == WORLD * _ref_bytes() for h in res["history"])


def _plan_file(tmp_path, offload=(), world=WORLD, **override) -> str:
    cluster = Cluster.uniform(1, world)
    mesh = make_mesh(cluster, "main", 0, 1)
    calls = {c: CallPlacement(mesh, Layout(world, 1, 1))
             for c in ("actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train",
                       "critic_train")}
    for c, (ranks_start, n, *strategy) in override.items():
        calls[c] = CallPlacement(make_mesh(cluster, "main", 0, 1, ranks_start, n),
                                 Layout(*strategy))
    path = tmp_path / "plan.json"
    ExecutionPlan(calls, "test", tuple(offload)).save(path, cluster)
    return str(path)


@pytest.mark.parametrize("override, message", [
    ({"actor_gen": (0, 4, 2, 2, 1)}, "generation and inference on whole copies"),
    ({"ref_inf": (0, 4, 4, 1, 1, 3)}, "generation and inference on whole copies"),
    ({"ref_inf": (0, 4, 2, 1, 2)}, "whole copies"),
    ({"actor_train": (0, 2, 1, 1, 2)}, "fused Actor/Critic pipeline over every rank"),
    ({"actor_train": (0, 4, 1, 2, 2), "critic_train": (0, 4, 1, 2, 2)},
     "tensor parallelism inside the fused pipeline's stages is not executed"),
    ({"actor_train": (0, 4, 2, 2, 1, 3)}, "ZeRO-3 \\(FSDP2\\) over a call's whole mesh only"),
])
def test_unsupported_plans_are_rejected_with_the_reason(tmp_path, override, message):
    cfg = tiny(WORLD, micro_batches=MICRO,
               placement=PlacementSection(plan=_plan_file(tmp_path, **override)))
    with pytest.raises(LoopConfigError, match=message):
        resolve_run(cfg)


def test_a_tp_that_does_not_split_the_heads_is_rejected_before_start(tmp_path):
    """The tiny models have 2 key/value heads: tp=4 cannot give each rank its own."""
    path = _plan_file(tmp_path, actor_train=(0, 4, 1, 4, 1))
    with pytest.raises(LoopConfigError, match=r"actor_train tp=4\): tp=4 does not divide its "
                                              r"key/value heads \(2\)"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(plan=path)))


def test_bad_placements_are_rejected_before_start(tmp_path):
    with pytest.raises(LoopConfigError, match="unknown placement preset"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(preset="spread")))
    with pytest.raises(LoopConfigError, match="data-parallel ranks of actor_train"):
        resolve_run(tiny(WORLD, micro_batches=2, placement=PlacementSection(preset="colocated")))
    with pytest.raises(LoopConfigError, match="power of two"):
        resolve_run(tiny(6, micro_batches=4, placement=PlacementSection(preset="colocated")))
    with pytest.raises(LoopConfigError, match="remove them"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, pipeline_stages=2,
             placement=PlacementSection(preset="colocated")))
    with pytest.raises(LoopConfigError, match="one of preset, plan or search"):
        resolve_run(tiny(WORLD, micro_batches=MICRO,
             placement=PlacementSection(preset="interleaved", search=5.0)))
    with pytest.raises(LoopConfigError, match="search time in seconds"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(search=0.0)))
    with pytest.raises(LoopConfigError, match="write one with `rlhf-fusion place"):
        resolve_run(tiny(WORLD, micro_batches=MICRO,
             placement=PlacementSection(plan=str(tmp_path / "missing.json"))))
    plan = json.loads(open(_plan_file(tmp_path)).read())
    plan["cluster"]["groups"][0]["gpus_per_node"] = 8
    other = tmp_path / "eight.json"
    other.write_text(json.dumps(plan))
    with pytest.raises(LoopConfigError, match="plan for a cluster of 4 devices"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(plan=str(other))))


def test_presets_resolve_to_flexrlhf_rank_sets():
    inter = resolve("interleaved", None, WORLD)
    assert inter.calls["ref_inf"].ranks == (0, 1) and inter.calls["reward_inf"].ranks == (2, 3)
    assert inter.calls["actor_train"].ranks == (0, 1, 2, 3)
    dis = resolve("disaggregated", None, WORLD)
    assert dis.calls["actor_train"].ranks == dis.calls["critic_train"].ranks == (0, 1)
    assert all(dis.calls[c].ranks == (2, 3)
               for c in ("actor_gen", "ref_inf", "reward_inf", "critic_inf"))
    i2 = resolve("interleaved2", None, WORLD)
    assert i2.calls["actor_train"].ranks == (0, 1) and i2.calls["critic_train"].ranks == (2, 3)
    assert resolve(None, None, WORLD) is None


def test_a_search_at_start_can_profile_the_models_first(tmp_path, monkeypatch):
    """placement: {search: S, profile: true}: every network's layers are timed here first,
    the profiles are written beside the plan and are what the search's costs come from."""
    import rlhf_fusion.placement as placement
    from rlhf_fusion.loop.placement import search_plan

    seen = {}
    real = placement.search

    def spy(problem, **kw):
        seen["profiles"] = problem.profiles
        return real(problem, **kw)

    monkeypatch.setattr(placement, "search", spy)
    cfg = tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(search=0.5, profile=True))
    search_plan(cfg, 8.0, tmp_path / "plan.json")
    written = {f.stem: json.loads(f.read_text()) for f in (tmp_path / "profiles").iterdir()}
    assert set(seen["profiles"]) == set(written) >= {"actor", "critic", "ref"}
    for role, prof in written.items():
        assert prof["format"] == "rlhf-fusion-layer-profile" and prof["device"] == "cpu"
        assert seen["profiles"][role].forward == {int(k): v for k, v in prof["forward"].items()}
    assert written["ref"] == written["actor"]   # one network, measured once
    with pytest.raises(LoopConfigError, match="give placement.search"):
        resolve_run(tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(profile=True)))


def test_the_default_run_is_a_placement_too():
    """No placement section: every call on every rank, training on the fused pipeline of
    pipeline_stages stages, world_size / pipeline_stages replicas of it (a Critic with fewer
    stages runs copies inside each); one process: everything on rank 0, data parallel."""
    from rlhf_fusion.loop.placement import DATA_PARALLEL, FUSED_PIPELINE, placement_of

    lp = placement_of(tiny(WORLD, pipeline_stages=2, critic_stages=1, micro_batches=2))
    assert all(lay.ranks == (0, 1, 2, 3) for lay in lp.calls.values())
    assert lp.training_kind == FUSED_PIPELINE and lp.replicas == 2 and lp.stage_groups == 2
    assert (lp.layout("actor_train").pp, lp.layout("critic_train").pp) == (2, 1)
    assert (lp.copies("actor_train"), lp.copies("critic_train")) == (1, 2)
    assert [lp.replica(r) for r in range(WORLD)] == [0, 0, 1, 1]
    assert lp.streamed_inference and lp.groups() == []   # the default group serves all
    one = placement_of(tiny(1, inter=False, intra=False))
    assert one.training_kind == DATA_PARALLEL and one.replicas == 1
    assert all(lay.ranks == (0,) for lay in one.calls.values())
    assert one.trains(0) == ("actor", "critic") and one.leads("critic", 0)


def test_micro_batches_is_checked_in_one_place_with_one_meaning():
    """ppo.micro_batches is per training replica: the default's replicas each take that many
    of a mini-batch (8 samples here), what runs inside a replica shares them."""
    from rlhf_fusion.loop.placement import check_micro_batches, placement_of

    # 2 replicas x 8 micro-batches do not fit a mini-batch of 8 samples ...
    with pytest.raises(LoopConfigError, match="8 micro-batches x 2 data-parallel replicas"):
        resolve_run(tiny(WORLD, pipeline_stages=2, micro_batches=8))
    # ... 2 Critic copies in each replica cannot share 1 micro-batch ...
    with pytest.raises(LoopConfigError, match="2 data-parallel ranks of critic_train"):
        resolve_run(tiny(WORLD, pipeline_stages=2, critic_stages=1, micro_batches=1))
    # ... and a placement is one replica whose training calls' ranks share them.
    cfg = tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(preset="interleaved2"))
    lp = placement_of(cfg)
    assert lp.replicas == 1 and lp.copies("actor_train") == 2
    bad = tiny(WORLD, micro_batches=1).ppo
    with pytest.raises(LoopConfigError, match="2 data-parallel ranks of actor_train"):
        check_micro_batches(bad, 16, lp)


def test_a_training_layout_the_worker_does_not_run_is_refused():
    """A layout kind is a value of the placement: one the worker has no branch for is
    refused by name, before any step."""
    import dataclasses

    from rlhf_fusion.loop import PPOWorker
    from rlhf_fusion.loop.placement import placement_of

    cfg = tiny(1, inter=False, intra=False)
    lp = placement_of(cfg)
    calls = {**lp.calls, "actor_train": dataclasses.replace(lp.calls["actor_train"],
                                                             kind="expert_parallel")}
    with pytest.raises(ValueError, match="training layout 'expert_parallel'"):
        PPOWorker(cfg, placement=dataclasses.replace(lp, calls=calls))


def test_a_plans_pipeline_runs_its_own_stage_count(colocated, tmp_path):
    """A plan with Actor and Critic training on every rank as dp=2 x pp=2: the fused pipeline
    of 2 stages per model, the 2 copies of each sharing the one replica's micro-batches;
    the same run as the co-located 4-stage pipeline."""
    from rlhf_fusion.loop.placement import placement_of

    path = _plan_file(tmp_path, actor_train=(0, 4, 2, 1, 2), critic_train=(0, 4, 2, 1, 2))
    cfg = tiny(WORLD, micro_batches=MICRO, placement=PlacementSection(plan=path))
    lp = placement_of(cfg)
    assert lp.fused_training and lp.stage_groups == WORLD and lp.replicas == 1
    assert lp.layout("actor_train").pp == 2 and lp.copies("actor_train") == 2
    assert_same_run(colocated, run(cfg))
