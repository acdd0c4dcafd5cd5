"""SampleSpec's checks and conversions, and the loop's group specs built from one checked spec."""

import numpy as np
import pytest

from rlhf_fusion.loop.critic_free import group_specs
from rlhf_fusion.loop.demo_grpo import grpo_demo_config
from rlhf_fusion.rollout import RolloutConfigError, SampleSpec


@pytest.mark.parametrize(("fields", "match"), [
    ({"sample_id": -1}, "sample_id must be >= 0"),
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"max_new_tokens": 0}, "max_new_tokens=0; it must be >= 1"),
    ({"generated_ids": [1, 2], "logprobs": [0.1]}, "2 generated_ids but 1 logprobs"),
    ({"generated_ids": [1, 2], "logprobs": [0.1, 0.2], "max_new_tokens": 2},
     "already has 2 of max_new_tokens=2"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
])
def test_a_bad_field_is_refused_by_name(fields, match):
    kw = {"sample_id": 3, "prompt_ids": [1], "max_new_tokens": 4, **fields}
    with pytest.raises(RolloutConfigError, match=match) as e:
        SampleSpec(**kw)
    assert f"SampleSpec(sample_id={kw['sample_id']})" in str(e.value)


def test_sequences_become_tuples_of_python_numbers():
    s = SampleSpec(0, np.array([5, 6]), 4, stop_token_ids=[np.int64(2)],
                   generated_ids=(x for x in [7]), logprobs=[np.float32(-0.5)])
    assert (s.prompt_ids, s.generated_ids, s.stop_token_ids, s.logprobs) == ((5, 6), (7,), (2,),
                                                                             (-0.5,))
    for t in (*s.prompt_ids, *s.generated_ids, *s.stop_token_ids):
        assert type(t) is int
    assert type(s.logprobs[0]) is float


def test_group_specs_equal_specs_checked_one_by_one():
    cfg = grpo_demo_config()
    prompts = [[4, 5, 6], np.array([7, 8]), (9,)]
    got = group_specs(prompts, 3, iteration=2, cfg=cfg, eos=1)
    g = cfg.generation
    want = [SampleSpec(p * 3 + k, list(ids), g.max_new_tokens, seed=g.seed * 1_000_003 + 2,
                       temperature=g.temperature, stop_token_ids=[1])
            for p, ids in enumerate(prompts) for k in range(3)]
    assert got == want
    assert [s.__dict__ for s in got] == [s.__dict__ for s in want]
    assert [type(t) for s in got for t in s.prompt_ids] == [int] * 18
