"""Plan search: MCMC reaches the enumerated optimum on small clusters, determinism, the plan
file, and the ``rlhf-fusion plan`` command."""

from __future__ import annotations

import json
import time

import pytest

from rlhf_fusion.cli import main
from rlhf_fusion.placement import (
    CALLS,
    Estimator,
    ExecutionPlan,
    PlacementError,
    PlacementProblem,
    count_plans,
    enumerate_best,
    search,
)


def problem(**kw) -> PlacementProblem:
    cfg = {"models": {"actor": "1b", "critic": "1b"},
           "cluster": {"nodes": 1, "gpus_per_node": 2}, "batch": 64, "prompt_len": 256,
           "gen_len": 256}
    cfg.update(kw)
    return PlacementProblem.from_dict(cfg)


@pytest.mark.parametrize("models, greedy_optimal", [({"actor": "1b", "critic": "1b"}, False),
                                                    ({"actor": "1b", "critic": "3b"}, True)])
def test_mcmc_finds_the_enumerated_optimum_within_10s(models, greedy_optimal):
    p = problem(models=models)
    assert count_plans(p) <= 20_000
    best, best_est, n = enumerate_best(p)
    t0 = time.perf_counter()
    r = search(p, time_limit=3.0, seed=1)
    assert time.perf_counter() - t0 < 10
    assert r.estimate.cost == pytest.approx(best_est.cost, rel=1e-9)
    assert r.estimate.cost <= r.heuristic_estimate.cost
    assert not r.estimate.oom
    # In the first setting the greedy start stops short of the optimum: the walk finds it.
    assert (r.greedy_cost == pytest.approx(best_est.cost, rel=1e-9)) == greedy_optimal


def test_search_is_deterministic_for_a_seed_and_step_budget():
    p = problem()
    a = search(p, time_limit=60, seed=3, max_steps=400)
    b = search(p, time_limit=60, seed=3, max_steps=400)
    assert a.plan.key() == b.plan.key() and a.steps == b.steps == 400
    assert a.history[-1][1] == b.history[-1][1]


def test_enumeration_refuses_large_spaces():
    p = problem(cluster={"nodes": 1, "gpus_per_node": 8})
    with pytest.raises(PlacementError, match="too many to enumerate"):
        enumerate_best(p, limit=1000)


def test_plan_json_round_trip_and_rank_check(tmp_path):
    p = problem()
    r = search(p, time_limit=1.0, seed=0)
    path = tmp_path / "plan.json"
    r.plan.save(path, p.cluster)
    back = ExecutionPlan.load(path, p.cluster)
    assert back.key() == r.plan.key()
    assert Estimator(p).estimate(back).cost == pytest.approx(r.estimate.cost)
    d = json.loads(path.read_text())
    d["calls"]["actor_gen"]["mesh"]["ranks"] = [7]
    with pytest.raises(PlacementError, match="ranks"):
        ExecutionPlan.from_dict(d, p.cluster)
    d["format"] = "something"
    with pytest.raises(PlacementError, match="rlhf-fusion plan"):
        ExecutionPlan.from_dict(d, p.cluster)


def test_cli_plan_prints_table_and_writes_plan_and_png(tmp_path, capsys):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text("name: tiny\nmodels: {actor: 1b, critic: 1b}\n"
                   "cluster: {nodes: 1, gpus_per_node: 2, hardware: h100-80g}\n"
                   "batch: 64\nprompt_len: 256\ngen_len: 256\nsearch: {time_limit: 1.5}\n")
    out = tmp_path / "out"
    assert main(["plan", str(cfg), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    for c in CALLS:
        assert c in text
    assert "co-located heuristic" in text and "estimated gain" in text
    assert (out / "timeline.png").stat().st_size > 1000
    d = json.loads((out / "plan.json").read_text())
    assert d["format"] == "rlhf-fusion-plan" and set(d["calls"]) == set(CALLS)
    assert d["estimate"]["iteration_time_s"] <= d["estimate"]["heuristic_iteration_time_s"] + 1e-9
    assert main(["plan", str(cfg), "--out", str(out), "--preset", "interleaved"]) == 0


def test_cli_plan_bad_config_names_the_fix(tmp_path, capsys):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"models": {"actor": "gpt-9"}, "cluster": {"nodes": 1}}))
    assert main(["plan", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "models.actor" in err and "llama-7b" in err
    assert main(["plan", str(tmp_path / "missing.yaml"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
