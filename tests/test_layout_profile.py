"""Training layouts profiled as they run (tp on DTensor, ZeRO-3 on FSDP2, data parallel), and
the cost model costing a training call from that measurement."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_fusion.placement import PlacementError, PlacementProblem, preset_plan
from rlhf_fusion.placement.costs import CostModel
from rlhf_fusion.placement.layout import Layout
from rlhf_fusion.placement.profile import Profile, layout_key, parse_layout_key

LAYOUTS = [(2, 1, 0), (1, 2, 0), (2, 1, 3)]


def _params(build, conf, depth):
    import copy

    c = copy.deepcopy(conf)
    c.num_hidden_layers = depth
    return sum(p.numel() for p in build(c).parameters())


@pytest.mark.parametrize("family,role", [("llama", "actor"), ("gpt2", "critic")])
def test_every_layout_is_timed_on_its_ranks(family, role):
    from rlhf_fusion.runtime.layout_profile import profile_layouts
    from rlhf_fusion.testing.models import build_causal_lm, build_value_model, tiny_config

    conf = tiny_config(family, vocab_size=64, hidden_size=32, layers=3, heads=4, kv_heads=2,
                       max_positions=64)
    build = build_causal_lm if role == "actor" else build_value_model
    out = profile_layouts(conf, role, build, LAYOUTS, world=2, tokens=[16, 32], seq_len=16,
                          repeats=1, timeout=300.0)
    assert out["depths"] == [1, 3] and out["role"] == role
    assert sorted(out["layouts"]) == sorted(layout_key(*lay) for lay in LAYOUTS)
    for tables in out["layouts"].values():
        for key in ("forward", "backward"):
            assert list(tables[key]) == ["16", "32"] and min(tables[key].values()) > 0
        for key in ("rest_forward", "rest_backward"):
            assert min(tables[key].values()) >= 0
        # the step's extra seconds at the two depths' parameter counts (the whole model's)
        assert sorted(map(int, tables["step"])) == [_params(build, conf, 1),
                                                    _params(build, conf, 3)]
        assert min(tables["step"].values()) > 0
    # a sharded layout's weight sync starts with a gather of whole weights; a whole copy's not
    assert ("gather" in out["layouts"]["dp=2 tp=1 zero=0"]) is False
    for key in ("dp=1 tp=2 zero=0", "dp=2 tp=1 zero=3"):
        gather = out["layouts"][key]["gather"]
        assert sorted(map(int, gather)) == [_params(build, conf, 1), _params(build, conf, 3)]
        assert min(gather.values()) > 0
    # the JSON goes through the planner's reader, a layout per key
    prof = Profile.from_dict(json.loads(json.dumps(out)))
    assert prof.layout(1, 2, 0) is not None and prof.layout(2, 1, 3) is not None
    assert prof.layout(2, 1, 1) is prof.layout(2, 1, 0)   # ZeRO-1 runs as data parallel
    assert prof.layout(4, 1, 0) is None


def test_a_layout_too_big_for_the_world_is_refused():
    from rlhf_fusion.runtime.layout_profile import profile_layouts
    from rlhf_fusion.testing.models import build_causal_lm, tiny_config

    conf = tiny_config("llama", vocab_size=64, hidden_size=32, layers=2, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="needs 4 ranks; world is 2"):
        profile_layouts(conf, "actor", build_causal_lm, [(2, 2, 0)], world=2, tokens=[16],
                        seq_len=16)


def _problem(profile):
    base = {"models": {"actor": "1b", "critic": "1b"},
            "cluster": {"nodes": 1, "gpus_per_node": 2}, "batch": 64, "prompt_len": 256,
            "gen_len": 256, "gradient_checkpointing": False, "ppo_minibatches": 2,
            "micro_batch_tokens": 8 * 512}
    if profile is None:
        return PlacementProblem.from_dict(base)
    return PlacementProblem.from_dict({**base, "profiles": {"actor": profile}})


TP2 = {"forward": {1024: 0.02, 4096: 0.05}, "backward": {1024: 0.04, 4096: 0.1},
       "rest_forward": {1024: 0.01, 4096: 0.02}, "rest_backward": {1024: 0.005},
       "step": {10**8: 0.5, 2 * 10**8: 0.7}}
WHOLE = {"forward": {1024: 1.0, 4096: 4.0}, "backward": {1024: 2.0, 4096: 8.0}}


def test_a_measured_layout_replaces_every_analytic_term():
    p = _problem({**WHOLE, "layouts": {"dp=1 tp=2 zero=0": TP2}})
    plan = preset_plan(p, "colocated")
    mesh = plan.calls["actor_train"].mesh
    tp2 = Layout(1, 2, 1)
    m = p.models["actor"]
    lay = Profile.from_dict(TP2)
    # per mini-batch: 32 samples per replica in micro-batches of 8 (8 x 512 tokens)
    tok = 8 * p.seq_len
    one = (m.layers * (lay.layer_forward(tok) + lay.layer_backward(tok))
           + lay.rest(tok, backward=False) + lay.rest(tok, backward=True))
    want = p.ppo_minibatches * p.ppo_epochs * (4 * one + lay.step_seconds(m.params))
    cost = CostModel(p)
    assert cost.train_time("actor_train", mesh, tp2) == pytest.approx(want)
    # the measured table is per micro-batch, unscaled by tp (the layout is in it)
    assert lay.layer_forward(tok) == TP2["forward"][4096]
    # an unprofiled layout keeps the analytic cost (the whole-copy table at tokens / tp,
    # the tp all-reduces, the optimizer): a different figure
    zero3 = Layout(2, 1, 1, zero=3)
    assert cost.measured_layout("actor_train", zero3) is None
    assert cost.measured_layout("actor_train", Layout(1, 2, 1)) is not None
    assert cost.measured_layout("actor_train", Layout(1, 1, 2)) is None   # pp
    p_plain = _problem(WHOLE)
    assert CostModel(p_plain).train_time("actor_train", mesh, tp2) != pytest.approx(want)
    # the Critic has no profile: untouched by the Actor's
    assert CostModel(p).train_time("critic_train", mesh, tp2) == pytest.approx(
        CostModel(p_plain).train_time("critic_train", mesh, tp2))


def test_a_profile_of_layouts_alone_leaves_inference_to_the_flop_model():
    p = _problem({"layouts": {"dp=1 tp=2 zero=0": TP2}})
    plan = preset_plan(p, "colocated")
    s, mesh = plan.calls["ref_inf"].strategy, plan.calls["ref_inf"].mesh
    assert CostModel(p).inference_time("ref_inf", mesh, s) == pytest.approx(
        CostModel(_problem(None)).inference_time("ref_inf", mesh, s))
    # and training in a layout it did not measure
    dp2 = Layout(2, 1, 1)
    assert CostModel(p).train_time("actor_train", mesh, dp2) == pytest.approx(
        CostModel(_problem(None)).train_time("actor_train", mesh, dp2))


def test_step_seconds_join_the_measured_points_linearly():
    prof = Profile.from_dict({**WHOLE, "step": {100: 1.0, 300: 2.0}})
    assert prof.step_seconds(200) == pytest.approx(1.5)
    assert prof.step_seconds(500) == pytest.approx(3.0)     # the line extended
    assert prof.step_seconds(0) == pytest.approx(0.5)
    assert Profile.from_dict(WHOLE).step_seconds(100) == 0.0   # not measured
    # a rest measured as nothing interpolates on a line, not in logarithms
    zero_rest = Profile.from_dict({**WHOLE, "rest_forward": {1024: 0.0, 4096: 0.4}})
    assert zero_rest.rest(2048, backward=False) == pytest.approx(0.2)
    assert math.isfinite(zero_rest.rest(3000, backward=False))


def test_layout_keys_read_and_bad_ones_name_the_form():
    assert parse_layout_key("tp=2", "x") == (1, 2, 0)
    assert parse_layout_key("zero=3 dp=4", "x") == (4, 1, 3)
    assert layout_key(4, 1, 2) == "dp=4 tp=1 zero=0"
    with pytest.raises(PlacementError, match="write it as 'dp=2 tp=1 zero=3'"):
        Profile.from_dict({**WHOLE, "layouts": {"tensor2": TP2}}, "profiles.actor")
    with pytest.raises(PlacementError, match=r"layouts\['tp=2'\].forward"):
        Profile.from_dict({**WHOLE, "layouts": {"tp=2": {**TP2, "forward": {}}}})
    with pytest.raises(PlacementError, match="a mapping of layouts"):
        Profile.from_dict({**WHOLE, "layouts": [1]})


def test_a_sharded_layouts_weight_sync_starts_from_its_measured_gather():
    """Training tp=2, generation data parallel on the same two GPUs: the reallocation node is
    the measured gather of whole weights, then the move between whole copies (none here: the
    generation ranks are the training ranks)."""
    from rlhf_fusion.placement import CallPlacement, Estimator, ExecutionPlan
    from rlhf_fusion.placement.graph import CALLS

    gathered = {**TP2, "gather": {10**8: 0.25, 2 * 10**8: 0.45}}
    p = _problem({**WHOLE, "layouts": {"dp=1 tp=2 zero=0": gathered}})
    mesh = preset_plan(p, "colocated").calls["actor_train"].mesh
    dp2, tp2 = Layout(2, 1, 1), Layout(1, 2, 1)
    plan = ExecutionPlan({c: CallPlacement(mesh, tp2 if c.endswith("_train") else dp2)
                          for c in CALLS}, "tp train")
    est = Estimator(p).estimate(plan)
    want = Profile.from_dict(gathered).gather_seconds(p.models["actor"].params)
    assert est.realloc_time["actor_gen"] == pytest.approx(want)
    # unmeasured (the Critic): the planner's transfer of the missing halves, not a gather
    plain = Estimator(_problem(None)).estimate(plan)
    assert est.realloc_time["critic_inf"] == pytest.approx(plain.realloc_time["critic_inf"])
    assert plain.realloc_time["actor_gen"] != pytest.approx(want)


def test_cli_profiles_layouts_the_planner_reads(tmp_path, capsys):
    from rlhf_fusion.cli import main
    from rlhf_fusion.testing.models import tiny_config

    tiny_config("qwen2", vocab_size=64, hidden_size=32, layers=2, heads=4, kv_heads=2,
                max_positions=64).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "actor.json"
    args = ["profile-layers", str(tmp_path / "tiny"), "--out", str(out), "--tokens", "16", "32",
            "--seq-len", "16", "--repeats", "1", "--dtype", "float32", "--device", "cpu",
            "--quiet"]
    assert main([*args, "--layout", "tp=2", "--layout", "dp=2 zero=3"]) == 0
    printed = capsys.readouterr().out
    assert "dp=1 tp=2 zero=0: at 32 tokens" in printed and "gather" in printed
    prof = json.loads(out.read_text())
    assert sorted(prof["layouts"]) == ["dp=1 tp=2 zero=0", "dp=2 tp=1 zero=3"]
    p = PlacementProblem.from_dict({
        "models": {"actor": {"params": 1e6, "layers": 2, "hidden": 32}},
        "cluster": {"nodes": 1, "gpus_per_node": 2}, "batch": 8, "prompt_len": 16,
        "gen_len": 16, "profiles": {"actor": str(out)}})
    cost = CostModel(p)
    assert cost.measured_layout("actor_train", Layout(1, 2, 1)) is not None
    assert cost.measured_layout("actor_train", Layout(2, 1, 1, zero=3)) is not None
    assert cost.measured_layout("actor_train", Layout(2, 1, 1)) is None
    assert main([*args, "--layout", "tensor=2"]) == 2
    assert "write it as 'dp=2 tp=1 zero=3'" in capsys.readouterr().err
    assert main([*args, "--layout", "tp=4", "--world", "2"]) == 2
    assert "needs 4 ranks; world is 2" in capsys.readouterr().err


def test_launches_combine_figure_by_figure_by_their_median():
    from rlhf_fusion.runtime.layout_profile import median_layouts

    runs = [{"tp=2": {"forward": {"16": f}, "step": {"100": 10 * f}}} for f in (1.0, 9.0, 2.0)]
    assert median_layouts(runs) == {"tp=2": {"forward": {"16": 2.0}, "step": {"100": 20.0}}}
    with pytest.raises(ValueError, match="layouts differ"):
        median_layouts([runs[0], {"dp=2": runs[0]["tp=2"]}])


def test_a_layout_on_part_of_the_world_is_timed_by_its_own_ranks():
    """dp=1 on 2 ranks: rank 1 idles; its zero seconds must not become the step's figure."""
    from rlhf_fusion.runtime.layout_profile import profile_layouts
    from rlhf_fusion.testing.models import build_causal_lm, tiny_config

    conf = tiny_config("llama", vocab_size=64, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_positions=64)
    out = profile_layouts(conf, "actor", build_causal_lm, [(1, 1, 0)], world=2, tokens=[16],
                          seq_len=16, repeats=1, timeout=300.0)
    tables = out["layouts"]["dp=1 tp=1 zero=0"]
    assert min(tables["step"].values()) > 0 and min(tables["forward"].values()) > 0
