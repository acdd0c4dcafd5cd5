"""Groups in R_t's simulator (rollout/planning/groups.py): a group is ready when its last
sample is scored; serial computes group advantages after all scoring, fused as groups
complete; with no advantage cost the times are the per-sample simulator's."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_fusion.rollout.planning.groups import group_index, group_ready_times, simulate_groups
from rlhf_fusion.rollout.planning.simulate import (
    ClusterModel,
    serial_scored_at,
    simulate_fused,
    simulate_serial,
)
from rlhf_fusion.rollout.types import RolloutConfigError

C = ClusterModel(instances=4, bs_max=16, step_base_s=0.01, step_per_sample_s=1e-4,
                 step_per_kv_token_s=1e-7, prefill_per_token_s=1e-5, infer_per_token_s=2e-4,
                 prompt_len=64)


def lengths(seed: int, samples: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(4.0, 0.9, samples).astype(int))


def test_group_index_and_ready_times():
    assert group_index(6, 3) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(RolloutConfigError, match="divide the batch"):
        group_index(7, 3)
    assert group_ready_times({0: 1.0, 1: 5.0, 2: 2.0, 3: 0.5}, [0, 0, 1, 1]) == {0: 5.0, 1: 2.0}
    with pytest.raises(RolloutConfigError, match="sample 3 .group 1. has no scoring time"):
        group_ready_times({0: 1.0, 1: 5.0, 2: 2.0}, [0, 0, 1, 1])


@pytest.mark.parametrize("seed", range(3))
def test_without_an_advantage_cost_the_times_are_the_per_sample_simulators(seed):
    ls = lengths(seed)
    total, _, _ = simulate_serial(ls, C)
    assert max(serial_scored_at(ls, C).values()) == pytest.approx(total)
    g = simulate_groups(ls, C, rt=16, n=8)
    res = simulate_fused(ls, C, 16)
    assert g.serial_s == pytest.approx(total) and g.fused_s == res.fused_s
    for group, t in g.fused_ready.items():   # ready exactly when its slowest sample is scored
        assert t == max(res.scored_at[i] for i in range(group * 8, group * 8 + 8))


def test_a_long_sample_holds_its_group_back_and_the_rest_are_computed_under_the_tail():
    ls = np.full(64, 20)
    ls[5] = 400   # the tail: one sample of group 0
    g = simulate_groups(ls, C, rt=4, n=8, advantage_s=0.01)
    assert max(g.fused_ready, key=g.fused_ready.get) == 0
    assert g.groups_ready_during_generation == 7
    # serial: all 8 groups' advantages after all scoring; fused: only group 0's is left at
    # the end, the other 7 were computed while group 0's tail decoded
    serial_total = simulate_serial(ls, C)[0]
    assert g.serial_s == pytest.approx(serial_total + 8 * 0.01)
    fused = simulate_fused(ls, C, 4)
    assert g.fused_s == pytest.approx(max(fused.fused_s, g.fused_ready[0] + 0.01))
