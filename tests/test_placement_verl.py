"""``rlhf-fusion plan --verl``: a plan as verl's resource pools and main_ppo overrides."""

from __future__ import annotations

from rlhf_fusion.placement import PlacementProblem
from rlhf_fusion.placement.presets import preset_plan
from rlhf_fusion.placement.verl_config import verl_config


def problem(nodes: int = 2, gpn: int = 8) -> PlacementProblem:
    return PlacementProblem.from_dict({
        "models": {"actor": "1b", "critic": "1b"},
        "cluster": {"nodes": nodes, "gpus_per_node": gpn}, "batch": 64, "prompt_len": 256,
        "gen_len": 256})


def test_colocated_is_verl_default_placement():
    cfg = verl_config(preset_plan(problem(), "colocated"))
    assert cfg.pools == {"global_pool": [8, 8]}
    assert set(cfg.mapping.values()) == {"global_pool"}
    assert "trainer.nnodes=2" in cfg.overrides and "trainer.n_gpus_per_node=8" in cfg.overrides
    assert not any("critic_pool" in o or "reward_pool" in o for o in cfg.overrides)


def test_disjoint_actor_and_critic_get_pools_and_the_overlap_mode():
    """interleaved2: Actor and Critic train on disjoint halves (Ref with the Actor, the reward
    model with the Critic): the Critic gets rlhf-fusion's critic_pool and the overlap trainer
    mode; verl cannot share a pool between the Critic and the reward model, so the reward model
    stays with the Actor, noted. The pools never ask for more GPUs than the cluster has."""
    plan = preset_plan(problem(), "interleaved2")
    cfg = verl_config(plan)
    actor, critic = plan.calls["actor_train"].mesh, plan.calls["critic_train"].mesh
    assert cfg.pools["global_pool"] == [actor.n_gpus] * actor.n_nodes
    assert cfg.pools["critic_pool"] == [critic.n_gpus] * critic.n_nodes
    assert sum(sum(v) for v in cfg.pools.values()) == 16
    assert cfg.mapping["critic"] == "critic_pool"
    assert "trainer.v1.trainer_mode=rlhf_fusion_sync" in cfg.overrides
    assert f"+rlhf_fusion.critic_pool.n_gpus_per_node={critic.n_gpus}" in cfg.overrides
    assert cfg.mapping["reward"] == "global_pool" and "reward_pool" not in cfg.pools
    assert any(n.startswith("reward_inf on") for n in cfg.notes)


def test_reward_model_on_its_own_gpus_gets_reward_pool():
    """interleaved: Ref and reward model on disjoint halves, Actor and Critic on all GPUs:
    the reward model gets GPUs verl's way only if they are not the Actor's; here they are."""
    plan = preset_plan(problem(), "interleaved")
    cfg = verl_config(plan)
    assert cfg.pools == {"global_pool": [8, 8]}
    assert cfg.mapping["reward"] == "global_pool" and cfg.mapping["critic"] == "global_pool"


def test_what_verl_cannot_place_is_noted():
    """disaggregated: generation and inference away from training; verl generates on the
    training GPUs in its sync modes and runs the Ref with the Actor, which the notes say."""
    plan = preset_plan(problem(), "disaggregated")
    cfg = verl_config(plan)
    text = cfg.text()
    # the reward model's GPUs are none of the Actor's or Critic's: verl's own reward_pool
    reward = plan.calls["reward_inf"].mesh
    assert cfg.pools["reward_pool"] == [reward.n_gpus] * reward.n_nodes
    assert sum(sum(v) for v in cfg.pools.values()) == 16
    assert "reward.reward_model.enable_resource_pool=true" in cfg.overrides
    assert any(n.startswith("actor_gen on") and "separate_async" in n for n in cfg.notes)
    assert any(n.startswith("ref_inf on") for n in cfg.notes)
    assert any(n.startswith("critic_inf on") for n in cfg.notes)
    assert text.startswith("# python -m verl.trainer.main_ppo")
    assert all(f"    {o}" in text for o in cfg.overrides)


def test_cli_writes_verl_txt(tmp_path, capsys):
    import yaml

    from rlhf_fusion.cli import main

    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": {"actor": "1b", "critic": "1b"}, "cluster": {"nodes": 2, "gpus_per_node": 8},
        "batch": 64, "prompt_len": 256, "gen_len": 256}))
    out = tmp_path / "out"
    assert main(["plan", str(cfg), "--out", str(out), "--preset", "interleaved2", "--verl",
                 "--quiet"]) == 0
    text = (out / "verl.txt").read_text()
    assert "+rlhf_fusion.critic_pool.n_gpus_per_node=8" in text
    assert text in capsys.readouterr().out
    assert main(["plan", str(cfg), "--out", str(tmp_path / "plain"), "--preset", "colocated",
                 "--quiet"]) == 0
    assert not (tmp_path / "plain" / "verl.txt").exists()
