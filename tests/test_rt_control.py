"""R_t's planner fits decode steps and prefills apart (rollout/rt_control.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_fusion.rollout import SampleSpec
from rlhf_fusion.rollout.reference import ReferenceBackend
from rlhf_fusion.rollout.rt_control import (
    REPLAN_MAX,
    SCORING_WINDOW,
    RtPlanner,
    TimedBackend,
    fit_scoring,
)
from rlhf_fusion.testing import build_causal_lm, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_causal_lm(tiny_config("llama", vocab_size=40))


def test_a_rollouts_first_step_is_timed_as_a_prefill(model):
    timed = TimedBackend(ReferenceBackend(model, max_batch_size=4))
    prompts = [[1, 2, 3], [4, 5, 6]]
    timed.submit([SampleSpec(i, prompts[i % 2], max_new_tokens=3 if i == 0 else 8, seed=3)
                  for i in range(6)])
    while timed.unfinished():
        timed.step()
    # The first step admits 4 (the batch is full); the two admitted once sample 0 ends join
    # running ones, so their step stays a decode step (continuous batching).
    assert timed.prefill_steps == {0}
    assert [n for n, _ in timed.prefills] == [4]
    assert len(timed.steps) >= 5
    timed.reset_timing()
    assert timed.prefills == [] and timed.prefill_steps == set()


def test_the_decode_fit_leaves_the_prefill_out():
    # Decode steps flat at 2 ms from 1 to 40 running samples; a prefill of 64 samples, 20 ms.
    steps = [(64, 0.020)] + [(b, 0.002) for b in (40, 30, 20, 10, 5, 2, 1)]
    backend = SimpleNamespace(steps=steps, prefill_steps={0}, prefills=[(64, 0.020)])
    p = RtPlanner(64, 2, bs_max=64)
    p.observe([4] * 64, backend, [(8, 100, 0.01)], prompt_len=6)
    c = p.cluster()
    assert c.step_per_sample_s == pytest.approx(0.0, abs=1e-9)
    assert c.step_base_s == pytest.approx(0.002)
    assert c.prefill_per_token_s == pytest.approx((0.020 - 0.002) / 64 / 6)
    # Fitted as a decode step, the prefill made decode steps look 4x dearer at 40 samples.
    old = RtPlanner(64, 2, bs_max=64)
    old.observe([4] * 64, SimpleNamespace(steps=steps), [(8, 100, 0.01)], prompt_len=6)
    c_old = old.cluster()
    assert c_old.step_base_s + 40 * c_old.step_per_sample_s > 4 * 0.002


def _calls(lengths, per_sample, per_token, prompt=6, micro=4):
    """Scoring calls of ``micro`` samples each costing ``per_sample`` a sample plus
    ``per_token`` a token (prompt + response)."""
    out = []
    for i in range(0, len(lengths), micro):
        chunk = lengths[i: i + micro]
        tokens = sum(prompt + n for n in chunk)
        out.append((len(chunk), tokens, per_sample * len(chunk) + per_token * tokens))
    return out


def test_scoring_is_priced_per_sample_and_per_token_from_the_last_batches_calls():
    """A scoring call costs mostly per call: fitted per sample and per token, the price of a
    batch of short completions is right after batches of long ones, where one price per token
    set on the long ones priced the short ones at a fraction of their cost. Only the last
    SCORING_WINDOW batches count: here the per-sample cost halves and the fit follows."""
    backend = SimpleNamespace(steps=[(8, 0.002), (4, 0.002)])
    long_ = [40 + k % 9 for k in range(64)]
    short = [2 + k % 5 for k in range(64)]
    p = RtPlanner(64, 2, bs_max=64)
    for _ in range(6):
        p.observe(long_, backend, _calls(long_, 1e-3, 4e-6), prompt_len=6)
    c = p.cluster()
    assert c.infer_per_sample_s == pytest.approx(1e-3)
    assert c.infer_per_token_s == pytest.approx(4e-6)
    truth = sum(1e-3 + 4e-6 * (6 + n) for n in short)
    priced = sum(c.infer_per_sample_s + c.infer_per_token_s * (6 + n) for n in short)
    assert priced == pytest.approx(truth)
    # (what one price per token, set on the long completions, made of the short ones)
    per_token_alone = sum(x[2] for x in _calls(long_, 1e-3, 4e-6)) / sum(
        x[1] for x in _calls(long_, 1e-3, 4e-6))
    assert per_token_alone * sum(6 + n for n in short) < 0.4 * truth
    for k in range(SCORING_WINDOW):
        p.observe(short, backend, _calls(short, 0.5e-3, 4e-6), prompt_len=6)
        c = p.cluster()
        assert (c.infer_per_sample_s == pytest.approx(0.5e-3)) == (k == SCORING_WINDOW - 1)
    assert len(p.scoring) == SCORING_WINDOW


def test_the_scoring_fit_keeps_both_costs_non_negative():
    assert fit_scoring([]) is None
    # every sample equally long: samples and tokens cannot be told apart, all per token
    assert fit_scoring([(4, 40, 0.01), (2, 20, 0.005)]) == (0.0, pytest.approx(0.01 / 40))
    # dearer calls with fewer tokens: no cost per token
    per_sample, per_token = fit_scoring([(4, 40, 0.012), (4, 80, 0.008)])
    assert per_token == 0.0 and per_sample == pytest.approx(0.02 / 8)
    # a call's cost all per token: no cost per sample
    per_sample, per_token = fit_scoring([(4, 40, 0.004), (4, 80, 0.008), (1, 30, 0.003)])
    assert per_sample == pytest.approx(0.0, abs=1e-12) and per_token == pytest.approx(1e-4)
    # no tokens at all (empty prompts and responses): per sample
    assert fit_scoring([(4, 0, 0.008)]) == (pytest.approx(0.002), 0.0)


def test_a_choice_that_holds_is_swept_ever_more_rarely_and_a_change_sweeps_again():
    """A sweep costs about a hundred simulated rollouts on the rollout's critical path: while
    it keeps choosing the R_t in use, the iterations between sweeps double up to REPLAN_MAX;
    one that moves R_t sets them back to one."""
    steps = [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 16, 24)] * 3
    p = RtPlanner(48, 2, bs_max=64)

    def feed(lengths):
        p.dist = None
        p.observe(lengths, SimpleNamespace(steps=steps), [(8, 1000, 0.02)] * 4, prompt_len=10)

    feed([10] * 40 + [250] * 8)
    swept_at = []
    for i in range(20):
        before = p.sweeps
        rt = p.rt()
        assert rt > 0
        if p.sweeps > before:
            swept_at.append(i)
    assert swept_at == [0, 1, 3, 7, 15]       # intervals 1, 1, 2, 4, 8
    assert REPLAN_MAX == 8 and p.history == [p.history[0]] * 20
    feed([30] * 48)                           # the tail is gone: the next sweep says 0
    got = [p.rt() for _ in range(10)]
    assert got[:3] == [rt] * 3 and got[3] == 0, got   # the sweep due at iteration 23
    assert p.sweeps == 5 + 3                   # 23, then 24 (interval one), then 26


def test_a_checkpoint_keeps_the_sweep_schedule_and_the_prefill_fit():
    """A resumed run decides as the uninterrupted one would: the prefills fitted so far and
    where the sweep schedule stands travel with the planner's observations."""
    from rlhf_fusion.loop.checkpoint import load_worker_state, worker_state

    steps = [(64, 0.020)] + [(b, 0.002 + 0.0001 * b) for b in (40, 24, 16, 8, 4, 2, 1)]
    backend = SimpleNamespace(steps=steps, prefill_steps={0}, prefills=[(64, 0.020)])

    def worker(p):
        return SimpleNamespace(rt_planner=p, iteration_index=4, world=1, rank=0,
                               training_modules=dict, optimizers={})

    p = RtPlanner(48, 2, bs_max=64)
    p.observe([10] * 40 + [250] * 8, backend, [(8, 1000, 0.02)] * 4, prompt_len=10)
    for _ in range(4):
        p.rt()                                  # swept at 0, 1 and 3: the next at 7
    q = RtPlanner(48, 2, bs_max=64)
    load_worker_state(worker(q), worker_state(worker(p), []))
    assert q.prefills == p.prefills and q.cluster() == p.cluster()
    assert [q.rt() for _ in range(6)] == [p.rt() for _ in range(6)]
    assert q.sweeps == p.sweeps == 4


