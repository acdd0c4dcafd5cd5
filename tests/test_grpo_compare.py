"""``demo --algo grpo --compare``'s arithmetic: the simulator's bound weighted like the measured
ratio, the training ratio as the load control, and the bar of issue 37 (pure, no processes)."""

from __future__ import annotations

import pytest

from rlhf_fusion.loop.demo_grpo import pair_row, run_times, verdict, wait_per_cpu


def hist(rollouts, trains, bounds):
    return [{"iteration": i, "time/rollout": r, "time/training": t, "time/iteration": r + t + 0.01,
             **({"fusion/simulated_speedup": b} if b is not None else {})}
            for i, (r, t, b) in enumerate(zip(rollouts, trains, bounds, strict=True))]


def test_the_bound_is_weighted_by_fused_rollout_time():
    t = run_times(hist([1.0, 3.0], [0.5, 0.5], [1.2, None]))
    # serial would take 1.0 * 1.2 + 3.0 * 1.0 if each iteration hit its bound
    assert t["bound"] == pytest.approx((1.2 + 3.0) / 4.0)
    assert t["rollout_s"] == 4.0 and t["train_s"] == 1.0
    assert t["accounts"] == {}
    # PPOWorker's names: time/training and the rank-second accounts
    rows = [{"time/rollout": 1.0, "time/training": 2.0, "time/iteration": 3.0,
             "time/decode": 0.4, "time/scoring": 0.2}]
    t = run_times(rows)
    assert t["train_s"] == 2.0 and t["accounts"] == {"time/decode": 0.4, "time/scoring": 0.2}
    assert "bound" not in t


def pair(serial_roll, serial_train, bound=1.1, p=0):
    fused = run_times(hist([1.0], [1.0], [bound]))
    serial = run_times(hist([serial_roll], [serial_train], [None]))
    return pair_row(p, "fused", fused, serial)


def test_pair_ratios_and_the_load_control():
    r = pair(1.08, 1.0)
    assert r["rollout_ratio"] == pytest.approx(1.08)
    assert r["training_ratio"] == pytest.approx(1.0)
    assert r["gain_of_bound"] == pytest.approx(0.8)
    v = verdict([r, pair(1.3, 1.5, p=1), pair(1.09, 1.02, p=2)])
    assert v["pairs_with_load_drift"] == [1]   # training 1.5x: the load moved


def test_the_bar_below_the_bound_and_above_it():
    # bound 1.10 < 1.15: the measured rollout must gain 90% of what it allows (1.09x) and no
    # pair be below 1.0
    met = verdict([pair(1.0 + x, 1.0, p=i) for i, x in enumerate((0.09, 0.095, 0.1))])
    assert met["bar"].startswith("bound 1.10x") and met["bar_met"]
    assert "1.090x" in met["bar"]
    # 90% of the ratio (0.99x) is not the bar: a median of 1.08x gains 80% of the bound's
    assert not verdict([pair(1.0 + x, 1.0, p=i) for i, x in enumerate((0.06, 0.08, 0.1))]
                       )["bar_met"]
    low = verdict([pair(0.95, 1.0, p=0), pair(1.2, 1.0, p=1), pair(1.2, 1.0, p=2)])
    assert not low["no_pair_below_1"] and not low["bar_met"]
    short = verdict([pair(0.985, 1.0, p=i, bound=1.1) for i in range(3)])
    assert not short["bar_met"]   # below 1.0 and below 90% of the bound
    # bound above 1.15: the median iteration ratio must reach 1.15
    high = verdict([pair(1.3, 1.0, bound=1.4, p=i) for i in range(3)])
    assert high["bar"].startswith("median") and not high["bar_met"]   # iteration 1.15 short
    assert verdict([pair(1.6, 1.0, bound=1.4, p=i) for i in range(3)])["bar_met"]


def test_a_ratio_above_the_bound_is_flagged_and_waits_are_read():
    v = verdict([pair(1.3, 1.0, bound=1.05, p=i) for i in range(3)])
    assert v["bar_met"] and v["above_bound"]   # met as stated, but not fusion's alone
    assert not verdict([pair(1.08, 1.0, bound=1.05, p=i) for i in range(3)])["above_bound"]
    t = run_times([{"time/rollout": 1.0, "time/training": 1.0, "time/iteration": 2.0,
                    "time/decode": 0.6, "time/decode_cpu": 0.2, "time/scoring": 0.5,
                    "time/scoring_cpu": 0.1}])
    assert wait_per_cpu(t) == pytest.approx({"decode": 3.0, "scoring": 5.0})
    assert wait_per_cpu(run_times(hist([1.0], [1.0], [None]))) == {}


def test_warmup_iterations_are_listed_but_left_out_of_the_times():
    # Iteration 0 paid the processes' one-off costs (10 s); the rest is the run's work.
    t = run_times(hist([10.0, 1.0, 3.0], [0.5, 0.5, 0.5], [2.0, 1.2, None]), warmup=1)
    assert t["rollout_s"] == 4.0 and t["train_s"] == 1.0 and t["warmup_rollout_s"] == 10.0
    assert t["bound"] == pytest.approx((1.2 + 3.0) / 4.0)   # iteration 0's bound left out too
    assert len(t["per_iteration"]) == 3
    assert run_times(hist([10.0, 1.0], [0.5, 0.5], [None, None]))["rollout_s"] == 11.0


def test_the_bar_is_judged_against_the_balanced_serial_run_when_there_is_one():
    """A fused rollout 1.0 s, the static split 1.2 s (one rank scored slower), the balanced
    serial run 1.05 s: the bar's ratio is 1.05x (the overlap's), the static one is reported."""
    fused = run_times(hist([1.0], [1.0], [1.1]))
    static = run_times(hist([1.2], [1.0], [None]))
    balanced = run_times(hist([1.05], [1.0], [None]))
    r = pair_row(0, "fused", fused, static, balanced)
    assert r["baseline"] == "balanced"
    assert r["rollout_ratio"] == pytest.approx(1.05)
    assert r["static_rollout_ratio"] == pytest.approx(1.2)
    assert r["gain_of_bound"] == pytest.approx(0.5)
    assert not verdict([r])["bar_met"]   # 1.05x < 1.09x, though the static split gives 1.2x
    assert pair_row(0, "fused", fused, static)["rollout_ratio"] == pytest.approx(1.2)
