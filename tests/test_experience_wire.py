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


# -- the all-gather's columnar form (rollout.experience_wire) ------------------------------------

def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int64).tolist()


def _batch():
    from rlhf_fusion.rollout.types import SampleResult

    special = [-0.0, float("-inf"), 5e-324, -1.5, 1e308]
    results, exps = [], []
    for i, (p, g) in enumerate([(3, 0), (1, 4), (5, 2), (2, 5)]):
        lps = tuple(special[:g])
        # a backend may pass its spec's prompt on as a list
        prompt = list(range(p)) if i % 2 else tuple(range(p))
        results.append(SampleResult(10 + i, prompt, tuple(range(7, 7 + g)), lps,
                                    ("stop", "length", "abort")[i % 3], instance=i % 2,
                                    migrated=bool(i & 1)))
        gen = torch.Generator().manual_seed(i)
        exps.append(Experience(10 + i, prompt, tuple(range(7, 7 + g)),
                               ("stop", "length")[i % 2], torch.tensor(lps, dtype=torch.float64),
                               torch.randn(g, generator=gen, dtype=torch.float64),
                               torch.zeros(g, dtype=torch.float64), -0.0 if i == 0 else i / 3))
    return results, exps


def _same(a: Experience, b: Experience) -> bool:
    return ((a.sample_id, a.prompt_ids, a.response_ids, a.finish_reason)
            == (b.sample_id, b.prompt_ids, b.response_ids, b.finish_reason)
            and _bits(torch.tensor([a.reward], dtype=torch.float64))
            == _bits(torch.tensor([b.reward], dtype=torch.float64))
            and all(type(getattr(b, k)) is torch.Tensor and getattr(b, k).dtype == torch.float64
                    and _bits(getattr(a, k)) == _bits(getattr(b, k))
                    for k in ("logprobs", "ref_logprobs", "values")))


def test_the_packed_batch_comes_back_field_for_field_and_bit_for_bit():
    from rlhf_fusion.rollout.experience_wire import pack_batch, unpack_batch

    results, exps = _batch()
    p = pickle.loads(pickle.dumps(pack_batch(results, exps), protocol=pickle.HIGHEST_PROTOCOL))
    assert p.raw is None   # the columns, not the objects, travelled
    got_results, got_exps = unpack_batch(p)
    assert got_results == results   # equality covers ids, tokens and logprobs
    def kinds(s):
        return (s.instance, s.migrated, type(s), type(s.prompt_ids), type(s.token_ids),
                type(s.logprobs))

    assert [kinds(s) for s in got_results] == [kinds(s) for s in results]
    assert {type(s.prompt_ids) for s in got_results} == {list, tuple}
    assert [(type(e.prompt_ids), type(e.response_ids)) for e in got_exps] == \
        [(type(e.prompt_ids), type(e.response_ids)) for e in exps]
    assert [_bits(torch.tensor(s.logprobs, dtype=torch.float64)) for s in got_results] == \
        [_bits(torch.tensor(s.logprobs, dtype=torch.float64)) for s in results]
    assert all(_same(a, b) for a, b in zip(exps, got_exps, strict=True))
    got_exps[1].logprobs += 1   # writable, and only that sample's values move
    assert _same(exps[2], got_exps[2]) and not torch.equal(exps[1].logprobs, got_exps[1].logprobs)
    assert unpack_batch(pickle.loads(pickle.dumps(pack_batch(results, None)))) == (results, None)
    assert unpack_batch(pack_batch([], [])) == ([], [])


def test_what_does_not_fit_the_columns_travels_as_objects():
    from rlhf_fusion.rollout.experience_wire import pack_batch, unpack_batch
    from rlhf_fusion.rollout.types import SampleResult

    results, exps = _batch()
    for bad in ({"values": torch.zeros(4, dtype=torch.float32)},
                {"ref_logprobs": torch.zeros(4, 1, dtype=torch.float64)},
                {"reward": torch.tensor(0.5, dtype=torch.float64)},
                # checked once on the concatenation, not per tensor
                {"logprobs": torch.zeros(4, dtype=torch.float64, requires_grad=True)},
                {"values": torch.zeros(5, dtype=torch.float64)}):   # one per token, not 5
        odd = list(exps)
        odd[1] = Experience(**{**exps[1].__dict__, **bad})
        p = pickle.loads(pickle.dumps(pack_batch(results, odd)))
        assert p.raw is not None
        got_results, got_exps = unpack_batch(p)
        assert got_results == results
        k = next(iter(bad))
        assert type(getattr(got_exps[1], k)) is torch.Tensor
        assert getattr(got_exps[1], k).requires_grad == bad[k].requires_grad
        assert getattr(got_exps[1], k).dtype == bad[k].dtype
        assert getattr(got_exps[1], k).shape == bad[k].shape
    odd_results = list(results)
    odd_results[2] = SampleResult(**{**results[2].__dict__, "token_ids": range(7, 9)})
    p = pickle.loads(pickle.dumps(pack_batch(odd_results, exps)))
    assert p.raw is not None and unpack_batch(p)[0][2].token_ids == range(7, 9)


def test_a_scorer_s_own_experiences_fit_the_columns():
    # What InferenceModels.score returns (Ref, Reward, Critic; and critic-free, values=False)
    # must take the cheap path, or every rollout pays the objects' pickle again.
    from rlhf_fusion.rollout.experience_wire import pack_batch, unpack_batch
    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.rollout.types import SampleResult
    from rlhf_fusion.testing import build_causal_lm, build_value_model, tiny_config

    cfg = tiny_config(vocab_size=32, hidden_size=32, layers=1, heads=4, kv_heads=2)
    samples = [SampleResult(i, (1, 2, 3)[: 1 + i % 3], tuple(range(4, 4 + i % 5)),
                            tuple(-0.5 * k for k in range(i % 5)), "stop") for i in range(7)]
    for models in (InferenceModels(build_causal_lm(cfg, 2), build_value_model(cfg, 3),
                                   build_value_model(cfg, 4), micro_batch=3),
                   InferenceModels(build_causal_lm(cfg, 2), lambda p, r: float(len(r)), None,
                                   micro_batch=3, values=False)):
        exps = models.score(samples)
        p = pickle.loads(pickle.dumps(pack_batch(samples, exps)))
        assert p.raw is None
        got_samples, got = unpack_batch(p)
        assert got_samples == samples
        assert all(_same(a, b) for a, b in zip(exps, got, strict=True))
