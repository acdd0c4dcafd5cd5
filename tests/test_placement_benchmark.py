"""benchmarks/placement.py's FlexRLHF comparison, on made-up estimates (no estimator runs):
the tie band comes from the paper's own figures, the directions count follows it, and the cells
the paper marks OOM are counted rather than dropped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = json.loads((ROOT / "benchmarks" / "reference" / "flexrlhf.json").read_text())


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_placement",
                                                  ROOT / "benchmarks" / "placement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def paper_as_ours(bench, oom_throughput: float = 0.1) -> dict:
    """Estimates equal to the paper's figures; where the paper says OOM, ours fits."""
    cells = {}
    for table in bench.FLEX_CELLS:
        for nodes, strat in table:
            for size in bench.FLEX_SIZES:
                if (strat == "Disaggregated" or nodes == 16) and size not in bench.FLEX_LARGE_SIZES:
                    continue
                pv, listed = bench._paper(REF, f"{nodes}x8", strat, size)
                assert listed, f"{nodes}x8 {strat} {size} is not in the paper's tables"
                cells[f"{nodes}x8|{strat}|{size}"] = {
                    "throughput": pv if pv is not None else oom_throughput, "oom": False,
                    "batch": 16, "per_gpu": 2, "peak_gb": 71.3}
    t3 = {"DS-Chat": {"throughput": REF["table_III"]["1x8 A100"]["DS-Chat"]},
          "Heterogeneous Disaggregated": {
              "throughput": REF["table_III"]["1x8 A100 + 2x4 V100"]["Heterogeneous Disaggregated"]}}
    return {"cells": cells, "table_III": t3}


def test_tie_band_is_the_papers_no_gain_and_smallest_speedup(bench):
    lo, hi = bench.paper_tie(REF)
    # Table I: Interleave1 0.95 vs DS-Chat 0.93 on 4x8 33B ("does not perform well", V-B1 i);
    # 17.35 vs 16.12 on 1x8 7B ("a speedup of 7.63%")
    assert lo == pytest.approx(0.95 / 0.93 - 1)
    assert hi == pytest.approx(0.0763, abs=5e-5)
    assert lo < hi


def test_paper_against_itself_matches_every_direction_and_counts_oom_cells(bench):
    cmp = bench.flex_compare(paper_as_ours(bench), REF)
    assert cmp["n_pairs"] == 19
    assert cmp["matched"] == 19 and cmp["matched_in_band"] == [19, 19]
    assert [r["tie"] for r in cmp["tie_sweep"]] == list(bench.TIE_SWEEP)
    # 65B on one node, DS-Chat and Interleave1 (Table I), reported, not dropped
    assert cmp["n_paper_oom"] == 2 and cmp["paper_oom_ours_fits"] == 2
    assert {(c["gpus"], c["strategy"], c["size"]) for c in cmp["paper_oom"]} == {
        ("1x8", "DS-Chat", "65B"), ("1x8", "Interleave1", "65B")}
    assert cmp["usable_gb"] == pytest.approx(72.0)
    # ...and kept out of the ratios' count (the paper has no figure there)
    assert cmp["n_ratios"] == 34 and cmp["within_2x"] == 34


def test_directions_follow_the_band(bench):
    ours = paper_as_ours(bench)
    # ours: Interleave1 4x8 33B 3% faster than DS-Chat, where the paper's +2.15% is no gain
    ours["cells"]["4x8|Interleave1|33B"]["throughput"] = 0.93 * 1.03
    cmp = bench.flex_compare(ours, REF)
    missed = [f"{q['strategy']} {q['gpus']} {q['size']}" for q in cmp["pairs"] if not q["match"]]
    assert missed == ["Interleave1 4x8 33B"] and cmp["matched"] == 18
    # below 2.15% both are wins, from 3% both ties: the miss lives in [2.15%, 3%) only, which the
    # band interval reports and the 1%-step sweep cannot see
    assert cmp["matched_in_band"] == [18, 19]
    assert [r["matched"] for r in cmp["tie_sweep"]] == [19] * len(bench.TIE_SWEEP)
    # ours OOM where the paper is not: a miss, never a match
    ours["cells"]["2x8|Interleave2|7B"]["throughput"] = None
    assert bench.flex_compare(ours, REF)["matched"] == 17


def test_workload_is_the_papers(bench):
    """flex_config against the workload copied from the paper (V-A) into the reference."""
    w = REF["workload"]
    cfg = bench.flex_config("7B", bench._cluster(1, bench.IB_PAPER), "deepspeed-chat")
    assert (cfg["prompt_len"], cfg["gen_len"]) == (w["prompt_len"], w["gen_len"])
    assert cfg["ppo_epochs"] == w["ppo_epochs"] and cfg["lora_dim"] == w["lora_dim"]
    assert cfg["cluster"]["gpus_per_node"] == 8
    assert bench.FLEX_SIZES == ("7B", "13B", "33B", "65B")
