"""verl integration: options, the entry point, and the GAE plugin against verl's own function.

Tests marked ``verl`` need verl 0.9.1 (``.ci/verl`` runs them with RLHF_FUSION_NO_SKIP=1, so a
skip there fails the step); the rest run everywhere.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

from rlhf_fusion.integrations.verl.hooks import after_import
from rlhf_fusion.integrations.verl.options import (
    VerlPluginError,
    parse_plugins,
    plugins_from_config,
    plugins_from_env,
)


def _verl(module: str = "verl.trainer.ppo.core_algos"):
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means "no verl here"
        pytest.skip(f"{module} is not importable here: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------------
# options and hooks (no verl)
# --------------------------------------------------------------------------------------------


def test_parse_plugins():
    assert parse_plugins("") == frozenset()
    assert parse_plugins(" none ") == frozenset()
    assert parse_plugins("gae") == {"gae"}
    assert parse_plugins("overlap, gae") == {"gae", "overlap"}
    assert parse_plugins("all") == {"gae", "overlap"}
    with pytest.raises(VerlPluginError, match="unknown plugin.*'gea'"):
        parse_plugins("gea")
    assert plugins_from_env({}) == frozenset()
    assert plugins_from_env({"RLHF_FUSION_VERL": "gae"}) == {"gae"}


def test_plugins_from_config():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"trainer": {}})
    assert plugins_from_config(cfg) == frozenset()
    cfg = omegaconf.OmegaConf.create({"rlhf_fusion": {"gae": True, "overlap": False}})
    assert plugins_from_config(cfg) == {"gae"}
    with pytest.raises(VerlPluginError, match="rlhf_fusion.gea is not a plugin"):
        plugins_from_config(omegaconf.OmegaConf.create({"rlhf_fusion": {"gea": True}}))


def test_after_import_patches_as_the_import_ends(tmp_path, monkeypatch):
    (tmp_path / "w38_hooked_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("w38_hooked_mod", lambda m: seen.append(m.VALUE))
    assert seen == []
    import w38_hooked_mod  # noqa: F401

    assert seen == [1]
    after_import("w38_hooked_mod", lambda m: seen.append(2))  # already imported: now
    assert seen == [1, 2]
    sys.modules.pop("w38_hooked_mod")


def test_version_and_seam_checks_name_the_version():
    from rlhf_fusion.integrations.verl.compat import check_gae_seam, check_version

    pytest.importorskip("packaging")
    assert check_version("0.9.1") == "0.9.1"
    with pytest.raises(VerlPluginError, match="verl 0.10.0 is not supported"):
        check_version("0.10.0")
    moved = types.SimpleNamespace(compute_gae_advantage_return=lambda data, gamma, lam: None)
    with pytest.raises(VerlPluginError, match=r"verl 0\.9\.7: compute_gae_advantage_return\("):
        check_gae_seam(moved, "0.9.7")
    with pytest.raises(VerlPluginError, match="verl 0.9.7: .* has no compute_gae"):
        check_gae_seam(types.SimpleNamespace(), "0.9.7")


# --------------------------------------------------------------------------------------------
# GAE against verl's own function
# --------------------------------------------------------------------------------------------


@pytest.fixture
def gae_on():
    """The plugin installed for one test, verl's own function back afterwards."""
    core_algos = _verl()
    from rlhf_fusion.integrations.verl import gae_plugin, plugins

    stock = core_algos.compute_gae_advantage_return
    plugins.install_gae()
    assert core_algos.compute_gae_advantage_return is gae_plugin.fused_compute_gae_advantage_return
    yield core_algos, stock
    plugins.uninstall_gae()
    assert core_algos.compute_gae_advantage_return is stock


