"""Migration planning: decision rules, validation, simulator, CLI. Pure numpy except the CLI plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_fusion.rollout.cli import plan_migration_main
from rlhf_fusion.rollout.planning import (
    ClusterModel,
    LengthDistribution,
    MovingSample,
    assign_migration,
    choose_destinations,
    choose_mechanism,
    destination_at_trigger,
    lognormal_quantile_lengths,
    plan_migration,
    required_instances,
    rt_grid,
    simulate_fused,
    simulate_serial,
    validate_fusion,
)
from rlhf_fusion.rollout.planning.presets import PRESETS
from rlhf_fusion.rollout.types import KVCapacityError, RolloutConfigError


def test_planning_imports_no_torch():
    code = ("import sys, rlhf_fusion.rollout, rlhf_fusion.rollout.planning; "
            "assert 'torch' not in sys.modules, 'planning imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_m_formula():
    assert required_instances(100, 32, 1000, None) == 4
    assert required_instances(100, 32, 1000, 10_000) == 10  # KV-bound: 100 * 1000 / 10000
    assert required_instances(1, 32, 10, 1e9) == 1


def test_validation_names_the_fix():
    ok = dict(batch_size=100, instances=4, bs_max=32, longest_kv_tokens=1000)
    assert validate_fusion(rt=20, **ok) == 1
    with pytest.raises(RolloutConfigError, match=r"R_t=0 is outside the batch.*pick 1 <= R_t"):
        validate_fusion(rt=0, **ok)
    with pytest.raises(RolloutConfigError, match="outside the batch"):
        validate_fusion(rt=101, **ok)
    with pytest.raises(RolloutConfigError, match=r"m=4 .* lower R_t to at most 96"):
        validate_fusion(rt=100, **ok)
    with pytest.raises(RolloutConfigError, match=r"set m >= 2 or lower R_t"):
        validate_fusion(rt=40, m=1, **ok)
    with pytest.raises(KVCapacityError, match="raise the KV capacity"):
        validate_fusion(rt=10, kv_capacity_tokens=500, **ok)
    with pytest.raises(RolloutConfigError, match="at least 2"):
        validate_fusion(rt=10, **{**ok, "instances": 1})


def test_destinations_are_the_m_with_most_left():
    assert choose_destinations({0: 3, 1: 5, 2: 5, 3: 0}, 2) == [1, 2]
    assert choose_destinations({0: 1, 1: 0}, 3) == [0]


def test_the_destination_at_the_trigger_is_never_the_claimer_while_a_peer_decodes():
    assert destination_at_trigger([9, 4], claimer=0) == 1      # the claimer sends its 9
    assert destination_at_trigger([4, 9], claimer=0) == 1
    assert destination_at_trigger([7, 3, 3, 5], claimer=3) == 0
    assert destination_at_trigger([0, 5, 5], claimer=0) == 1  # ties: lower rank
    assert destination_at_trigger([6, 0], claimer=0) == 0     # a peer with none left: nothing moves
    assert destination_at_trigger([0, 0], claimer=1) == 1


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 7), st.lists(st.integers(1, 50), max_size=8),
                       min_size=2, max_size=8),
       st.integers(1, 4), st.sampled_from([None, 200, 10_000]))
def test_assignment_moves_every_sample_exactly_once(per_instance, m, capacity):
    sid = iter(range(1000))
    unfinished = {i: [MovingSample(next(sid), n, n + 10) for n in lens]
                  for i, lens in per_instance.items()}
    try:
        plan = assign_migration(unfinished, m, bs_max=4, kv_capacity_tokens=capacity)
    except KVCapacityError:
        assert capacity is not None
        return
    dests = set(plan.destinations)
    assert len(dests) <= m and dests.isdisjoint(plan.freed)
    assert dests | set(plan.freed) == set(unfinished)
    moved = [i for per in plan.moves.values() for ids in per.values() for i in ids]
    expect = [s.sample_id for src in plan.freed for s in unfinished[src]]
    assert sorted(moved) == sorted(expect) == plan.moved_ids
    assert all(d in dests for per in plan.moves.values() for d in per)
    if capacity is not None:
        for d in dests:
            own = sum(s.reserved_tokens for s in unfinished[d])
            extra = sum(s.reserved_tokens for src, per in plan.moves.items()
                        for s in unfinished[src] if s.sample_id in per.get(d, []))
            assert extra == 0 or own + extra <= capacity  # moves never overfill a destination


def test_mechanism_follows_bandwidth_vs_prefill():
    kw = dict(kv_bytes_per_token=1e6, latency_s=0.0, prefill_s_per_token=1e-4)
    assert choose_mechanism(1000, bandwidth_bytes_s=1e11, **kw)[0] == "kv"
    assert choose_mechanism(1000, bandwidth_bytes_s=1e9, **kw)[0] == "tokens"
    assert choose_mechanism(1000, bandwidth_bytes_s=1e11, kv_supported=False, **kw)[0] == "tokens"


def test_lengths_distribution():
    x = lognormal_quantile_lengths(10_000, 100, 1.0)
    d = LengthDistribution(x)
    assert d.median == pytest.approx(100, rel=0.02)
    assert 9.5 < d.tail_ratio < 11
    refined = d.refine([50_000] * 100, weight=0.5)
    assert refined.quantile(0.6) == 50_000 and refined.quantile(0.25) == pytest.approx(100, rel=0.05)
    with pytest.raises(RolloutConfigError):
        LengthDistribution([])


def test_length_file_round_trip(tmp_path):
    d = LengthDistribution([1, 2, 3, 400], [1, 1, 1, 2])
    d.save(tmp_path / "l.json")
    e = LengthDistribution.load(tmp_path / "l.json")
    assert e.lengths.tolist() == [1, 2, 3, 400] and e.weights.tolist() == d.weights.tolist()
    (tmp_path / "plain.json").write_text("[5, 6]")
    assert LengthDistribution.load(tmp_path / "plain.json").lengths.tolist() == [5, 6]


SMALL = ClusterModel(instances=4, bs_max=16, step_base_s=0.01, step_per_sample_s=1e-4,
                     step_per_kv_token_s=1e-7, prefill_per_token_s=1e-5,
                     infer_per_token_s=2e-4, prompt_len=64)


def test_serial_simulation_against_hand_computation():
    c = ClusterModel(instances=1, bs_max=8, step_base_s=1.0, step_per_sample_s=0.0,
                     step_per_kv_token_s=0.0, prefill_per_token_s=0.0, infer_per_token_s=0.5,
                     prompt_len=0)
    total, gen_end, finish = simulate_serial(np.array([3, 1]), c)
    # the prefill emits token 1; sample 0 then needs 2 decode steps of 1 s
    assert finish == {1: 0.0, 0: 2.0} and gen_end == 2.0
    assert total == pytest.approx(2.0 + 0.5 * 4)


def test_fused_simulation_overlaps_inference_with_the_tail():
    lengths = np.array([400] + [20] * 31)
    r = simulate_fused(lengths, SMALL, rt=4)
    assert r.m == 1 and r.migrated == 0  # only one instance has the tail
    assert r.fused_s < r.serial_s
    assert r.fused_s >= r.fused_generation_s >= r.trigger_s


def test_large_preset_curve_is_u_shaped():
    preset = PRESETS["llama13b-h100x64"]
    dist = LengthDistribution.lognormal(preset.median_len, preset.sigma, max_len=preset.max_len)
    plan = plan_migration(dist, preset.cluster, preset.batch_size, trials=2, tolerance=0.0)
    feasible = plan.sweep.feasible
    times = [p.fused_s for p in feasible]
    best = times.index(min(times))
    assert 0 < best < len(times) - 1, "the optimum is inside the range: a U, not a slope"
    assert times[0] > min(times) * 1.05 and times[-1] > min(times) * 1.02
    assert all(p.serial_s > p.fused_s for p in feasible[1:])
    assert any(not math.isfinite(p.fused_s) for p in plan.sweep.points)  # m >= n at the top
    assert plan.rt == feasible[best].rt and 1.1 < plan.speedup < 2.0


def test_tolerance_prefers_fewer_migrations_on_a_flat_curve():
    from rlhf_fusion.rollout.planning import SweepPoint, SweepResult

    sweep = SweepResult(100, [SweepPoint(10, 0.1, 1, 10.0, 12.0, "kv"),
                              SweepPoint(20, 0.2, 1, 9.95, 12.0, "kv"),
                              SweepPoint(30, 0.3, 1, 9.9, 12.0, "kv"),
                              SweepPoint(40, 0.4, 2, math.inf, 12.0, "-")])
    assert sweep.best.rt == 30 and sweep.choose(0.01).rt == 20 and sweep.choose(0.02).rt == 10


def test_grid_spans_5_to_95_percent():
    g = rt_grid(200)
    assert g[0] == 10 and g[-1] == 190 and len(g) == 19


def test_cli_prints_the_curve_and_the_choice(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps(lognormal_quantile_lengths(500, 50, 1.0).tolist()))
    rc = plan_migration_main([
        "--lengths", str(lengths), "--batch-size", "256", "--instances", "8", "--bs-max", "64",
        "--kv-capacity-tokens", "40000", "--prompt-len", "128", "--trials", "1", "--points", "7",
        "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "p.json"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "choice: R_t =" in out and "<- best" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert len(data["plan"]["curve"]) == 7
    # the JSON holds the choice that was printed
    assert f"R_t = {data['plan']['rt']} (" in out and f"m = {data['plan']['m']} destination" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_rejects_bad_configuration(capsys):
    rc = plan_migration_main(["--instances", "1", "--quiet", "--trials", "1"])
    assert rc == 2 and "at least 2" in capsys.readouterr().err


def test_choose_takes_the_middle_of_the_near_optimal_stretch():
    from rlhf_fusion.rollout.planning.simulate import SweepPoint, SweepResult

    times = {3: 1.30, 6: 1.04, 10: 1.02, 13: 1.01, 16: 1.00, 19: 1.03, 22: 1.20}
    sweep = SweepResult(32, [SweepPoint(rt, rt / 32, 1, t, 1.5, "kv") for rt, t in times.items()])
    assert sweep.choose(0.05).rt == 6  # the smallest within 5 %
    assert sweep.choose(0.05, "middle").rt == 13  # of 6, 10, 13, 16, 19
    assert sweep.choose(0.0, "middle").rt == 16
    # Noise that moves one end of the stretch moves the middle by at most one step.
    times[6] = 1.06
    noisy = SweepResult(32, [SweepPoint(rt, rt / 32, 1, t, 1.5, "kv") for rt, t in times.items()])
    assert noisy.choose(0.05, "middle").rt in (13, 16)


def test_fused_simulation_scores_in_micro_batches_in_ready_order():
    # One decode step a second, one scoring second a sample; five samples end at their
    # prefill (t=0), sample 5 decodes 4 steps on instance 1, which keeps it (R_t = 1).
    c = ClusterModel(instances=2, bs_max=8, step_base_s=1.0, step_per_sample_s=0.0,
                     step_per_kv_token_s=0.0, prefill_per_token_s=0.0, infer_per_token_s=0.0,
                     infer_per_sample_s=1.0, prompt_len=0)
    lengths = np.array([1, 1, 1, 1, 1, 5])
    ends = {mb: simulate_fused(lengths, c, 1, micro_batch=mb) for mb in (1, 2, 4, 6)}
    assert {r.serial_s for r in ends.values()} == {4.0 + 3.0}
    assert all(r.trigger_s == 0.0 and r.fused_generation_s == 4.0 for r in ends.values())
    # single samples: the freed instance scores four, then each instance one (ends at 5);
    # pairs: the last pair waits for sample 5 (4 + 2); all six in one: 4 + 6
    assert {mb: r.fused_s for mb, r in ends.items()} == {1: 5.0, 2: 6.0, 4: 6.0, 6: 10.0}
    assert ends[4].scored_at == {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0, 4: 6.0, 5: 6.0}
    with pytest.raises(RolloutConfigError, match="micro_batch must be >= 1"):
        simulate_fused(lengths, c, 1, micro_batch=0)
