"""The demo: R_t's no-migration fallback, per-stage accounting, the timeline picture and
``demo --compare`` (alternating pairs, rewards checked equal)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from rlhf_fusion.loop import compare as cmp  # noqa: E402
from rlhf_fusion.loop import demo  # noqa: E402
from rlhf_fusion.loop.config import (  # noqa: E402
    FusionLoopConfig,
    GenerationConfig,
    ModelsConfig,
    PPOLoopConfig,
    RLHFConfig,
)
from rlhf_fusion.loop.plot import segments, timeline_png  # noqa: E402
from rlhf_fusion.rollout.planning.simulate import plan_migration  # noqa: E402
from rlhf_fusion.rollout.rt_control import RtPlanner  # noqa: E402

# Decode steps of 2 ms plus 0.1 ms per running sample, as the loop's TimedBackend logs them.
STEPS = [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 16, 24)] * 3


def planner(lengths: list[int], scoring_s_per_token: float) -> RtPlanner:
    p = RtPlanner(48, 2, bs_max=64)
    p.observe(lengths, SimpleNamespace(steps=STEPS),
              [(8, 1000, 1000 * scoring_s_per_token)] * 4, prompt_len=10)
    return p


def simulated(p: RtPlanner):
    return plan_migration(p.dist, p.cluster(), 48, trials=4, seed=0, tolerance=0.05,
                          pick="middle").sweep.best


def test_rt_is_zero_when_the_simulator_predicts_no_gain():
    # Every response as long as the others: no tail to migrate, nothing to overlap.
    flat = planner([30] * 48, 2e-5)
    best = simulated(flat)
    assert best.fused_s >= best.serial_s * 0.99   # the simulator's own verdict: no gain
    assert flat.rt() == 0
    # A long tail: migration wins, R_t is a real trigger.
    tail = planner([10] * 40 + [250] * 8, 2e-5)
    best = simulated(tail)
    assert best.fused_s < best.serial_s * 0.99
    assert tail.rt() > 0
    # Back from no migration only with twice the gain needed to stay (no flapping).
    tail.current = 0
    assert (tail.rt() > 0) == (best.fused_s < best.serial_s * 0.98)


def tiny_demo(*, iterations: int = 24, serial: bool = False, world_size: int = 2
              ) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 32}, seed=1),
        generation=GenerationConfig(prompts_per_iteration=8, max_new_tokens=24, seed=2),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=1, micro_batches=2,
                          learning_rate=3e-3),
        fusion=FusionLoopConfig.off() if serial else FusionLoopConfig(rt="auto", solver="greedy"),
        world_size=world_size, iterations=iterations)


def test_compare_runs_alternating_pairs_with_equal_rewards(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "demo_config", tiny_demo)
    order = []
    real = cmp.run_once

    def spy(*, serial: bool, iterations: int, timeline: bool = False):
        order.append("serial" if serial else "fused")
        return real(serial=serial, iterations=iterations, timeline=timeline)

    monkeypatch.setattr(cmp, "run_once", spy)
    s = cmp.compare(tmp_path, pairs=2, iterations=2, progress=False)
    assert order == ["fused", "serial", "serial", "fused"]
    assert len(s["ratios"]) == 2
    for row in s["rows"]:
        f, se = row["fused"], row["serial"]
        assert row["ratio"] == pytest.approx(se["iteration_s"] / f["iteration_s"])
        assert f["rewards"] == se["rewards"] and f["samples"] == se["samples"]
        assert len(f["per_iteration"]) == 2
        # Iteration 0 holds no planning: it was done before the clock started.
        assert f["planning_s"] > 0
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "compare.json").exists()


def test_compare_refuses_different_samples():
    a = {"rewards": [0.1, 0.2], "samples": ["x", "y"]}
    cmp.check_same_samples(a, dict(a))
    with pytest.raises(cmp.CompareError, match="iteration 1"):
        cmp.check_same_samples(a, {"rewards": [0.1, 0.2], "samples": ["x", "z"]})
    with pytest.raises(cmp.CompareError, match="iteration 0"):
        cmp.check_same_samples(a, {"rewards": [0.11, 0.2], "samples": ["x", "y"]})


def test_accounting_and_timeline_of_a_fused_run(tmp_path):
    from rlhf_fusion.loop import train

    res = train(tiny_demo(iterations=2), demo.demo_prompts(), progress=False,
                timeline_serial=True)
    for h in res["history"]:
        world_train = 2 * h["time/training"]
        assert h["time/train_compute"] + h["time/train_idle"] == pytest.approx(world_train)
        assert 0 < h["time/train_compute"] <= world_train
        assert h["time/scoring"] > 0 and h["time/decode"] > 0
        assert 0 < h["time/scoring_cpu"] and 0 < h["time/decode_cpu"]
        assert (h["time/decode"] + h["time/scoring"] + h["time/rollout_idle"]
                == pytest.approx(2 * h["time/rollout"]))
    tl = res["timelines"][-1]
    assert tl["iteration"] == 1
    for tline in (tl, res["serial_timeline"]):
        for rank in range(2):
            ops = {s for s, _, _ in segments(tline, rank)}
            # Training is drawn as the pipeline's instructions, both models on both ranks.
            assert {"actor F", "actor B", "critic F", "critic B"} <= ops
            assert "training" not in ops
            a, b = tline["training"]
            for s, x, y in segments(tline, rank):
                if " " in s:
                    assert a - 0.5 <= x <= y <= b + 0.5, (s, x, y, a, b)
    path = timeline_png([("fused", tl), ("serial", res["serial_timeline"])], 2,
                        tmp_path / "t.png", of=2)
    assert path.stat().st_size > 0
