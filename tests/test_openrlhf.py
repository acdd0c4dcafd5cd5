"""OpenRLHF integration: flags, version guard, the Ray setup hook (asserted inside real local Ray
workers) and the gae plugin against OpenRLHF's own method. Skipped without openrlhf and ray;
vllm/flash_attn/deepspeed are stubbed (``rlhf_fusion.testing.openrlhf``)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from rlhf_fusion.integrations.openrlhf import (  # noqa: E402
    FUSION_FLAGS,
    FusionFlagError,
    FusionOptions,
    split_argv,
)
from rlhf_fusion.testing.openrlhf import (  # noqa: E402
    HOOK_WITH_STUBS,
    install_cpu_stubs,
    remove_cpu_stubs,
)


@pytest.fixture(scope="module", autouse=True)
def _stubs():
    added = install_cpu_stubs()
    yield
    remove_cpu_stubs(added)


@pytest.fixture()
def clean_plugins():
    from rlhf_fusion.integrations.openrlhf import plugins

    yield plugins
    plugins.uninstall_plugins()


STOCK = ["--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct", "--vllm.num_engines", "2",
         "--train.colocate_all", "--algo.advantage.estimator", "gae", "--rollout.batch_size", "4",
         "--actor.num_gpus_per_node", "2"]


def test_split_keeps_stock_flags_in_order_and_parses_ours():
    argv = STOCK[:4] + ["--fusion.gae", "--fusion.rt", "0.25"] + STOCK[4:] + [
        "--fusion.mechanism=auto", "--fusion.stream"]
    stock, opts = split_argv(argv)
    assert stock == STOCK
    assert opts == FusionOptions(stream=True, rt=0.25, mechanism="auto", gae=True)
    assert split_argv(["--fusion.rt=auto"])[1].rt == "auto"
    assert split_argv(["--fusion.rt=auto"])[1].stream  # migration moves streamed requests
    assert split_argv(STOCK) == (STOCK, FusionOptions())
    scoring = split_argv(["--fusion.stream_scoring"])[1]
    assert scoring.stream_scoring and scoring.stream  # scoring consumes streamed samples


@pytest.mark.parametrize("bad", [["--fusion.gea"], ["--fusion.rt", "1.5"], ["--fusion.rt"],
                                 ["--fusion.mechanism", "kv"], ["--fusion.gae=1"],
                                 ["--fusion.stream_scoring=1"], ["--fusion.stream-scoring"]])
def test_bad_fusion_flags_are_errors(bad):
    with pytest.raises(FusionFlagError):
        split_argv(STOCK + bad)


def test_unknown_flag_lists_the_known_ones(capsys):
    from rlhf_fusion.cli import main

    assert main(["openrlhf", *STOCK, "--fusion.streaming"]) == 2
    err = capsys.readouterr().err
    assert "unknown flag --fusion.streaming" in err
    for flag in FUSION_FLAGS:
        assert flag in err


def test_version_guard_names_the_supported_range():
    from rlhf_fusion.integrations.openrlhf.compat import OpenRLHFVersionError, check_version

    assert check_version("0.11.2") == "0.11.2"
    for bad in ("0.10.1", "0.11.1", "0.12.0"):
        with pytest.raises(OpenRLHFVersionError, match=r"openrlhf>=0\.11\.2,<0\.12"):
            check_version(bad)


def test_seam_check_fails_on_a_changed_signature(monkeypatch):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from rlhf_fusion.integrations.openrlhf.compat import OpenRLHFVersionError, check_seams

    assert check_seams() == "0.11.2"
    monkeypatch.setattr(RemoteExperienceMaker, "get_advantages_and_returns",
                        lambda self, values, rewards, action_mask, gamma, lam: None)
    with pytest.raises(OpenRLHFVersionError, match="get_advantages_and_returns"):
        check_seams()


@pytest.mark.parametrize("seam", ["make_experience", "_dispatch_forward", "split_rollout_samples"])
def test_scoring_seam_check_fails_on_a_changed_maker(monkeypatch, seam):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from rlhf_fusion.integrations.openrlhf.compat import OpenRLHFVersionError, check_seams

    def changed(self, batches, **kwargs):  # renamed parameter / a body without the stock calls
        return None

    monkeypatch.setattr(RemoteExperienceMaker, seam, changed)
    with pytest.raises(OpenRLHFVersionError, match=seam):
        check_seams(gae=False, stream=False, scoring=True)
    check_seams(gae=False, stream=False, scoring=False)  # not checked when the flag is off


def test_scoring_seam_check_reads_the_stock_bodies(monkeypatch):
    """Same signature, but make_experience no longer batches the reward model as patched."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from rlhf_fusion.integrations.openrlhf.compat import OpenRLHFVersionError, check_seams

    def make_experience(self, samples_list):
        return self._dispatch_forward(self.actor_model_group, False)

    monkeypatch.setattr(RemoteExperienceMaker, "make_experience", make_experience)
    with pytest.raises(OpenRLHFVersionError, match=r"samples_list\[0\].rewards is None"):
        check_seams(gae=False, stream=False, scoring=True)