def verl_inputs(kind: str, bsz: int, steps: int, seed: int):
    """What verl hands GAE: float32 token-level rewards (KL penalty on every response token and
    the score on the last), float32 values, an int64 0/1 response mask (right padding, or
    multi-turn holes where tool output sits between the model's turns)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, steps + 1, (bsz,), generator=gen)
    lens[0] = steps
    pos = torch.arange(steps)[None, :]
    mask = (pos < lens[:, None]).long()
    if kind == "holes":
        holes = torch.rand(bsz, steps, generator=gen) < 0.2
        mask = mask * (~holes).long()
        mask[:, 0] = 1
    rewards = -0.05 * torch.rand(bsz, steps, generator=gen) * mask
    last = (mask * pos).argmax(dim=1)
    rewards[torch.arange(bsz), last] += torch.randn(bsz, generator=gen)
    values = torch.randn(bsz, steps, generator=gen)
    return rewards.float(), values.float(), mask


# verl's defaults (gamma = lam = 1.0) and the values people tune to
GAE_CASES = [(kind, gamma, lam) for kind in ("right", "holes")
             for gamma, lam in ((1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0))]


def assert_bound(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The documented bound: |ours - verl| <= 1e-5 * (1 + |verl|), elementwise."""
    err = (got.double() - want.double()).abs()
    bound = 1e-5 * (1 + want.double().abs())
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: worst error is {worst:.2f} x the bound"


@pytest.mark.verl
@pytest.mark.parametrize("kind,gamma,lam", GAE_CASES)
def test_gae_equals_stock(gae_on, kind, gamma, lam):
    core_algos, stock = gae_on
    rewards, values, mask = verl_inputs(kind, 8, 300, seed=int(gamma * 100 + lam * 10))
    want_adv, want_ret = stock(rewards, values, mask, gamma, lam)
    adv, ret = core_algos.compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)
    assert adv.dtype == want_adv.dtype == torch.float32 and ret.dtype == torch.float32
    assert_bound(ret, want_ret, "returns")
    # whitening: an error e <= 1e-5 * (1 + M) in each raw advantage (M the largest) moves the mean
    # by at most e and the std by about e, so each whitened one by e / std * (2 + |whitened|)
    raw = (want_ret - values)[mask.bool()].double()
    scale = 1e-5 * (1 + float(raw.abs().max())) / float(raw.std())
    worst = float(((adv.double() - want_adv.double()).abs()
                   / (scale * (2 + want_adv.double().abs()))).max())
    assert worst <= 1.0, f"whitened advantages: worst error is {worst:.2f} x the bound"


@pytest.mark.verl
def test_gae_reaches_both_trainers(gae_on, monkeypatch):
    """The legacy trainer's compute_advantage and the v1 trainer's
    compute_advantage_for_multi_trajectories both run the plugin (counted), with stock results."""
    from verl import DataProto

    from rlhf_fusion.integrations.verl import gae_plugin

    core_algos, stock = gae_on
    ray_trainer = _verl("verl.trainer.ppo.ray_trainer")
    calls = []
    real_gae = gae_plugin.gae
    monkeypatch.setattr(gae_plugin, "gae", lambda *a, **k: calls.append(1) or real_gae(*a, **k))
    rewards, values, mask = verl_inputs("holes", 6, 64, seed=5)
    want_adv, want_ret = stock(rewards, values, mask, 1.0, 0.95)

    def batch():
        return DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(),
                                            "values": values.clone(), "response_mask": mask})

    out = ray_trainer.compute_advantage(batch(), core_algos.AdvantageEstimator.GAE, gamma=1.0,
                                        lam=0.95, config={})
    assert calls == [1]
    assert_bound(out.batch["returns"], want_ret, "legacy returns")
    v1_utils = _verl("verl.trainer.ppo.v1.utils")
    out = v1_utils.compute_advantage_for_multi_trajectories(
        batch(), batch_keys=[f"k{i}" for i in range(6)],
        adv_estimator=core_algos.AdvantageEstimator.GAE, gamma=1.0, lam=0.95, num_repeat=1,
        norm_adv_by_std_in_grpo=True, config={})
    assert calls == [1, 1]
    assert_bound(out.batch["returns"], want_ret, "v1 returns")
    assert core_algos.get_adv_estimator_fn("gae") is gae_plugin.fused_compute_gae_advantage_return


