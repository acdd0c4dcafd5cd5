"""Every config field refused with a bad value, up front: exit 2 from the CLI, the field named,
no process started. File-level errors are one line naming the file; errors inside the ranks
are one line with exit 1 and the traceback in OUT/error.log.

``BAD`` has a row per field of the config dataclasses (and per key of a tiny model config);
``test_the_table_covers_every_field`` fails when a field is added without a row.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import yaml

from rlhf_fusion import cli
from rlhf_fusion.loop import LoopConfigError, RLHFConfig
from rlhf_fusion.loop.models import _SOURCE_KEYS
from rlhf_fusion.loop.resolve import resolve_run

# A config that runs (2 ranks, a 2-layer Llama, 8 prompts): each row breaks one field of it.
BASE = {
    "world_size": 2,
    "iterations": 1,
    "models": {"actor": {"family": "llama", "layers": 2, "hidden": 32, "heads": 4,
                         "kv_heads": 2}},
    "generation": {"prompts_per_iteration": 8, "max_new_tokens": 8},
    "ppo": {"num_mini_batches": 2, "micro_batches": 2},
}

MISSING = "no-such-file-here"

# (field, bad value, expected text in the message). The field is what the message names.
BAD = [
    ("world_size", 0, "must be an integer >= 1, got 0"),
    ("world_size", 64, "models.actor has 2 decoder layers; use world_size <= 2"),
    ("world_size", 2.0, "must be an integer >= 1, got 2.0"),
    ("iterations", -3, "must be an integer >= 0, got -3"),
    ("iterations", "1e3", "a string: write the number without quotes"),
    ("prompts", MISSING, "does not exist"),
    ("prompts", ".", "is a directory"),
    ("models.actor", 5, "give a Hub id, a local model folder or a tiny config"),
    ("models.actor", "./no-such-model", "no such directory"),
    ("models.actor", {"family": "llama", "dropout": 0.1}, "unknown keys ['dropout']"),
    ("models.critic", "/no/such/model", "no such directory"),
    ("models.ref", ["llama"], "give a Hub id"),
    ("models.reward", "vowelz", "is not a built-in rule (vowels, arithmetic)"),
    ("models.reward", "./no-reward-model", "no such directory"),
    ("models.tokenizer", "./no-tokenizer", "no such directory"),
    ("models.tokenizer", 3, "give a Hub id or a local tokenizer folder"),
    ("models.seed", -1, "must be an integer >= 0"),
    ("models.actor.family", "bert", "unknown model family 'bert'"),
    ("models.actor.hidden", 0, "must be an integer >= 1"),
    ("models.actor.layers", 0, "must be an integer >= 1"),
    ("models.actor.heads", 3, "hidden 32 is not a multiple of heads 3"),
    ("models.actor.kv_heads", 3, "heads 4 is not a multiple of kv_heads 3"),
    ("models.actor.vocab_size", -5, "must be an integer >= 1"),
    ("models.actor.tie", "yes", "must be true or false"),
    ("models.actor.intermediate_size", 0, "must be an integer >= 1"),
    ("models.actor.max_positions", 1.5, "must be an integer >= 1"),
    ("models.actor.seed", -2, "must be an integer >= 0"),
    ("generation.prompts_per_iteration", 0, "must be an integer >= 1"),
    ("generation.max_new_tokens", "many", "must be an integer >= 1, got 'many'"),
    ("generation.temperature", 0, "must be a number > 0"),
    ("generation.seed", 1.5, "must be an integer >= 0"),
    ("generation.bs_max", 0, "must be an integer >= 1"),
    ("generation.kv_capacity_tokens", 4, "cannot hold one sample of max_new_tokens=8"),
    ("generation.backend", "tgi", "use one of reference, vllm"),
    ("generation.vllm_engine_kwargs", {"gpu_memory_utilization": 0.3},
     "only used with backend: vllm"),
    ("ppo.num_ppo_epochs", 0, "must be an integer >= 1"),
    ("ppo.num_mini_batches", 3, "does not divide generation.prompts_per_iteration=8"),
    ("ppo.micro_batches", 0, "must be an integer >= 1"),
    ("ppo.learning_rate", -1e-3, "must be a number > 0, got -0.001"),
    ("ppo.learning_rate", "fast", "must be a number > 0, got 'fast'"),
    ("ppo.critic_learning_rate", -1.0, "must be a number > 0 (or leave it unset)"),
    ("ppo.gamma", 1.5, "must be a number in [0, 1]"),
    ("ppo.lam", -0.1, "must be a number in [0, 1]"),
    ("ppo.cliprange", -0.2, "must be a number > 0"),
    ("ppo.cliprange_value", -0.2, "must be a number > 0 (or leave it unset)"),
    ("ppo.kl_coef", -0.05, "must be a number >= 0"),
    ("ppo.kl_mode", "both", "use one of reward, loss"),
    ("ppo.kl_estimator", "k4", "use one of k1, k2, k3"),
    ("ppo.whiten_advantages", "yes", "must be true or false"),
    ("ppo.max_grad_norm", -1.0, "would flip the gradients' sign"),
    ("ppo.weight_decay", -0.01, "must be a number >= 0"),
    ("fusion.inter", "on", "must be true or false"),
    ("fusion.intra", 1, "must be true or false"),
    ("fusion.rt", 100, "outside the batch of 8 samples"),
    ("fusion.rt", "half", "use 'auto', a fraction in (0, 1) or a sample count"),
    ("fusion.mechanism", "rdma", "use one of kv, tokens, auto"),
    ("fusion.pipeline_stages", 3, "3 stages need as many ranks; world_size is 2"),
    ("fusion.critic_stages", 0, "must be an integer >= 1"),
    ("fusion.solver", "magic", "use one of auto, cpsat"),
    ("fusion.solver_time_limit", 0, "must be a number > 0"),
    ("fusion.timeout_s", -5, "must be a number > 0"),
    ("fusion.balance_scoring", "yes", "must be true or false"),
    ("placement.preset", "spread", "unknown placement preset"),
    ("placement.plan", MISSING, "no file"),
    ("placement.inference_fraction", 1.5, "must be a number in (0, 1)"),
    ("placement.search", -1, "the search time in seconds"),
    ("placement.hardware", "tpu-v9", "use one of"),
    ("placement.profile", "yes", "must be true or false"),
    ("placement.offload", ["actor"], "actor is trained every iteration"),
    ("algorithm.name", "dpo", "use one of ppo, grpo, rloo, reinforce_pp"),
    ("algorithm.n", 0, "must be an integer >= 1"),
    ("algorithm.scale_rewards", "std", "use one of group, batch, none"),
    ("algorithm.norm_adv_by_std_in_grpo", "yes", "must be true or false"),
    ("algorithm.epsilon", 0, "must be a number > 0"),
    ("algorithm.loss_agg_mode", "mean", "use one of token-mean, token-sum"),
    ("algorithm.loss_type", "ppo", "use one of grpo, bnpo, dr_grpo, dapo"),
    ("algorithm.use_kl_loss", 1, "must be true or false"),
    ("algorithm.kl_loss_coef", -0.1, "must be a number >= 0"),
    ("algorithm.kl_loss_type", "k9", "use one of k1, kl, k2"),
    ("algorithm.use_kl_in_reward", "no", "must be true or false"),
    ("algorithm.kl_coef", -1, "must be a number >= 0"),
    ("algorithm.kl_penalty", "kk", "use one of k1, kl, k2"),
    ("algorithm.kl_ctrl", "pid", "use one of fixed, adaptive"),
    ("algorithm.target_kl", 0, "must be a number > 0"),
    ("algorithm.kl_horizon", 0.5, "must be an integer >= 1"),
    ("algorithm.clip_ratio_low", 1.5, "the ratio's lower bound is 1 - clip_ratio_low"),
    ("algorithm.clip_ratio_high", -0.28, "must be a number > 0"),
    ("algorithm.clip_ratio_c", 0.5, "the dual clip bounds"),
    ("algorithm.ppo_epochs", 0, "must be an integer >= 1"),
]

# Fields a whole section stands for (a wrong key inside it, or not a mapping).
BAD_SECTIONS = [
    ("ppo.lr", 1e-3, "ppo: unknown keys ['lr']"),
    ("models.actor.hiden", 64, "models.actor: unknown keys ['hiden']"),
    ("fusion", 3, "fusion: expected a mapping"),
    ("epochs", 3, "config: unknown keys ['epochs']"),
]


def config_fields() -> set[str]:
    """Every field a config file can set: the dataclasses' and a tiny model config's keys."""
    out = set()
    for f in dataclasses.fields(RLHFConfig):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(f.default_factory)}
        else:
            out.add(f.name)
    return out | {f"models.actor.{k}" for k in [*_SOURCE_KEYS, "seed"]}


def test_the_table_covers_every_field():
    assert {row[0] for row in BAD} == config_fields()


def with_value(field: str, value) -> dict:
    data = copy.deepcopy(BASE)
    *path, last = field.split(".")
    node = data
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value
    return data


@pytest.fixture
def no_processes(monkeypatch):
    """Any attempt to start the ranks fails the test (and the rank function, for one rank)."""
    import rlhf_fusion.launch as launch
    import rlhf_fusion.loop.run as run

    def started(*a, **k):
        raise AssertionError("a process started")

    monkeypatch.setattr(launch, "run_ranks", started)
    monkeypatch.setattr(run, "rank_main", started)


@pytest.mark.parametrize(("field", "value", "message"), BAD + BAD_SECTIONS,
                         ids=[f"{r[0]}={r[1]!r}" for r in BAD + BAD_SECTIONS])
def test_every_bad_field_is_refused_up_front(tmp_path, monkeypatch, capsys, no_processes,
                                             field, value, message):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(with_value(field, value)))
    rc = cli.main(["train", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf-fusion train: error: "), err
    assert message in err, err
    if (field, value, message) in BAD:
        assert f" {field}: " in err, err   # the field, named as the config file spells it
    assert not (tmp_path / "out").exists()


def test_the_console_script_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(with_value("ppo.kl_coef", -1)))
    res = subprocess.run([sys.executable, "-m", "rlhf_fusion.cli", "train", str(path),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip() == (f"rlhf-fusion train: error: {path}: ppo.kl_coef: must be a "
                                  "number >= 0, got -1")


def test_yaml_1e_minus_3_is_a_float(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("ppo: {learning_rate: 1e-3, critic_learning_rate: 5E-4}\n"
                    "fusion: {rt: 5e-1, timeout_s: 1e2}\n")
    cfg = RLHFConfig.from_file(path)
    assert cfg.ppo.learning_rate == 0.001 and cfg.ppo.critic_learning_rate == 0.0005
    assert cfg.fusion.rt == 0.5 and cfg.fusion.timeout_s == 100.0
    resolve_run(cfg)


def test_negative_numbers_from_python_are_refused_too():
    cfg = RLHFConfig.from_dict(BASE)
    cfg.ppo.max_grad_norm = -1.0
    with pytest.raises(LoopConfigError, match="ppo.max_grad_norm"):
        resolve_run(cfg)


# --------------------------------------------------------------------------------------------
# file-level errors: one line naming the file and the fix
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "name", "message"), [
    ("models:\n actor: x\n  bad: [\n", "run.yaml",
     "run.yaml: line 3, column 6: invalid YAML (mapping values are not allowed here)"),
    ('{"world_size": 2,}', "run.json", "run.json: line 1, column 18: invalid JSON"),
    ("- a\n- b\n", "run.yaml", "run.yaml: holds a list, not a mapping"),
    (None, "missing.yaml", "missing.yaml does not exist"),
    ("dir", "configs", "configs is a directory; give the config file inside it"),
])
def test_file_errors_name_the_file(tmp_path, monkeypatch, capsys, no_processes, text, name,
                                   message):
    monkeypatch.chdir(tmp_path)
    if text == "dir":
        (tmp_path / name).mkdir()
    elif text is not None:
        (tmp_path / name).write_text(text)
    assert cli.main(["train", name, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(("lines", "message"), [
    ('{"text": "hi"}\n', 'line 1: no "prompt" text field (has [\'text\'])'),
    ('{"prompt": "a"}\n\n{"prompt": \n', "line 3: not JSON"),
])
def test_jsonl_prompt_errors_name_the_line(tmp_path, monkeypatch, capsys, no_processes, lines,
                                           message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(lines)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, "prompts": "p.jsonl"}))
    assert cli.main(["train", "run.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"prompts: {tmp_path / 'p.jsonl'} {message}" in err, err


def test_a_config_without_prompts_says_it_uses_the_demos(tmp_path, monkeypatch, capsys):
    import rlhf_fusion.loop as loop

    seen = {}
    monkeypatch.setattr(loop, "train",
                        lambda cfg, prompts, **kw: seen.update(n=len(prompts)) or {})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    assert cli.main(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert f"using the demo's {seen['n']} prompts" in err and "set prompts: FILE" in err


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_demo_iterations_below_one_are_refused(capsys, value):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--iterations", value])
    assert info.value.code == 2
    assert "argument --iterations: must be" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# errors inside the ranks: one line, exit 1, the tracebacks in OUT/error.log
# --------------------------------------------------------------------------------------------


def test_a_rank_error_is_one_line_with_the_traceback_logged(tmp_path):
    """A reward model folder whose weights are truncated: its config reads (validation
    passes), loading it inside each rank fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    reward = tmp_path / "reward"
    LlamaForCausalLM(LlamaConfig(vocab_size=36, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)).save_pretrained(reward)
    weights = reward / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    data = with_value("models.reward", str(reward))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "rlhf_fusion.cli", "train",
                          str(tmp_path / "run.yaml"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr
    errors = [x for x in res.stderr.splitlines() if "rlhf-fusion train: error:" in x]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert errors[0].startswith("rlhf-fusion train: error: rank 0: ")
    assert f"(2 of 2 ranks failed) (full traceback: {out / 'error.log'})" in errors[0]
    log = (out / "error.log").read_text()
    assert log.count("Traceback") >= 3 and "--- rank 1:" in log   # the launcher's and each rank's


def test_the_cause_is_the_rank_that_failed_on_its_own():
    from rlhf_fusion.launch import DistributedRunError, RankResult

    exc = DistributedRunError([
        RankResult(0, False, error_type="PipelineTimeoutError", error="timed out\ngrid"),
        RankResult(1, False, error_type="ValueError", error="Invalid learning rate\nmore"),
        RankResult(2, True),
    ])
    assert cli._one_line(exc) == ("rank 1: ValueError: Invalid learning rate (2 of 3 ranks "
                                  "failed)")
    died = DistributedRunError([
        RankResult(0, False, error_type="RuntimeError", error="Connection closed by peer"),
        RankResult(1, False, error_type="Died", error="exit code -9")])
    assert cli._one_line(died) == "rank 1: Died: exit code -9 (2 of 2 ranks failed)"


# --------------------------------------------------------------------------------------------
# local model folders
# --------------------------------------------------------------------------------------------


def test_a_critic_from_a_causal_lm_folder_loads_without_a_load_report(tmp_path, capfd):
    """The Critic's backbone leaves the checkpoint's lm_head out on purpose: no UNEXPECTED
    table (it printed on every rank), and the backbone's weights are the checkpoint's."""
    import torch

    from rlhf_fusion.loop.models import causal_lm, value_model
    from rlhf_fusion.testing.trl import tiny_model_dir

    path = tiny_model_dir(tmp_path / "tiny")
    capfd.readouterr()
    critic = value_model(path, 36)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "UNEXPECTED" not in err and "deprecated" not in err, err
    actor = causal_lm(path, 36)
    for name, p in critic.backbone.state_dict().items():
        assert torch.equal(p, actor.model.state_dict()[name]), name
    from transformers import LlamaModel

    assert "_keys_to_ignore_on_load_unexpected" not in LlamaModel.__dict__


def test_a_folder_without_config_names_the_fix(tmp_path, monkeypatch, capsys, no_processes):
    (tmp_path / "empty").mkdir()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(with_value("models.critic", "./empty")))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"models.critic: {tmp_path / 'empty'} holds no config.json; make one with " \
           "save_pretrained" in err, err


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------


