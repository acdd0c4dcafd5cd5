"""The loop's ``algorithm:`` section: the rules across sections (each field's own range is a row
of tests/test_config_validation.py's table), the aliases (verl's and TRL's names for one knob)
and the values the worker reads (:meth:`AlgorithmConfig.resolved`)."""

from __future__ import annotations

import copy

import pytest

from rlhf_fusion.loop import LoopConfigError, RLHFConfig
from rlhf_fusion.loop.algorithm_config import AlgorithmConfig, samples_per_iteration

BASE = {
    "world_size": 2,
    "iterations": 1,
    "models": {"actor": {"family": "llama", "layers": 2, "hidden": 32, "heads": 4,
                         "kv_heads": 2}},
    "generation": {"prompts_per_iteration": 8, "max_new_tokens": 8},
    "ppo": {"num_mini_batches": 2, "micro_batches": 2},
}


def cfg_with(algorithm, **sections) -> RLHFConfig:
    data = copy.deepcopy(BASE)
    data["algorithm"] = algorithm
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return RLHFConfig.from_dict(data)


def test_a_name_is_the_section_and_ppo_the_default():
    assert RLHFConfig.from_dict(BASE).algorithm == AlgorithmConfig()
    cfg = cfg_with("grpo")
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.n == 1
    cfg = cfg_with({"name": "grpo", "n": 4})
    cfg.validate()
    assert samples_per_iteration(cfg) == 32
    assert cfg.to_dict()["algorithm"]["n"] == 4


@pytest.mark.parametrize(("algorithm", "sections", "field", "message"), [
    ({"name": "ppo", "n": 4}, {}, "algorithm.n", "answers each prompt once"),
    ({"name": "ppo", "scale_rewards": "none"}, {}, "algorithm.scale_rewards",
     "with algorithm.name: ppo remove it"),
    ({"name": "ppo", "clip_ratio_high": 0.28}, {}, "algorithm.clip_ratio_high",
     "set ppo.cliprange instead"),
    ({"name": "ppo", "use_kl_loss": True}, {}, "algorithm.use_kl_loss",
     "set ppo.kl_mode: loss instead"),
    ({"name": "grpo", "n": 1}, {}, "algorithm.n", "needs n >= 2 samples per prompt"),
    ({"name": "rloo"}, {}, "algorithm.n", "needs n >= 2"),
    ({"name": "grpo", "n": 4}, {"models": {"critic": {"family": "llama", "layers": 2}}},
     "models.critic", "grpo builds no Critic"),
    ({"name": "rloo", "n": 2}, {"ppo": {"critic_learning_rate": 1e-4}},
     "ppo.critic_learning_rate", "trains no Critic"),
    ({"name": "grpo", "n": 2}, {"fusion": {"critic_stages": 1}}, "fusion.critic_stages",
     "places no Critic"),
    ({"name": "grpo", "n": 2, "use_kl_loss": True, "use_kl_in_reward": True}, {},
     "algorithm.use_kl_loss", "already in the reward"),
    ({"name": "grpo", "n": 2, "kl_ctrl": "adaptive"}, {}, "algorithm.kl_ctrl",
     "needs a KL term to adapt"),
    ({"name": "ppo", "kl_ctrl": "adaptive"}, {"ppo": {"kl_coef": 0.0}}, "algorithm.kl_ctrl",
     "give ppo.kl_coef a starting value"),
    ({"name": "grpo", "n": 3}, {"ppo": {"num_mini_batches": 16}}, "ppo.num_mini_batches",
     "does not divide the 24 samples"),
    ({"name": "grpo", "n": 2, "norm_adv_by_std_in_grpo": True, "scale_rewards": "none"}, {},
     "algorithm.norm_adv_by_std_in_grpo", "set one of them"),
    ({"name": "grpo", "n": 2, "loss_type": "dr_grpo", "loss_agg_mode": "seq-mean-token-mean"},
     {}, "algorithm.loss_type", "is loss_agg_mode seq-mean-token-sum-norm"),
    ({"name": "grpo", "n": 2, "bogus": 1}, {}, "algorithm", "unknown keys ['bogus']"),
    (["grpo"], {}, "algorithm", "expected a name"),
])
def test_rules_across_sections_name_the_field(algorithm, sections, field, message):
    with pytest.raises(LoopConfigError) as err:
        cfg_with(algorithm, **sections).validate()
    text = str(err.value)
    assert text.startswith(f"{field}: ") and message in text, text


def test_grpo_with_n_samples_divides_mini_batches_over_samples_not_prompts():
    # 8 prompts x 3 = 24 samples: 3 mini-batches of 8 samples (3 does not divide 8 prompts)
    cfg_with({"name": "grpo", "n": 3}, ppo={"num_mini_batches": 3}).validate()


def test_resolved_merges_the_aliases_and_fills_from_ppo():
    cfg = cfg_with({"name": "grpo", "n": 4, "norm_adv_by_std_in_grpo": False,
                    "loss_type": "dr_grpo", "use_kl_loss": True, "kl_loss_coef": 0.01,
                    "clip_ratio_high": 0.28},
                   ppo={"cliprange": 0.1, "num_ppo_epochs": 3})
    cfg.validate()
    r = cfg.algorithm.resolved(cfg.ppo)
    assert (r.scale_rewards, r.loss_agg_mode) == ("none", "seq-mean-token-sum-norm")
    assert (r.clip_ratio_low, r.clip_ratio_high, r.epochs) == (0.1, 0.28, 3)
    assert (r.kl_in_reward, r.kl_coef, r.kl_loss_coef) == (False, 0.0, 0.01)
    ppo = cfg_with("ppo", ppo={"kl_mode": "loss", "kl_coef": 0.05, "kl_estimator": "k3"})
    r = ppo.algorithm.resolved(ppo.ppo)
    assert (r.kl_in_reward, r.kl_coef, r.kl_loss_coef, r.kl_penalty) == (False, 0.05, 0.05, "k3")


def test_yaml_numbers_without_a_dot_are_floats(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: {name: grpo, n: 2, use_kl_loss: true, kl_loss_coef: 1e-3}\n")
    cfg = RLHFConfig.from_file(path)
    assert cfg.algorithm.kl_loss_coef == 0.001


def test_a_layout_a_critic_free_run_cannot_train_is_refused_before_any_rank(monkeypatch):
    import rlhf_fusion.launch as launch
    from rlhf_fusion.loop import train

    def started(*a, **k):
        raise AssertionError("a process started")

    monkeypatch.setattr(launch, "run_ranks", started)
    cfg = cfg_with({"name": "grpo", "n": 2}, fusion={"pipeline_stages": 2})
    with pytest.raises(LoopConfigError, match=r"^fusion.pipeline_stages: 2, but algorithm.name "
                                              "grpo trains the Actor alone"):
        train(cfg, ["hello"] * 8)
