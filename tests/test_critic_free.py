"""Critic-free algorithms on the loop's one worker (PPOWorker, with the pure functions of
rlhf_fusion.loop.critic_free): the batch's group advantages equal the algorithms' batch
functions whatever order the samples were scored in; micro-batch losses sum to the
mini-batch's; no Critic is built, placed or checkpointed; GRPO on 2 ranks, fused and serial,
equals one process (the same tokens and rewards, the same parameters); a placement preset and
a searched plan for Actor + Ref + reward model run; a resumed run equals an uninterrupted one;
rlhf-fusion train and the GRPO demo run through loop/run.py."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_fusion.algorithms import clipped_policy_loss, grpo_advantages, rloo_advantages
from rlhf_fusion.loop.algorithm_config import AlgorithmConfig
from rlhf_fusion.loop.arithmetic import arithmetic_prompts
from rlhf_fusion.loop.config import (
    FusionLoopConfig,
    GenerationConfig,
    ModelsConfig,
    PPOLoopConfig,
    RLHFConfig,
)
from rlhf_fusion.loop.critic_free import _split, critic_free_batch, policy_loss_fn
from rlhf_fusion.loop.errors import LoopConfigError
from rlhf_fusion.loop.iteration import PPOWorker
from rlhf_fusion.loop.run import train
from rlhf_fusion.rollout.inference import Experience


def config(*, world: int = 1, inter: bool = False, iterations: int = 2, **algo) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 32},
                            tokenizer="arithmetic", reward="arithmetic"),
        generation=GenerationConfig(prompts_per_iteration=4, max_new_tokens=12, bs_max=32),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=2, micro_batches=2,
                          learning_rate=3e-3),
        fusion=FusionLoopConfig(inter=inter, intra=False, rt=0.25, mechanism="kv",
                                timeout_s=60.0),
        world_size=world, iterations=iterations,
        algorithm=AlgorithmConfig(**{"name": "grpo", "n": 4, **algo}))


def experiences(seed: int, prompts: int = 3, n: int = 4) -> list[Experience]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for sid in range(prompts * n):
        g = int(torch.randint(1, 7, (1,), generator=gen))
        lp = -torch.rand(g, generator=gen, dtype=torch.float64)
        out.append(Experience(sid, (3, 4), tuple(range(2, 2 + g)), "stop", lp,
                              lp + 0.1 * torch.randn(g, generator=gen, dtype=torch.float64),
                              torch.zeros(g, dtype=torch.float64),
                              float(torch.randint(0, 2, (1,), generator=gen))))
    return out


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_batch_advantages_are_the_batch_functions_in_any_scoring_order(name):
    exps = experiences(0)
    algo = config(name=name).algorithm.resolved(config().ppo)
    batch, metrics = critic_free_batch(exps, algo, kl_coef=0.0, pad_id=0)
    order = [e.sample_id for e in exps]
    random.Random(1).shuffle(order)
    again, _ = critic_free_batch(list(reversed(exps)), algo, kl_coef=0.0, pad_id=0, order=order)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    scores = torch.tensor([e.reward for e in exps], dtype=torch.float64)
    index = torch.tensor([e.sample_id // 4 for e in exps])
    mask = torch.ones(len(exps), 1)
    fn = grpo_advantages if name == "grpo" else rloo_advantages
    want = fn(scores, index, mask)[0][:, 0].float()
    got = torch.stack([batch["advantages"][i][batch["action_mask"][i].bool()][0]
                       for i in range(len(exps))])
    assert torch.equal(got, want)
    assert metrics["objective/scores"] == pytest.approx(float(scores.mean()))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_losses_sum_to_the_mini_batchs(mode):
    exps = experiences(1)
    algo = config(loss_agg_mode=mode, use_kl_loss=True).algorithm.resolved(config().ppo)
    batch, _ = critic_free_batch(exps, algo, kl_coef=0.0, pad_id=0)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(*batch["input_ids"].shape, 16, generator=gen, dtype=torch.float64)
    fn = policy_loss_fn(algo, kl_loss_coef=0.01, horizon=12)
    act = batch["action_mask"].bool()
    tokens, seqs = float(act.sum()), float((act.sum(-1) > 0).sum())
    whole, _ = fn(logits, batch, tokens, seqs)
    parts = _split({**batch, "logits": logits}, 3)
    summed = sum(fn(p.pop("logits"), p, tokens, seqs)[0] for p in parts)
    assert float(summed) == pytest.approx(float(whole), rel=1e-12)
    # and it is the algorithms' loss on the whole batch
    from rlhf_fusion.runtime.ppo import logprobs_from_logits

    lp = logprobs_from_logits(logits, batch["input_ids"]).to(torch.float64)
    ref, _ = clipped_policy_loss(lp, batch["old_logprobs"].double(), batch["advantages"].double(),
                                 batch["action_mask"], loss_agg_mode=mode,
                                 ref_logprobs=batch["ref_logprobs"].double(), kl_loss_coef=0.01,
                                 kl_loss_type="low_var_kl", horizon=12)
    assert float(whole) == pytest.approx(float(ref), rel=1e-12)


def test_no_critic_is_built_placed_or_trained_and_a_pipeline_is_refused():
    w = PPOWorker(config())
    assert w.models.critic is None and w.roles == ("actor",)
    assert "critic_inf" not in w.placement.calls and "critic_train" not in w.placement.calls
    assert all(k.startswith("actor.") for k in w.canonical_state())
    assert not any("critic" in type(m).__name__.lower() for m in w.models.actor.modules())
    cfg = config(world=2)
    cfg.fusion.pipeline_stages = 2
    with pytest.raises(LoopConfigError, match="^fusion.pipeline_stages: 2, but algorithm.name "
                                              "grpo trains the Actor alone"):
        train(cfg, arithmetic_prompts())


def _tokens(out):
    return [[(e.sample_id, tuple(e.response_ids), e.reward) for e in it]
            for it in out["experience_log"]]


def _run(cfg, **kw):
    return train(cfg, arithmetic_prompts(), progress=False, keep_experiences=True, **kw)


def test_grpo_fused_equals_serial_equals_one_process():
    one = _run(config())
    fused = _run(config(world=2, inter=True))
    serial = _run(config(world=2, inter=False))
    assert _tokens(fused) == _tokens(serial) == _tokens(one)
    assert fused["history"][0]["fusion/rt"] == 4 and one["history"][0]["fusion/rt"] == 0
    # the simulator's bound for the batch's own lengths and fitted timings, groups included
    assert all(h["fusion/simulated_speedup"] > 0 for h in fused["history"])
    for out in (fused, serial):
        # data parallel: rank 0 saves the Actor, rank 1 holds a copy
        assert out["states"][1] == {}
        state = out["states"][0]
        assert set(state) == set(one["states"][0])
        # one micro-batch per rank: the summed gradient is one device's, bit for bit
        assert all(torch.equal(state[k], one["states"][0][k]) for k in state)


def test_a_searched_plan_for_actor_ref_and_reward_model_trains(tmp_path):
    """The bar: a plan search over Actor + Ref + reward model finds a plan and the loop runs
    it (2 ranks); the preset runs too, each giving the tokens and rewards of one process."""
    def with_reward_model(**kw):
        cfg = config(iterations=1, **kw)
        cfg.models.reward = {"family": "llama", "layers": 1, "hidden": 32}
        return cfg

    one = _run(with_reward_model())
    searched = with_reward_model(world=2)
    searched.placement.search = 2.0
    got = _run(searched, out_dir=tmp_path / "searched")
    plan = (tmp_path / "searched" / "plan.json").read_text()
    assert "critic" not in plan and "reward_inf" in plan
    preset = with_reward_model(world=2)
    preset.placement.preset = "disaggregated"
    placed = _run(preset)
    assert _tokens(got) == _tokens(placed) == _tokens(one)
    assert got["history"][0]["objective/scores"] == one["history"][0]["objective/scores"]


def test_a_resumed_grpo_run_equals_an_uninterrupted_one(tmp_path):
    cfg = config(iterations=3, use_kl_loss=True, kl_ctrl="adaptive", target_kl=0.01)
    whole = _run(cfg)
    _run(cfg, out_dir=tmp_path, checkpoint_every=1, stop_after=2)
    ck = torch.load(tmp_path / "checkpoints" / "iter_00002" / "rank0.pt", weights_only=False)
    assert set(ck["models"]) == {"actor"} and "kl_ctrl" in ck
    again = _run(cfg, out_dir=tmp_path, resume=True)
    assert [h["objective/kl_coef"] for h in again["history"]] == \
        [h["objective/kl_coef"] for h in whole["history"]]
    assert all(torch.equal(again["states"][0][k], v) for k, v in whole["states"][0].items())


def test_the_grpo_demo_runs_and_reports(tmp_path, monkeypatch, capsys):
    from rlhf_fusion import cli
    from rlhf_fusion.loop import demo_grpo

    assert cli.main(["demo", "--algo", "grpo", "--compare", "--serial"]) == 2
    assert "--compare runs both modes" in capsys.readouterr().err
    real = demo_grpo.grpo_demo_config

    def tiny(*, iterations: int, serial: bool, balance_scoring: bool = False):
        cfg = real(iterations=iterations, serial=serial, world_size=1,
                   balance_scoring=balance_scoring)
        cfg.generation.prompts_per_iteration, cfg.generation.max_new_tokens = 4, 8
        cfg.fusion.inter = False
        return cfg

    monkeypatch.setattr(demo_grpo, "grpo_demo_config", tiny)
    s = demo_grpo.run_grpo_demo(tmp_path, iterations=2)
    assert s["iterations"] == 2 and s["samples"] == 2 * 4 * 8
    assert 0.0 <= s["correct_last"] <= 1.0
    for name in ("metrics.jsonl", "reward.png", "summary.json", "config.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert "reward: first 2 iterations" in capsys.readouterr().out
    c = demo_grpo.compare_grpo(tmp_path, pairs=1, iterations=1)
    assert c["rewards_equal"] and len(c["pairs"]) == 1
    assert c["baseline"] == "balanced" and {"fused", "serial", "balanced"} <= set(c["pairs"][0])


def test_rlhf_fusion_train_runs_a_grpo_config(tmp_path):
    import json

    import yaml

    from rlhf_fusion import cli

    data = {"world_size": 1, "iterations": 1,
            "algorithm": {"name": "grpo", "n": 2, "use_kl_loss": True},
            "models": {"actor": {"family": "llama", "layers": 2, "hidden": 32},
                       "tokenizer": "arithmetic", "reward": {
                           "function": "rlhf_fusion.loop.arithmetic:correctness_reward"}},
            "generation": {"prompts_per_iteration": 2, "max_new_tokens": 6},
            "ppo": {"num_ppo_epochs": 1, "num_mini_batches": 1, "micro_batches": 1},
            "fusion": {"inter": False, "intra": False}}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert cli.main(["train", str(path), "--out", str(out), "--checkpoint-every", "1"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["samples"] == 4 and "loss/value_avg" not in rows[0]
    assert (out / "checkpoints" / "iter_00001" / "COMPLETE").exists()


def _plan(tmp_path, actor_train, **ranks) -> str:
    """A 2-rank plan: every call data parallel on both ranks, ``actor_train``'s strategy as
    given, and the calls in ``ranks`` on one rank alone (``ref_inf=0``)."""
    from rlhf_fusion.placement import Cluster, make_mesh
    from rlhf_fusion.placement.layout import Layout
    from rlhf_fusion.placement.plan import CallPlacement, ExecutionPlan

    cluster = Cluster.uniform(1, 2)
    every = make_mesh(cluster, "main", 0, 1)
    calls = {c: CallPlacement(every, Layout(2, 1, 1)) for c in ("actor_gen", "ref_inf",
                                                                 "reward_inf")}
    calls["actor_train"] = CallPlacement(every, Layout(*actor_train))
    for c, r in ranks.items():
        calls[c] = CallPlacement(make_mesh(cluster, "main", 0, 1, r, 1), Layout(1, 1, 1))
    path = tmp_path / "plan.json"
    ExecutionPlan(calls, "test", ()).save(path, cluster)
    return str(path)


@pytest.mark.parametrize("actor_train, kind", [
    ((1, 2, 1), "tensor_parallel"),
    pytest.param((2, 1, 1, 3), "zero3", marks=pytest.mark.slow)])
def test_sharded_actor_only_training_equals_one_process(tmp_path, actor_train, kind):
    """A tensor-parallel or ZeRO-3 Actor with no Critic beside it: the same samples as one
    process and its parameters within float32 rounding (the shards' sums are ordered
    otherwise)."""
    from rlhf_fusion.loop.resolve import resolve_run

    one = _run(config(iterations=1))
    cfg = config(world=2, iterations=1)
    cfg.placement.plan = _plan(tmp_path, actor_train)
    assert resolve_run(cfg).placement.training_kinds() == (kind,)
    got = _run(cfg)
    assert _tokens(got) == _tokens(one)
    state = {k: v for s in got["states"] for k, v in s.items()}
    assert set(state) == set(one["states"][0])
    assert max(float((state[k] - v).abs().max()) for k, v in one["states"][0].items()) < 1e-5


def test_ref_and_reward_on_their_own_ranks_score_from_the_call_queues(tmp_path):
    """Ref on rank 0, the reward on rank 1, generation on both: each finished sample is
    queued to both calls and scored while generation goes on; the same samples, rewards and
    parameters as one process."""
    one = _run(config(iterations=1))
    cfg = config(world=2, iterations=1)
    cfg.placement.plan = _plan(tmp_path, (2, 1, 1), ref_inf=0, reward_inf=1)
    got = _run(cfg)
    assert _tokens(got) == _tokens(one)
    assert all(torch.equal(got["states"][0][k], v) for k, v in one["states"][0].items())