def test_sweeps_cost_at_most_their_budget_of_the_rollout_time(monkeypatch):
    """A sweep is on the rollout's critical path: with a rollout time observed, the iterations
    between sweeps grow until the sweeps take at most SWEEP_BUDGET of the rollouts' time
    (capped at SWEEP_INTERVAL_MAX), whatever the doubling rule says."""
    from rlhf_fusion.rollout import rt_control

    steps = [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 16, 24)] * 3

    def planner(sweep_s: float, rollout_s: float | None) -> list[int]:
        clock = iter(x * sweep_s for x in range(10_000))   # every sweep takes sweep_s
        monkeypatch.setattr(rt_control, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        p = RtPlanner(48, 2, bs_max=64)
        p.observe([10] * 40 + [250] * 8, SimpleNamespace(steps=steps), [(8, 1000, 0.02)] * 4,
                  prompt_len=10, rollout_s=rollout_s)
        swept_at = []
        for i in range(140):
            before = p.sweeps
            assert p.rt() > 0
            if p.sweeps > before:
                swept_at.append(i)
            # what the loop logs as time/rt_sweep: the sweep's seconds, 0 between sweeps
            assert p.last_sweep_s == pytest.approx(sweep_s if p.sweeps > before else 0.0)
        return swept_at

    # 50 ms sweeps against 100 ms rollouts: one sweep per 25 rollouts is 2% of their time.
    assert rt_control.SWEEP_BUDGET == 0.02
    assert planner(0.05, 0.1) == [0, 25, 50, 75, 100, 125]
    # a sweep that costs more than SWEEP_INTERVAL_MAX rollouts' budget: once per the cap
    assert planner(1.0, 0.1) == [0, 64, 128]
    # cheap sweeps, or no rollout time reported: the doubling rule alone
    assert planner(1e-6, 10.0)[:6] == planner(0.05, None)[:6] == [0, 1, 3, 7, 15, 23]


def test_a_checkpoint_keeps_the_scoring_fit_and_drops_an_older_format():
    """The resumed planner prices scoring as the saved one did (through torch.save and a
    weights-only load, as Lightning reads checkpoints); a checkpoint from before the cost per
    sample, (tokens, seconds) per batch, leaves the window empty for the next batches."""
    import io

    from rlhf_fusion.loop.checkpoint import load_worker_state, worker_state

    def worker(planner):
        return SimpleNamespace(rt_planner=planner, iteration_index=2, world=1, rank=0,
                               optimizers={}, training_modules=dict)

    backend = SimpleNamespace(steps=[(8, 0.002), (4, 0.0015)])
    lengths = [3 + k % 11 for k in range(64)]
    saved = RtPlanner(64, 2, bs_max=64)
    for _ in range(2):
        saved.observe(lengths, backend, _calls(lengths, 1e-3, 4e-6), prompt_len=6)
    buf = io.BytesIO()
    torch.save(worker_state(worker(saved), []), buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    resumed = RtPlanner(64, 2, bs_max=64)
    load_worker_state(worker(resumed), ck)
    assert resumed.scoring == saved.scoring
    assert resumed.cluster() == saved.cluster()
    assert resumed.cluster().infer_per_sample_s == pytest.approx(1e-3)

    ck["rt_planner"]["scoring"] = [[1000, 0.01], [900, 0.01]]
    old = RtPlanner(64, 2, bs_max=64)
    load_worker_state(worker(old), ck)
    assert old.scoring == []
