"""Placement and plan search with two or three models (issue 37): Actor + Ref, with or without
a reward model, no Critic. The graph, presets, estimator, search, plan files, the verl mapping
and ``rlhf-fusion place`` take the models a run has; missing required models are refused
with the fix."""

from __future__ import annotations

import json

import pytest

from rlhf_fusion.placement import (
    CALLS,
    PRESET_NAMES,
    Estimator,
    ExecutionPlan,
    PlacementError,
    PlacementProblem,
    build_graph,
    enumerate_best,
    preset_plan,
    search,
)
from rlhf_fusion.placement.verl_config import verl_config

CRITIC_FREE = ("actor_gen", "ref_inf", "reward_inf", "actor_train")
ACTOR_REF = ("actor_gen", "ref_inf", "actor_train")


def problem(models: dict, **kw) -> PlacementProblem:
    cfg = {"models": models, "cluster": {"nodes": 1, "gpus_per_node": 2}, "batch": 64,
           "prompt_len": 256, "gen_len": 256}
    cfg.update(kw)
    return PlacementProblem.from_dict(cfg)


def test_graph_of_the_models_present():
    g = build_graph(2, models=("actor", "ref", "reward"))
    assert g.calls == CRITIC_FREE and len(g.nodes) == 8
    names = {(g.nodes[a].name, g.nodes[b].name, k) for a, b, k in g.edges}
    assert ("actor_gen@0", "reward_inf@0", "data") in names
    assert ("reward_inf@1", "actor_train@1", "data") in names
    assert ("actor_train@0", "actor_gen@1", "param") in names
    assert not any("critic" in a or "critic" in b for a, b, _ in names)
    assert len(g.edges) == 2 * 5 + 1   # 5 data edges per iteration, 1 parameter edge
    assert build_graph(1, models=("actor", "ref")).calls == ACTOR_REF
    with pytest.raises(PlacementError, match=r"\['ref'\] missing"):
        build_graph(2, models=("actor", "critic"))


@pytest.mark.parametrize("models, calls", [
    ({"actor": "1b", "critic": None}, CRITIC_FREE),
    ({"actor": "1b", "critic": None, "reward": None}, ACTOR_REF),
], ids=["actor+ref+reward", "actor+ref"])
def test_search_finds_the_enumerated_optimum_without_a_critic(tmp_path, models, calls):
    p = problem(models, fusion={"rollout": True, "train": True})
    assert p.calls == calls and "critic" not in p.models
    best, best_est, n = enumerate_best(p)
    assert n < 1000 and set(best.calls) == set(calls)
    r = search(p, time_limit=1.0, seed=1)
    assert r.plan.call_names == calls
    assert r.estimate.cost == pytest.approx(best_est.cost, rel=1e-9)
    assert r.estimate.cost <= r.heuristic_estimate.cost and not r.estimate.oom
    path = tmp_path / "plan.json"
    r.plan.save(path, p.cluster)
    assert sorted(json.loads(path.read_text())["calls"]) == sorted(calls)
    back = ExecutionPlan.load(path, p.cluster)
    assert back.key() == r.plan.key()
    assert Estimator(p).estimate(back).cost == pytest.approx(r.estimate.cost)


def test_estimator_costs_a_critic_free_plan_as_ppo_without_the_critic_calls():
    """Co-located on one mesh every call runs in turn: dropping the Critic removes exactly
    its two calls' time and its training state from every GPU; the shared calls cost the
    same."""
    ppo = problem({"actor": "1b", "critic": "1b"})
    free = problem({"actor": "1b", "critic": None, "reward": "1b"})
    e_ppo, e_free = Estimator(ppo), Estimator(free)
    a = e_ppo.estimate(preset_plan(ppo, "colocated", estimator=e_ppo))
    b = e_free.estimate(preset_plan(free, "colocated", estimator=e_free))
    assert set(b.call_time) == set(CRITIC_FREE)
    assert not any("critic" in n.name for n in b.timeline.nodes)
    for k in CRITIC_FREE:
        assert b.call_time[k] == pytest.approx(a.call_time[k], rel=1e-12), k
    critic = a.call_time["critic_inf"] + a.call_time["critic_train"]
    assert critic > 0
    assert b.iteration_time == pytest.approx(a.iteration_time - critic, rel=1e-9)
    s = preset_plan(ppo, "colocated").calls["critic_train"].strategy
    gap = e_ppo.cost.static_bytes("critic", s, True)
    assert max(b.memory.values()) == pytest.approx(max(a.memory.values()) - gap, rel=1e-9)


def test_presets_without_a_critic():
    p = problem({"actor": "1b", "critic": None},
                cluster={"nodes": 1, "gpus_per_node": 8})
    for name in PRESET_NAMES:
        plan = preset_plan(p, name)
        assert plan.call_names == CRITIC_FREE, name
        assert not Estimator(p).estimate(plan).oom
    # interleaved2: the Actor with the Ref on one half, the reward model on the other
    i2 = preset_plan(p, "interleaved2").calls
    assert i2["actor_train"].mesh.ranks == i2["ref_inf"].mesh.ranks == (0, 1, 2, 3)
    assert i2["reward_inf"].mesh.ranks == (4, 5, 6, 7)
    off = preset_plan(problem({"actor": "1b", "critic": None, "reward": None},
                              offload_frozen=True), "colocated")
    assert off.offload == ("ref",)   # no reward model to offload