def test_version_and_plain_help(capsys):
    from rlhf_fusion import __version__

    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"rlhf-fusion {__version__}"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "rlhf-fusion" in out


def test_every_option_has_help():
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items()
               for a in p._actions if not a.help and not isinstance(a, argparse._HelpAction)]
    assert missing == []
    assert all(p.description for p in sub.choices.values())
    assert "decoder layers" in sub.choices["profile-layers"].description


def test_plan_demo_takes_out_and_the_old_out_dir(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["plan-demo", "--out", "x"]).out == "x"
    assert parser.parse_args(["plan-demo", "--out-dir", "y"]).out == "y"
    assert "--out-dir is deprecated; use --out" in capsys.readouterr().err
    assert parser.parse_args(["plan-demo"]).out == "rlhf-fusion-plan-demo"


def test_every_command_that_writes_takes_out():
    import argparse

    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    for name in ("schedule", "demo", "train", "plan-demo", "plan", "profile-layers"):
        assert any("--out" in a.option_strings for a in sub.choices[name]._actions), name


def test_an_unreadable_hub_id_is_one_line_without_retries(tmp_path, monkeypatch, capsys,
                                                          no_processes):
    """Not a folder, not in the Hub cache, and the Hub unreachable: refused at once (asking
    would cost half a minute of retries), naming the field and the offline fix."""
    import rlhf_fusion.loop.models as models

    monkeypatch.setattr(models, "_hub_unreachable", lambda: "huggingface.co does not resolve")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(with_value("models.ref", "org/no-model")))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ("models.ref: org/no-model: no such directory, and not in the Hub cache while the "
            "Hub cannot be reached (huggingface.co does not resolve)") in err


