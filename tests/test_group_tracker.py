"""GroupTracker: scored samples in any order (as inter-stage fusion streams them), a group's
advantages the moment its last sample is scored, and the batch equal bit for bit to the
whole-batch functions (the serial order); every sample exactly once."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_fusion.algorithms import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlhf_fusion.algorithms.groups import GroupTracker, index_of

CASES = [("grpo", "group"), ("grpo", "none"), ("grpo", "batch"), ("rloo", "group"),
         ("reinforce_pp_baseline", "group"), ("reinforce_pp", "group")]


def batch(seed: int, prompts: int = 12, n: int = 8, r: int = 10):
    """``prompts`` groups of ``n`` in the loop's order (prompt p: positions p*n .. p*n+n-1),
    scores with ties (a 0/1 correctness reward on some groups), ragged masks."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.arange(prompts).repeat_interleave(n) * 7 + 3
    scores = torch.randn(prompts * n, generator=gen, dtype=torch.float64)
    binary = torch.randint(0, 2, (prompts * n,), generator=gen).to(torch.float64)
    scores = torch.where(index % 2 == 1, binary, scores)   # every other group 0/1 rewards
    scores[:n] = 1.0                                         # a group with all rewards equal
    lengths = torch.randint(1, r + 1, (prompts * n,), generator=gen)
    mask = (torch.arange(r)[None, :] < lengths[:, None]).to(torch.float64)
    token_rewards = torch.randn(prompts * n, r, generator=gen, dtype=torch.float64) * mask
    return index, scores, mask, token_rewards


def serial(algorithm, scale, index, scores, mask, token_rewards):
    if algorithm == "grpo":
        return grpo_advantages(scores, index, mask, scale_rewards=scale)
    if algorithm == "rloo":
        return rloo_advantages(scores, index, mask)
    if algorithm == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(scores, index, mask)
    return reinforce_pp_advantages(token_rewards, mask)


def stream(algorithm, scale, index, scores, mask, token_rewards, order):
    t = GroupTracker(index.tolist(), algorithm, scale_rewards=scale)
    done = []
    for pos in order:
        g = t.add(pos, float(scores[pos]))
        if g is not None:
            done.append(g)
    return t, done, t.finish(mask, token_rewards)


@pytest.mark.parametrize(("algorithm", "scale"), CASES)
@pytest.mark.parametrize("seed", range(3))
def test_any_arrival_order_equals_the_serial_batch_exactly(algorithm, scale, seed):
    index, scores, mask, tr = batch(seed)
    want_adv, want_ret = serial(algorithm, scale, index, scores, mask, tr)
    order = list(range(len(index)))
    in_order = stream(algorithm, scale, index, scores, mask, tr, order)[2]
    random.Random(seed).shuffle(order)
    t, done, (adv, ret) = stream(algorithm, scale, index, scores, mask, tr, order)
    for got in (in_order, (adv, ret)):
        assert torch.equal(got[0], want_adv) and torch.equal(got[1], want_ret)
    # each group reported once, when its last sample arrived, with final advantages where
    # the algorithm's are group-local
    assert sorted(d.group for d in done) == sorted(set(index.tolist()))
    seen = set()
    for d in done:
        last = max(order.index(p) for p in d.positions)
        assert all(p in seen or order.index(p) <= last for p in d.positions)
        seen |= set(d.positions)
        if d.advantages is not None:
            assert algorithm in ("grpo", "rloo") and scale != "batch"
            # every response has its first token (lengths >= 1): column 0 is the advantage
            assert list(d.advantages) == want_adv[list(d.positions), 0].tolist()
        else:
            assert algorithm.startswith("reinforce") or scale == "batch"


def test_a_group_is_final_before_the_tail_arrives():
    # 3 groups of 4; the tail sample of group 0 arrives last: groups 1 and 2 are done before
    index = [0] * 4 + [1] * 4 + [2] * 4
    t = GroupTracker(index, "grpo")
    order = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0]
    out = [t.add(p, float(p % 3)) for p in order]
    assert [o.group for o in out if o is not None] == [1, 2, 0]
    assert out[-1] is not None and out[-1].positions == (0, 1, 2, 3)


def test_every_sample_exactly_once():
    t = GroupTracker([0, 0, 1, 1], "rloo")
    t.add(0, 1.0)
    with pytest.raises(ValueError, match="scored twice"):
        t.add(0, 1.0)
    with pytest.raises(KeyError, match="not in the batch"):
        t.add(4, 0.0)
    with pytest.raises(ValueError, match="3 samples not scored yet"):
        t.finish(torch.ones(4, 2))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        GroupTracker([0], "ppo")
    assert index_of({5: [1, 2], 9: [0, 3]}, 4) == [9, 5, 5, 9]
    with pytest.raises(ValueError, match="position 3 is in no group"):
        index_of({5: [0, 1, 2]}, 4)
    with pytest.raises(ValueError, match="is in groups 5 and 6"):
        index_of({5: [0, 1], 6: [1]}, 2)