def test_missing_required_models_name_the_fix():
    with pytest.raises(PlacementError, match="every run has a Ref"):
        problem({"actor": "1b", "ref": None})
    with pytest.raises(PlacementError, match="models.actor is required"):
        problem({"actor": None, "critic": "1b"})
    p = problem({"actor": "1b"})
    shapes = dict(p.models)
    del shapes["ref"]
    with pytest.raises(PlacementError, match=r"\['ref'\] missing; every run has an actor and "
                                             "a ref"):
        PlacementProblem(models=shapes, cluster=p.cluster)
    calls = dict(preset_plan(p, "colocated").calls)
    del calls["critic_train"]
    with pytest.raises(PlacementError, match=r"no placement for \['critic_train'\]"):
        ExecutionPlan(calls)
    del calls["actor_train"]
    with pytest.raises(PlacementError, match=r"no placement for \['actor_train', "
                                             r"'critic_train'\]"):
        ExecutionPlan(calls)
    with pytest.raises(PlacementError, match="the plan has no such model"):
        ExecutionPlan({c: pl for c, pl in preset_plan(p, "colocated").calls.items()
                       if "critic" not in c and "reward" not in c}, offload=("reward",))
    # A PPO plan for a critic-free problem, and the other way round.
    free = problem({"actor": "1b", "critic": None})
    with pytest.raises(PlacementError, match="plan for the same models"):
        Estimator(free).estimate(preset_plan(p, "colocated"))
    with pytest.raises(PlacementError, match="plan for the same models"):
        Estimator(p).estimate(preset_plan(free, "colocated"))
    d = preset_plan(free, "colocated").to_dict(free.cluster)
    del d["calls"]["ref_inf"]
    with pytest.raises(PlacementError, match=r"\['ref'\] missing"):
        ExecutionPlan.from_dict(d, free.cluster)


def test_verl_mapping_of_a_critic_free_plan():
    p = problem({"actor": "1b", "critic": None}, cluster={"nodes": 2, "gpus_per_node": 8})
    cfg = verl_config(preset_plan(p, "interleaved2"))
    assert "critic" not in cfg.mapping and "critic_pool" not in cfg.pools
    assert cfg.mapping["reward"] in ("global_pool", "reward_pool")
    cfg = verl_config(preset_plan(problem({"actor": "1b", "critic": None, "reward": None}),
                                  "colocated"))
    assert "reward" not in cfg.mapping and "critic" not in cfg.mapping


def test_planned_models_of_a_train_config():
    from rlhf_fusion.loop import RLHFConfig
    from rlhf_fusion.loop.algorithm_config import algorithm_from
    from rlhf_fusion.loop.placement import placement_problem, planned_models

    assert planned_models(RLHFConfig()) == ("actor", "critic", "ref", "reward")
    for algo in ("grpo", "rloo", "reinforce_pp"):
        assert planned_models(RLHFConfig.from_dict({"algorithm": algo})) == (
            "actor", "ref", "reward")
    cfg = RLHFConfig()
    cfg.models.actor = {"family": "llama", "layers": 2, "hidden": 32}
    assert placement_problem(cfg, 12.0).calls == CALLS
    cfg.algorithm = algorithm_from("grpo")
    free = placement_problem(cfg, 12.0)
    assert free.calls == CRITIC_FREE and free.prompt_len == 12
    assert search(free, time_limit=0.5, seed=0).plan.call_names == CRITIC_FREE


def test_cli_place_a_critic_free_problem(tmp_path, capsys):
    from rlhf_fusion.cli import main

    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("models: {actor: 1b, critic: null, reward: 1b}\n"
                   "cluster: {nodes: 1, gpus_per_node: 2}\n"
                   "batch: 64\nprompt_len: 256\ngen_len: 256\n")
    out = tmp_path / "out"
    assert main(["place", str(cfg), "--out", str(out), "--time-limit", "0.5", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "a placement problem" in captured.err
    table = captured.out.split("\n", 1)[1].split("estimated iteration time")[0]
    assert "actor_train" in table and "critic" not in table
    d = json.loads((out / "plan.json").read_text())
    assert sorted(d["calls"]) == sorted(CRITIC_FREE)
    assert main(["place", str(cfg), "--out", str(out), "--preset", "disaggregated"]) == 0


def test_the_loop_refuses_a_plan_for_other_models(tmp_path):
    """A critic-free plan under a PPO train config (and the reverse) fails before any process
    starts, naming both call sets."""
    from rlhf_fusion.loop import LoopConfigError, PlacementSection, RLHFConfig
    from rlhf_fusion.loop.algorithm_config import algorithm_from
    from rlhf_fusion.loop.placement import placement_of

    free = problem({"actor": "1b", "critic": None})
    path = tmp_path / "grpo-plan.json"
    preset_plan(free, "interleaved").save(path, free.cluster)
    cfg = RLHFConfig(placement=PlacementSection(plan=str(path)), world_size=2)
    with pytest.raises(LoopConfigError, match=r"places \['actor_gen', 'actor_train', "
                                              r"'ref_inf', 'reward_inf'\] but this run has "
                                              r"the calls \['actor_gen', 'ref_inf', "
                                              r"'reward_inf', 'critic_inf'"):
        placement_of(cfg)
    cfg.algorithm = algorithm_from("grpo")
    lp = placement_of(cfg)
    assert set(lp.calls) == set(CRITIC_FREE)
    ppo = problem({"actor": "1b"})
    preset_plan(ppo, "interleaved").save(path, ppo.cluster)
    with pytest.raises(LoopConfigError, match="search a plan for this config"):
        placement_of(cfg)
