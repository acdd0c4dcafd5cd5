"""PPO losses and micro-batching (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_fusion.runtime.engine import clip_grad_norm_
from rlhf_fusion.runtime.microbatch import split_micro_batches
from rlhf_fusion.runtime.ppo import (
    PPOConfig,
    kl_estimate,
    kl_penalized_rewards,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    value_loss,
    values_from_head,
)


def _mask():
    return torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])


def test_policy_loss_on_policy_is_minus_mean_advantage():
    lp = torch.randn(2, 5)
    adv = torch.randn(2, 5)
    loss, stats = policy_loss(lp, lp.clone(), adv, _mask())
    assert loss.item() == pytest.approx(-masked_mean(adv, _mask()).item(), abs=1e-6)
    assert stats["clip_frac"].item() == 0.0


def test_policy_loss_clips_the_ratio():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    lp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = policy_loss(lp, old, adv, mask, cliprange=0.2)
    # Both tokens are outside [0.8, 1.2] on the side the advantage pushes: clipped, no gradient.
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 0.8 * -1.0) / 2)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 2))
    assert stats["clip_frac"].item() == 1.0
    # On the other side the unclipped (pessimistic) term is kept and has a gradient.
    lp2 = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss2, _ = policy_loss(lp2, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert loss2.item() == pytest.approx(-0.5)
    loss2.backward()
    assert lp2.grad.item() == pytest.approx(-0.5)


def test_kl_in_loss_or_in_reward():
    lp, ref, adv, mask = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5), _mask()
    base, _ = policy_loss(lp, lp, adv, mask, ref_logprobs=ref, kl_mode="reward", kl_coef=0.5,
                          kl_estimator="k3")
    with_kl, stats = policy_loss(lp, lp, adv, mask, ref_logprobs=ref, kl_mode="loss", kl_coef=0.5,
                                 kl_estimator="k3")   # the default is the loop's k1
    kl = masked_mean(kl_estimate(lp, ref, "k3"), mask)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * kl.item(), abs=1e-6)
    assert stats["kl"].item() == pytest.approx(kl.item(), abs=1e-6)
    assert (kl_estimate(lp, ref, "k3") >= -1e-7).all()  # k3 is non-negative
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, adv, mask, kl_mode="loss", kl_coef=0.5)


def test_kl_penalized_rewards_put_the_score_on_the_last_action():
    mask = _mask()
    lp = torch.zeros(2, 5)
    r = kl_penalized_rewards(torch.tensor([3.0, -1.0]), lp, lp, mask, kl_coef=0.1)
    assert r.tolist() == [[0, 0, 0, 3.0, 0], [0, 0, 0, 0, -1.0]]
    r2 = kl_penalized_rewards(torch.zeros(2), lp, lp - 1.0, mask, kl_coef=0.1, estimator="k1")
    assert torch.allclose(r2, -0.1 * mask.float())


def test_value_loss_clipping():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    ret = torch.tensor([[1.0, 1.0]])
    v = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = value_loss(v, old, ret, mask, cliprange_value=0.2)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64 ; token 1: max((2-1)^2, (0.2-1)^2) = 1
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    unclipped, _ = value_loss(v, old, ret, mask, cliprange_value=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 1.0) / 2)


def test_alignment_helpers():
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    lp = logprobs_from_logits(logits, ids)
    assert lp.shape == (2, 4) and torch.equal(lp[:, 0], torch.zeros(2))
    want = torch.log_softmax(logits[1, 2], -1)[ids[1, 3]]
    assert lp[1, 3].item() == pytest.approx(want.item(), abs=1e-6)
    v = values_from_head(torch.arange(8.0).view(2, 4))
    assert v.tolist() == [[0, 0, 1, 2], [0, 4, 5, 6]]


def test_split_micro_batches_trims_each_micro_batch():
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    batch = {
        "input_ids": torch.arange(20).view(4, 5),
        "attention_mask": mask,
        "scores": torch.arange(4.0),
        "advantages": torch.ones(4, 5),
    }
    a, b = split_micro_batches(batch, 2)
    assert a["input_ids"].shape == (2, 2) and b["input_ids"].shape == (2, 4)
    assert a["advantages"].shape == (2, 2) and b["scores"].tolist() == [2.0, 3.0]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 2]]
    with pytest.raises(ValueError, match="multiple of the number of micro-batches"):
        split_micro_batches(batch, 3)
    with pytest.raises(KeyError, match="attention_mask"):
        split_micro_batches({"input_ids": batch["input_ids"]}, 2)


def test_ppo_config_validation():
    with pytest.raises(ValueError, match="kl_mode"):
        PPOConfig(kl_mode="both")
    with pytest.raises(ValueError, match="micro_batches"):
        PPOConfig(micro_batches=0)
    assert PPOConfig().to_dict()["cliprange"] == 0.2


def _params_with_grads(seed: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,), (6, 6)]
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
        if i != 3:  # one parameter without a gradient: skipped by both
            p.grad = torch.randn(shape, generator=gen, dtype=dtype) * (i + 1)
        params.append(p)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.9, 2.0, None])
def test_clip_grad_norm_matches_torch(fraction, dtype):
    """max_norm is a fraction of the true norm: below 1 clips, 2.0 does not, None only measures."""
    ours = _params_with_grads(0, dtype)
    theirs = _params_with_grads(0, dtype)
    before = [None if p.grad is None else p.grad.clone() for p in ours]
    true_norm = math.sqrt(sum(float(g.double().square().sum()) for g in before if g is not None))
    max_norm = None if fraction is None else fraction * true_norm
    norm = clip_grad_norm_(ours, max_norm)
    # torch has no "measure only": an infinite max_norm never clips
    want = torch.nn.utils.clip_grad_norm_(theirs, math.inf if max_norm is None else max_norm)
    assert norm == pytest.approx(float(want), rel=1e-6, abs=1e-6)
    for p, q, g0 in zip(ours, theirs, before, strict=True):
        if g0 is None:
            assert p.grad is None and q.grad is None
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
        if fraction is None or fraction > 1:
            assert torch.equal(p.grad, g0), (
                "a norm within the limit must leave gradients as they are"
            )
    if fraction is not None and fraction < 1:
        clipped = math.sqrt(
            sum(float(p.grad.double().square().sum()) for p in ours if p.grad is not None)
        )
        assert clipped == pytest.approx(max_norm, rel=1e-5, abs=1e-6)


def test_old_keyword_names_still_work_with_a_deprecation_warning():
    """``clip_eps``/``value_clip_eps`` were the runtime's names before it took the loop's
    (``cliprange``/``cliprange_value``); they still work for one release."""
    with pytest.warns(DeprecationWarning, match="clip_eps is deprecated; use cliprange"):
        old = PPOConfig(clip_eps=0.1, micro_batches=2)
    with pytest.warns(DeprecationWarning, match="value_clip_eps is deprecated"):
        assert PPOConfig(value_clip_eps=None).cliprange_value is None
    assert old == PPOConfig(cliprange=0.1, micro_batches=2)
    with pytest.warns(DeprecationWarning):
        assert old.clip_eps == 0.1
    with pytest.raises(TypeError, match="give cliprange only"):
        PPOConfig(clip_eps=0.1, cliprange=0.2)
    d = PPOConfig().to_dict()
    assert (d["cliprange"], d["cliprange_value"], d["kl_coef"], d["kl_estimator"]) == (
        0.2, 0.2, 0.05, "k1")   # the loop's defaults (loop/config.py:PPOLoopConfig)
    lp, old_lp, adv, mask = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5), _mask()
    with pytest.warns(DeprecationWarning, match="policy_loss: clip_eps"):
        a, _ = policy_loss(lp, old_lp, adv, mask, clip_eps=0.1)
    assert torch.equal(a, policy_loss(lp, old_lp, adv, mask, cliprange=0.1)[0])
    with pytest.warns(DeprecationWarning, match="value_loss: clip_eps"):
        v, _ = value_loss(lp, old_lp, adv, mask, clip_eps=None)
    assert torch.equal(v, value_loss(lp, old_lp, adv, mask, cliprange_value=None)[0])
    with pytest.raises(TypeError, match="unexpected"):
        policy_loss(lp, old_lp, adv, mask, clip=0.1)