def test_renamed_commands_keep_their_old_names_hidden_for_one_release(tmp_path, capsys):
    """One word per idea: `place` searches placements, `schedule-demo` a fused schedule,
    `tune-migration` R_t and m. The old names still run, print the new one once on stderr,
    and are not listed in `rlhf-fusion --help`."""
    import argparse

    parser = cli.build_parser()
    listed = parser.format_help()
    for old, new in cli.RENAMED_COMMANDS.items():
        assert f"\n    {new} " in listed or f"\n    {new}\n" in listed, new
        assert f"\n    {old} " not in listed and f"\n    {old}\n" not in listed, old
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest for a in sub._choices_actions}.isdisjoint(cli.RENAMED_COMMANDS)
    assert parser.parse_args(["schedule-demo"]).out == "rlhf-fusion-schedule-demo"
    json_out = tmp_path / "rt.json"
    args = ["--instances", "2", "--batch-size", "64", "--median", "40", "--max-len", "256",
            "--quiet", "--trials", "1", "--points", "3", "--json", str(json_out)]
    assert cli.main(["plan-migration", *args]) == 0
    err = capsys.readouterr().err
    assert err.strip() == ("rlhf-fusion: `plan-migration` is deprecated; use "
                           "`rlhf-fusion tune-migration`")
    first = json_out.read_text()
    assert cli.main(["tune-migration", *args]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert json_out.read_text() == first


def test_place_takes_a_train_config_and_names_both_shapes_otherwise(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(BASE))
    out = tmp_path / "out"
    assert cli.main(["place", str(run), "--out", str(out), "--time-limit", "0.3",
                     "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"{run}: a train config (RLHFConfig)" in err
    assert "models ['actor', 'critic', 'ref', 'reward'], 2 x a100-80g" in err
    plan = yaml.safe_load((out / "plan.json").read_text())
    assert plan["cluster"]["groups"][0]["gpus_per_node"] == 2
    # the loop runs the plan it wrote
    cfg = RLHFConfig.from_dict({**BASE, "placement": {"plan": str(out / "plan.json")}})
    cfg.validate()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"models": {"actor": "1b"}, "gpus": 8}))
    assert cli.main(["place", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("keys ['gpus'] are not a placement problem's and ['gpus'] not a train config's; "
            "give a placement problem (models, cluster, batch, prompt_len, gen_len; "
            "docs/placement.md) or a train config (models, generation, ppo, placement, "
            "world_size; docs/loop.md)") in err
    bad.write_text(yaml.safe_dump({**BASE, "ppo": {"cliprange": "wide"}}))
    assert cli.main(["place", str(bad), "--quiet"]) == 2
    assert "ppo.cliprange" in capsys.readouterr().err
