"""Experiences cross processes in every rollout's all-gather; pickled, they must come back
bit for bit, with their dtypes, whichever form the tensors travel in."""

from __future__ import annotations

import pickle

import torch

from rlhf_fusion.rollout.inference import Experience


def make(dtype: torch.dtype) -> Experience:
    g = torch.Generator().manual_seed(0)
    return Experience(3, (1, 2), (4, 5, 6), "stop", torch.randn(3, generator=g).to(dtype),
                      torch.randn(3, generator=g).to(dtype), torch.zeros(3, dtype=dtype), 0.25)


def test_experiences_round_trip_bit_for_bit_in_every_dtype():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        e = make(dtype)
        f = pickle.loads(pickle.dumps(e))
        for k in ("logprobs", "ref_logprobs", "values"):
            a, b = getattr(e, k), getattr(f, k)
            assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and torch.equal(a, b)
        assert (f.sample_id, f.prompt_ids, f.response_ids, f.finish_reason, f.reward) == \
            (e.sample_id, e.prompt_ids, e.response_ids, e.finish_reason, e.reward)
        f.logprobs += 1   # writable, and not shared with the sender's tensor
        assert not torch.equal(f.logprobs, e.logprobs)


def test_the_numpy_form_is_what_makes_it_cheap():
    e = make(torch.float64)
    state = e.__getstate__()
    assert all(not isinstance(state[k], torch.Tensor) for k in ("logprobs", "ref_logprobs"))
    assert len(pickle.dumps([e] * 1)) < len(pickle.dumps(e.__dict__))