def test_stock_parser_gets_the_stock_flags_and_ray_init_gets_the_hook(monkeypatch,
                                                                        clean_plugins):
    """The launcher runs train_ppo_ray's own __main__; its train(args) starts Ray, with our
    options and hook merged into its own runtime_env."""
    import openrlhf.utils

    from rlhf_fusion.integrations.openrlhf import launch
    from rlhf_fusion.integrations.openrlhf.hook import HOOK

    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(inits))
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))

    class Reached(Exception):
        pass

    def get_strategy(args):
        raise Reached(args)

    monkeypatch.setattr(openrlhf.utils, "get_strategy", get_strategy)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    argv = [*STOCK, "--critic.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct",
            "--reward.model_name_or_path", "rm", "--fusion.gae"]
    with pytest.raises(Reached) as got:
        launch.main(argv)
    args = got.value.args[0]
    assert args.actor.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert args.vllm.num_engines == 2 and args.train.colocate_all
    assert args.actor.num_gpus_per_node == 2
    assert args.algo.advantage.estimator == "gae" and args.rollout.batch_size == 4
    assert not hasattr(args, "fusion")
    assert len(inits) == 1  # the stock train's own ray.init
    env = inits[0]["runtime_env"]
    assert env["worker_process_setup_hook"] == HOOK
    assert FusionOptions.from_env(env["env_vars"]) == FusionOptions(gae=True)
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO"  # the stock train's own env vars are kept
    assert env["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
    assert clean_plugins.installed_plugins() == ["gae"]  # the driver, too
    assert sys.argv[0] != "openrlhf/cli/train_ppo_ray.py"  # restored
    assert ray.init is not None and len(inits) == 1


@pytest.fixture()
def no_ray(monkeypatch):
    """ray.init raising: a test passes only if nothing tried to start Ray."""
    def init(*a, **kw):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", init)


def _stock_flags():
    # read from train_ppo_ray's source, independently of the launcher's --help
    import importlib.util
    import re
    from pathlib import Path

    src = Path(importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin).read_text()
    flags = set()
    for flag in re.findall(r'add_argument\(\s*f?"(--[^"]+)"', src):
        # the optimiser flags are added once per f"--{prefix}." (actor, critic)
        flags.update(flag.replace("{prefix}", p) for p in ("actor", "critic"))
    return sorted(flags)


@pytest.mark.parametrize("argv", [["--help"], ["--fusion.gae", "--help"], ["-h"]])
def test_help_lists_every_stock_flag_and_ours_without_ray(argv, capsys, no_ray, clean_plugins):
    from rlhf_fusion.integrations.openrlhf.launch import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    stock = _stock_flags()
    assert len(stock) >= 167  # openrlhf 0.11.2's count
    missing = [f for f in stock if f not in out]
    assert missing == []
    for flag in FUSION_FLAGS:
        assert flag in out
    assert clean_plugins.installed_plugins() == []


@pytest.mark.parametrize("argv,says", [
    (["--fusion-gae"], "did you mean --fusion.gae"),
    (["--fusion"], "unknown flag --fusion;"),
    (["--fusion.pipeline"], "--fusion.pipeline: the fused Actor/Critic pipeline"),
    (["--fusion.rt", "2"], "(0, 1]"),
    (["--fusion.wait_s", "0"], "must be > 0"),
])
def test_usage_errors_exit_2_before_ray(argv, says, capsys, no_ray):
    from rlhf_fusion.integrations.openrlhf.launch import main

    assert main([*STOCK, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rlhf-fusion openrlhf")
    assert "rlhf-fusion openrlhf: error: " in err and says in err
    assert "Traceback" not in err


def test_version_guard_is_a_usage_error_before_ray(monkeypatch, capsys, no_ray):
    import importlib.metadata

    from rlhf_fusion.integrations.openrlhf.launch import main

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.12.0" if name == "openrlhf" else real(name))
    assert main([*STOCK, "--fusion.stream"]) == 2
    err = capsys.readouterr().err
    assert "error: openrlhf 0.12.0 is not supported" in err and "Traceback" not in err


def test_stock_parser_errors_come_before_ray(capsys, no_ray, clean_plugins):
    from rlhf_fusion.integrations.openrlhf.launch import main

    with pytest.raises(SystemExit) as got:
        main([*STOCK, "--no.such_flag", "--fusion.gae"])
    assert got.value.code == 2
    assert "unrecognized arguments: --no.such_flag" in capsys.readouterr().err


def test_fusion_gae_with_another_estimator_is_said_once(monkeypatch, capsys, clean_plugins):
    from rlhf_fusion.integrations.openrlhf import launch

    ran = []
    monkeypatch.setattr(launch, "run", lambda stock, options: ran.append(options))
    argv = ["--algo.advantage.estimator", "reinforce_baseline", "--fusion.gae"]
    assert launch.main(argv) == 0 and len(ran) == 1
    err = capsys.readouterr().err
    assert err.count("--fusion.gae does nothing with --algo.advantage.estimator "
                     "reinforce_baseline") == 1
    assert launch.main(["--fusion.gae"]) == 0  # gae (the default): nothing to say
    assert "does nothing" not in capsys.readouterr().err


def test_seam_check_reads_the_copied_stock_bodies(monkeypatch):
    """Same signature, changed body (as _dispatch_prompts_to_vllm's sampling parameters changed
    between 0.11.1 and 0.11.2): refused."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from rlhf_fusion.integrations.openrlhf.compat import OpenRLHFVersionError, check_seams

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        return []  # a different body

    monkeypatch.setattr(SamplesGenerator, "_dispatch_prompts_to_vllm", _dispatch_prompts_to_vllm)
    check_seams(gae=True, stream=False, scoring=True)  # not copied by these plugins
    with pytest.raises(OpenRLHFVersionError, match=r"body of SamplesGenerator\._dispatch_pro"):
        check_seams(gae=False, stream=True, scoring=False)


def test_pipeline_flag_is_refused_with_a_reason(clean_plugins):
    with pytest.raises(NotImplementedError, match="drop the flag"):
        clean_plugins.install_plugins(FusionOptions(pipeline=True))


def _random_case(seed, kind):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 70
    values = torch.randn(b, t, generator=g)
    rewards = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    if kind == "left":
        mask = mask.flip(-1)
    elif kind == "holes":
        mask = torch.rand(b, t, generator=g) > 0.3
    elif kind == "none":
        mask = None
    return values, rewards, mask


@pytest.mark.parametrize("kind", ["right", "left", "holes", "none"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_plugin_equals_openrlhf_method(kind, gamma, lam, clean_plugins):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    stock = RemoteExperienceMaker.get_advantages_and_returns
    clean_plugins.install_plugins(FusionOptions(gae=True))
    fused = RemoteExperienceMaker.get_advantages_and_returns
    assert fused is not stock
    for seed in range(3):
        values, rewards, mask = _random_case(seed, kind)
        # OpenRLHF passes the action mask as it comes (bool or long)
        for m in (mask, None if mask is None else mask.long()):
            want = stock(None, values, rewards, m, gamma, lam)
            got = fused(None, values, rewards, m, gamma, lam)
            for w, o in zip(want, got):
                assert o.dtype == w.dtype and o.shape == w.shape
                torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gamma>1", "lambda<0", "nan_in_padding"])
def test_gae_plugin_behaves_like_stock_where_the_blocked_form_would_not(case, clean_plugins):
    """Stock accepts gamma/lambda outside [0, 1] and turns NaN values at padded positions into
    NaN advantages; --fusion.gae runs stock there (and says so once)."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    stock = RemoteExperienceMaker.get_advantages_and_returns
    clean_plugins.install_plugins(FusionOptions(gae=True))
    fused = RemoteExperienceMaker.get_advantages_and_returns
    values, rewards, mask = _random_case(0, "right")
    gamma, lam = {"gamma>1": (1.2, 0.95), "lambda<0": (0.99, -0.5)}.get(case, (1.0, 0.95))
    if case == "nan_in_padding":
        values = values.masked_fill(~mask, float("nan"))
    want = stock(None, values, rewards, mask, gamma, lam)
    got = fused(None, values, rewards, mask, gamma, lam)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, equal_nan=True)
    if case == "nan_in_padding":
        assert want[0].isnan().any()  # stock's behaviour, kept


@pytest.fixture(scope="module")
def ray_with_hook():
    from rlhf_fusion.integrations.openrlhf.launch import ray_runtime_env

    if ray.is_initialized():
        ray.shutdown()
    opts = FusionOptions(gae=True, stream=True, rt=0.75, stream_scoring=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env=ray_runtime_env(opts, hook=HOOK_WITH_STUBS))
    yield opts
    ray.shutdown()


@ray.remote(num_cpus=0)
class _Probe:
    """Stands in for OpenRLHF's @ray.remote trainers: a real, separate worker process."""

    def report(self, seed):
        import os

        import torch
        from openrlhf.trainer.ppo_trainer import BasePPOTrainer
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
        from openrlhf.trainer.ray import vllm_engine

        from rlhf_fusion.integrations.openrlhf import plugin_state, plugins
        from rlhf_fusion.integrations.openrlhf.gae_plugin import fused_get_advantages_and_returns
        from rlhf_fusion.integrations.openrlhf.scoring import fusion_make_experience_batch
        from rlhf_fusion.integrations.openrlhf.streaming import (
            fusion_generate_vllm,
            fusion_train_step,
        )

        g = torch.Generator().manual_seed(seed)
        v, r = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
        m = torch.rand(3, 40, generator=g) > 0.2
        maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
        got = maker.get_advantages_and_returns(v, r, m, 0.99, 0.95)
        want = plugin_state.stock("gae", "get_advantages_and_returns")(maker, v, r, m, 0.99, 0.95)
        return {
            "pid": os.getpid(),
            "plugins": plugins.installed_plugins(),
            "gae_is_ours": RemoteExperienceMaker.get_advantages_and_returns
            is fused_get_advantages_and_returns,
            "stream_is_ours": SamplesGenerator._generate_vllm is fusion_generate_vllm
            and BasePPOTrainer.train_step is fusion_train_step
            and vllm_engine.RolloutRayActor.__ray_metadata__.class_name == "FusionRolloutRayActor",
            "scoring_is_ours": RemoteExperienceMaker.make_experience_batch
            is fusion_make_experience_batch,
            "max_err": max(float((a - b).abs().max()) for a, b in zip(got, want)),
        }


@ray.remote(num_cpus=0)
class _EngineLikeProbe:
    """A worker that, like a vLLM engine worker, never imports OpenRLHF's trainer modules."""

    def before_and_after(self):
        import sys

        from rlhf_fusion.integrations.openrlhf import hook

        heavy = ("openrlhf.models", "openrlhf.utils.deepspeed",
                 "openrlhf.trainer.ppo_utils.experience_maker", "openrlhf.trainer.ppo_trainer")
        before = sorted(m for m in heavy if m in sys.modules)
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

        from rlhf_fusion.integrations.openrlhf.gae_plugin import fused_get_advantages_and_returns

        return {"before": before, "announced": list(hook._ANNOUNCED),
                "patched_on_import": RemoteExperienceMaker.get_advantages_and_returns
                is fused_get_advantages_and_returns}


def test_setup_hook_imports_nothing_and_patches_on_import(ray_with_hook):
    """The hook loads no trainer module (so no DeepSpeed, no openrlhf.models) into a worker
    that does not import one itself; a module the worker imports is patched then. One
    announcement per worker."""
    import os

    probe = _EngineLikeProbe.remote()
    rep = ray.get(probe.before_and_after.remote(), timeout=120)
    ray.kill(probe)
    assert rep["before"] == []
    assert rep["patched_on_import"]
    assert len(rep["announced"]) == 1
    assert "gae, migrate, stream, stream_scoring" in rep["announced"][0]
    assert f"pid {os.getpid()}" not in rep["announced"][0]


def test_setup_hook_installs_plugins_inside_ray_workers(ray_with_hook):
    import os

    probes = [_Probe.remote() for _ in range(2)]
    reports = ray.get([p.report.remote(i) for i, p in enumerate(probes)], timeout=120)
    for rep in reports:
        assert rep["pid"] != os.getpid()
        assert rep["plugins"] == ["gae", "migrate", "stream", "stream_scoring"]
        assert rep["gae_is_ours"] and rep["stream_is_ours"] and rep["scoring_is_ours"]
        assert rep["max_err"] <= 1e-5
    for p in probes:
        ray.kill(p)


def test_train_step_status_carries_the_counters_once(monkeypatch, clean_plugins):
    """What OpenRLHF's fit logs and sends to wandb/tensorboard: the stock status plus ours."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from rlhf_fusion.integrations.openrlhf import streaming
    from rlhf_fusion.integrations.openrlhf.scoring import ScoringStats

    # the stock step as a stand-in (monkeypatch restores the real one after uninstall)
    monkeypatch.setattr(BasePPOTrainer, "train_step",
                        lambda self, rollout_samples, global_step: ({"kl": 0.1}, global_step + 1))
    clean_plugins.install_plugins(FusionOptions(stream=True), check=False)
    assert BasePPOTrainer.train_step is streaming.fusion_train_step
    gen = SimpleNamespace(
        _fusion_stats=streaming.StreamStats(samples=4, requests=5, migrated=[3]),
        _fusion_scoring_stats=ScoringStats(micro_batches=2, waves={"ref": 2, "critic": 1}))
    trainer = SimpleNamespace(samples_generator=gen)
    status, step = BasePPOTrainer.train_step(trainer, [], 7)
    assert step == 8
    assert status == {"kl": 0.1, "fusion/samples": 4, "fusion/requests": 5,
                      "fusion/migrated_samples": 1, "fusion/scoring_micro_batches": 2,
                      "fusion/scoring_waves": 3}
    assert BasePPOTrainer.train_step(trainer, [], 8)[0] == {"kl": 0.1}  # not again


def test_async_trainer_says_scoring_falls_back(monkeypatch):
    from types import SimpleNamespace

    import openrlhf.utils.logging_utils as lu

    from rlhf_fusion.integrations.openrlhf.scoring import link_scoring

    said = []
    monkeypatch.setattr(lu, "init_logger", lambda name: SimpleNamespace(info=said.append))
    args = SimpleNamespace(train=SimpleNamespace(async_enable=True),
                           rollout=SimpleNamespace(batch_size=4))
    trainer = SimpleNamespace(experience_maker=SimpleNamespace(args=args))  # TrainingActor
    assert link_scoring(trainer) is None
    assert len(said) == 1 and "--train.async_enable" in said[0]