@pytest.mark.verl
def test_gae_runs_stock_where_it_cannot_match(gae_on, monkeypatch):
    from rlhf_fusion.integrations.verl import gae_plugin

    core_algos, stock = gae_on
    monkeypatch.setattr(gae_plugin, "gae", lambda *a, **k: pytest.fail("the blocked GAE ran"))
    rewards, values, mask = verl_inputs("right", 3, 16, seed=1)
    for args in ((rewards.double(), values.double(), mask, 1.0, 1.0),  # stock's dtype
                 (rewards, values, mask, 1.5, 1.0),  # gamma outside [0, 1]
                 (rewards, values, mask * 0.5, 1.0, 1.0)):  # a weighting mask
        got = core_algos.compute_gae_advantage_return(*args)
        want = stock(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# the entry point: in `import verl`, in a Ray worker, and loudly when it cannot install
# --------------------------------------------------------------------------------------------


@pytest.mark.verl
def test_entry_point_in_ray_workers():
    """RLHF_FUSION_VERL reaches a Ray worker through runtime_env env_vars (as
    ray_kwargs.ray_init.runtime_env.env_vars does for verl's workers): there `import verl` loads
    our entry point and GAE is patched; a worker without it runs verl's own."""
    _verl()
    ray = pytest.importorskip("ray")
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "rlhf_fusion"] \
        == ["rlhf_fusion.integrations.verl._entry"]
    def probe() -> tuple[str, list[str]]:
        """In a Ray worker: import verl as verl's workers do, then report what is patched.
        (Nested, so that Ray ships it by value: the worker cannot import this test module.)"""
        import verl  # noqa: F401  (loads the verl.plugins entry points)
        from verl.trainer.ppo import core_algos

        from rlhf_fusion.integrations.verl import active_plugins

        return core_algos.compute_gae_advantage_return.__module__, sorted(active_plugins())

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        probe = ray.remote(num_cpus=1)(probe)
        on = probe.options(runtime_env={"env_vars": {"RLHF_FUSION_VERL": "gae"}}).remote()
        off = probe.remote()
        assert ray.get(on, timeout=180) == ("rlhf_fusion.integrations.verl.gae_plugin", ["gae"])
        assert ray.get(off, timeout=180) == ("verl.trainer.ppo.core_algos", [])
    finally:
        ray.shutdown()


def _import_verl(env_value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLHF_FUSION_VERL=env_value)
    code = ("import verl\nfrom verl.trainer.ppo import core_algos\n"
            "print('GAE', core_algos.compute_gae_advantage_return.__module__)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.verl
def test_entry_point_logs_once_and_fails_loudly():
    _verl("verl")
    ok = _import_verl("gae")
    assert ok.returncode == 0, ok.stderr
    assert "GAE rlhf_fusion.integrations.verl.gae_plugin" in ok.stdout
    assert ok.stderr.count("rlhf_fusion: verl plugins gae on in pid") == 1, ok.stderr
    bad = _import_verl("gea")
    # verl catches Exception around entry points and logs at DEBUG; this must stop the import
    assert bad.returncode != 0
    assert "VerlPluginLoadError" in bad.stderr and "unknown plugin(s) ['gea']" in bad.stderr


@pytest.mark.verl
def test_gae_installs_through_the_v1_trainers_import_chain():
    # In a real job the task runner first reaches core_algos through the v1 trainer's imports
    # (agent_loop -> trainer.distillation.losses -> core_algos), and ray_trainer imports
    # distillation.losses back: checking ray_trainer's call site inside core_algos' import was
    # a circular ImportError (found by the end-to-end job, benchmarks/verl_cpu).
    _verl("verl.trainer.ppo.v1")
    env = dict(os.environ, RLHF_FUSION_VERL="gae")
    code = ("import verl.trainer.ppo.v1\nfrom verl.trainer.ppo import core_algos, ray_trainer\n"
            "print('GAE', core_algos.compute_gae_advantage_return.__module__)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "GAE rlhf_fusion.integrations.verl.gae_plugin" in run.stdout
