"""The KL controllers (``rlhf_fusion.algorithms.kl_control``) against the peers' own classes,
on the same sequence of KL readings, bit for bit: verl 0.9.1's
``verl.trainer.ppo.core_algos.AdaptiveKLController`` (``@pytest.mark.verl``, .ci/verl) and
OpenRLHF 0.11.2's ``openrlhf.trainer.ppo_utils.kl_controller`` (skipped where it does not
import; the CI venv installs it before tests/test_openrlhf*.py). TRL 1.12 has no KL controller
(its ``PPOTrainer`` dropped it); the formula of its former one is the same as theirs."""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest

from rlhf_fusion.algorithms import AdaptiveKLController, FixedKLController, kl_controller


def _peer(module: str, attr: str):
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not available here"
        pytest.skip(f"{module} is not importable here: {type(exc).__name__}: {exc}")
    return getattr(mod, attr)


def _readings(seed: int, target: float) -> list[tuple[float, int]]:
    """KL readings far below, near and far above the target (both clip bounds hit), with
    batches of different sizes."""
    rng = random.Random(seed)
    return [(target * rng.choice([0.0, 0.5, 0.9, 1.0, 1.1, 1.5, 3.0, rng.uniform(0, 4)]),
             rng.choice([1, 16, 64, 512])) for _ in range(200)]


def _run(ctl, readings) -> list[float]:
    out = []
    for kl, n in readings:
        ctl.update(kl, n)
        out.append(float(ctl.value))
    return out


def _ziegler(init: float, target: float, horizon: float, readings) -> list[float]:
    """Ziegler et al. 2019, section 2.2, in numpy as the peers write it."""
    value, out = init, []
    for kl, n in readings:
        value *= 1 + np.clip(kl / target - 1, -0.2, 0.2) * n / horizon
        out.append(float(value))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_adaptive_follows_the_formula_exactly(seed):
    readings = _readings(seed, 0.05)
    assert _run(AdaptiveKLController(0.02, 0.05, 1000), readings) == _ziegler(
        0.02, 0.05, 1000, readings)


def test_adaptive_moves_towards_the_target_at_most_20_percent_per_horizon():
    ctl = AdaptiveKLController(0.1, target=0.05, horizon=100)
    ctl.update(1.0, 100)              # far above: +20%, no more
    assert ctl.value == pytest.approx(0.12)
    ctl.update(0.0, 50)               # far below: -20% over half a horizon
    assert ctl.value == pytest.approx(0.12 * 0.9)
    before = ctl.value
    ctl.update(0.05, 64)              # on target: unchanged
    assert ctl.value == before
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 1000)
    assert fixed.value == 0.1


def test_a_closed_loop_settles_near_the_target():
    # A policy whose KL falls as the coefficient rises (kl = 0.004 / coef): the controller
    # drives the coefficient to where the KL is the target, 0.04, from either side.
    for start in (0.01, 1.0):
        ctl = kl_controller(start, adaptive=True, target=0.02, horizon=1000)
        for _ in range(400):
            ctl.update(0.004 / ctl.value, 64)
        assert 0.004 / ctl.value == pytest.approx(0.02, rel=0.02)


def test_state_round_trips_and_bad_arguments_are_refused():
    a = AdaptiveKLController(0.05, 0.1, 500)
    a.update(0.3, 32)
    b = AdaptiveKLController(0.05, 0.1, 500)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveKLController(0.05, 0.0, 10)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.05, 0.1, 0)
    assert type(kl_controller(0.1, adaptive=False)) is FixedKLController


@pytest.mark.verl
@pytest.mark.parametrize("seed", range(3))
def test_adaptive_equals_verls(seed):
    theirs_cls = _peer("verl.trainer.ppo.core_algos", "AdaptiveKLController")
    readings = _readings(seed, 0.1)
    theirs = theirs_cls(init_kl_coef=0.001, target_kl=0.1, horizon=10000)
    ours = AdaptiveKLController(0.001, 0.1, 10000)
    assert _run(ours, readings) == _run(theirs, readings)


@pytest.mark.parametrize("seed", range(3))
def test_adaptive_equals_openrlhfs(seed):
    theirs_cls = _peer("openrlhf.trainer.ppo_utils.kl_controller", "AdaptiveKLController")
    readings = _readings(seed, 0.02)
    theirs = theirs_cls(0.01, 0.02, 2000)
    assert _run(AdaptiveKLController(0.01, 0.02, 2000), readings) == _run(theirs, readings)
