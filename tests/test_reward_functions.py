"""Reward functions named by import path (``models.reward: {function: "pkg.mod:fn"}``), called
as TRL's ``GRPOTrainer`` calls them, several with weights; bad references refused by
``rlhf-fusion train`` before any rank starts, naming the field. And the arithmetic task."""

from __future__ import annotations

import copy
import math
import sys
import textwrap

import pytest
import yaml

from rlhf_fusion import cli
from rlhf_fusion.loop import LoopConfigError, RLHFConfig
from rlhf_fusion.loop.arithmetic import (
    ArithmeticTokenizer,
    answer_of,
    arithmetic_prompts,
    correct,
    correctness_reward,
    format_reward,
)
from rlhf_fusion.loop.models import build_models, load_tokenizer
from rlhf_fusion.loop.resolve import resolve_run
from rlhf_fusion.loop.reward_functions import RewardFunctions, resolve_reward_spec

BASE = {
    "world_size": 2,
    "iterations": 1,
    "models": {"actor": {"family": "llama", "layers": 2, "hidden": 32, "heads": 4,
                         "kv_heads": 2}},
    "generation": {"prompts_per_iteration": 8, "max_new_tokens": 8},
    "ppo": {"num_mini_batches": 2, "micro_batches": 2},
}

MODULE = "_rf_user_rewards"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module on sys.path, recording every call's keyword arguments."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        CALLS = []

        def length(prompts, completions, completion_ids, **kwargs):
            CALLS.append(("length", prompts, completions, completion_ids))
            return [float(len(ids)) for ids in completion_ids]

        def starts_with_a(prompts, completions, **kwargs):
            CALLS.append(("a", prompts, completions, kwargs["completion_ids"]))
            return [1.0 if c.startswith("a") else None for c in completions]

        def text_only(prompt, response):
            return 0.0

        async def later(prompts, completions, completion_ids, **kwargs):
            return [0.0]

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    yield __import__(MODULE)
    sys.modules.pop(MODULE, None)


def test_functions_are_called_as_trl_calls_them_and_weighted(user_module):
    rf = resolve_reward_spec({"functions": [
        {"function": f"{MODULE}:length", "weight": 0.5},
        f"{MODULE}:starts_with_a"]})
    assert rf.names == [f"{MODULE}:length", f"{MODULE}:starts_with_a"]
    assert rf.score("q", "abc", [5, 6, 7]) == 0.5 * 3 + 1.0
    # TRL's None (not applicable) adds nothing: its nansum
    assert rf.score("q", "bc", [5, 6]) == 0.5 * 2
    assert user_module.CALLS == [
        ("length", ["q"], ["abc"], [[5, 6, 7]]), ("a", ["q"], ["abc"], [[5, 6, 7]]),
        ("length", ["q"], ["bc"], [[5, 6]]), ("a", ["q"], ["bc"], [[5, 6]])]
    assert rf.score_batch(["x", "y"], ["a", "zz"], [[1], [2, 3]]) == [0.5 + 1.0, 1.0]


def test_the_config_builds_them_and_the_worker_scores_with_token_ids(user_module):
    data = copy.deepcopy(BASE)
    data["models"]["reward"] = {"function": f"{MODULE}:length", "weight": 2.0}
    cfg = RLHFConfig.from_dict(data)
    cfg.validate()
    models = build_models(cfg.models)
    assert isinstance(models.reward, RewardFunctions)
    from rlhf_fusion.loop.iteration import PPOWorker

    score = PPOWorker._reward(type("W", (), {"models": models,
                                             "tokenizer": models.tokenizer})())
    tok = models.tokenizer
    assert score(tok.encode("hi"), tok.encode("abcd")) == 8.0
    assert user_module.CALLS[-1] == ("length", ["hi"], ["abcd"], [tok.encode("abcd")])


@pytest.mark.parametrize(("reward", "field", "message"), [
    ({"function": "no_such_module_xyz:f"}, "models.reward.function", "cannot be imported"),
    ({"function": f"{MODULE}:nope"}, "models.reward.function", f"{MODULE} has no nope"),
    ({"function": f"{MODULE}.length"}, "models.reward.function", "write the import path as "
     "module:function"),
    ({"function": f"{MODULE}:NOT_A_FUNCTION"}, "models.reward.function", "not a function"),
    ({"function": f"{MODULE}:text_only"}, "models.reward.function",
     "cannot take prompts, completions, completion_ids"),
    ({"function": f"{MODULE}:later"}, "models.reward.function", "is async"),
    ({"functions": [f"{MODULE}:length", {"function": f"{MODULE}:length", "weight": "x"}]},
     "models.reward.functions[1].weight", "must be a finite number"),
    ({"functions": [f"{MODULE}:length", {"function": "zz:q"}]},
     "models.reward.functions[1].function", "cannot be imported"),
    ({"functions": []}, "models.reward.functions", "non-empty list"),
    ({"function": f"{MODULE}:length", "scale": 2}, "models.reward", "unknown keys ['scale']"),
])
def test_bad_references_fail_before_any_rank_naming_the_field(
        tmp_path, monkeypatch, capsys, user_module, reward, field, message):
    import rlhf_fusion.launch as launch
    import rlhf_fusion.loop.run as run

    def started(*a, **k):
        raise AssertionError("a process started")

    monkeypatch.setattr(launch, "run_ranks", started)
    monkeypatch.setattr(run, "rank_main", started)
    data = copy.deepcopy(BASE)
    data["models"]["reward"] = reward
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = cli.main(["train", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f" {field}: " in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_arithmetic_task():
    prompts = arithmetic_prompts()
    assert len(prompts) == len(set(prompts)) == 110   # 55 sums, 55 differences, answers 0..9
    assert all(0 <= answer_of(p) <= 9 for p in prompts)
    assert answer_of("7-3=") == 4 and answer_of("2+5=") == 7
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        answer_of("hello")
    assert [correct("2+5=", c) for c in ("7", " 7", "7+1", "72", "", "x7", "-7")] == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    tok = ArithmeticTokenizer()
    assert tok.vocab_size == 16 and tok.decode(tok.encode("3+4=")) == "3+4="
    assert correctness_reward(["2+5=", "2+5="], ["7", "8"], [[9], [10]]) == [1.0, 0.0]
    assert format_reward(["1+1="] * 3, ["2", "2 ", "12"], [[4, 1], [4, 15, 1], [3, 4, 1]]) == [
        1.0, 0.0, 1.0]


def test_arithmetic_by_name_and_by_import_path():
    data = copy.deepcopy(BASE)
    data["models"]["tokenizer"] = "arithmetic"
    data["models"]["reward"] = {"functions": [
        {"function": "rlhf_fusion.loop.arithmetic:correctness_reward", "weight": 1.0},
        {"function": "rlhf_fusion.loop.arithmetic:format_reward", "weight": 0.1}]}
    cfg = RLHFConfig.from_dict(data)
    cfg.validate()
    assert isinstance(load_tokenizer(cfg.models), ArithmeticTokenizer)
    rf = build_models(cfg.models).reward
    assert math.isclose(rf.score("3+4=", "7", [9, 1]), 1.1)
    data["models"]["reward"] = "arithmetic"
    RLHFConfig.from_dict(data).validate()
    data["models"]["reward"] = "arithmetik"
    with pytest.raises(LoopConfigError, match="not a built-in rule"):
        resolve_run(RLHFConfig.from_dict(data))   # the sources are read once, there
