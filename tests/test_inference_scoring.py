"""InferenceModels scores a micro-batch's response positions at once: each sample's numbers must
be those of that sample scored alone (the model run on it unpadded), whatever its peers."""

import pytest
import torch


def _models(values: bool):
    from rlhf_fusion.rollout.inference import InferenceModels
    from rlhf_fusion.testing import build_causal_lm, build_value_model, tiny_config

    cfg = tiny_config(vocab_size=32, hidden_size=32, layers=1, heads=4, kv_heads=2)
    ref = build_causal_lm(cfg, 2)
    if values:
        return InferenceModels(ref, build_value_model(cfg, 3), build_value_model(cfg, 4),
                               micro_batch=3)
    return InferenceModels(ref, lambda p, r: float(sum(r) - len(p)), None, micro_batch=3,
                           values=False)


def _samples():
    from rlhf_fusion.rollout.types import SampleResult

    # ragged prompts and responses, one empty response
    return [SampleResult(i, tuple(range(1, 2 + i % 4)), tuple((5 + 3 * i + k) % 32
                                                             for k in range(i % 6)),
                         tuple(-0.25 * k for k in range(i % 6)), "stop") for i in range(8)]


@pytest.mark.parametrize("values", [True, False])
def test_each_sample_scores_as_it_would_alone(values):
    models = _models(values)
    samples = _samples()
    batched = models.score(samples)
    for s, e in zip(samples, batched, strict=True):
        ids = torch.tensor([list(s.prompt_ids) + list(s.token_ids)])
        mask = torch.ones_like(ids)
        p, g = len(s.prompt_ids), len(s.token_ids)
        with torch.no_grad():
            logits = models.ref(input_ids=ids, attention_mask=mask, use_cache=False).logits[0]
            want = torch.log_softmax(logits[p - 1: p - 1 + g], -1).gather(
                1, torch.tensor(s.token_ids, dtype=torch.long)[:, None])[:, 0]
            assert e.ref_logprobs.shape == (g,) and e.ref_logprobs.dtype == torch.float64
            torch.testing.assert_close(e.ref_logprobs, want, rtol=0, atol=1e-12)
            assert e.logprobs.tolist() == list(s.logprobs)
            if values:
                torch.testing.assert_close(e.values, models.critic(ids, mask)[0, p - 1: p - 1 + g],
                                           rtol=0, atol=1e-12)
                assert e.reward == pytest.approx(float(models.reward(ids, mask)[0, p + g - 1]),
                                                 abs=1e-12)
            else:
                assert torch.equal(e.values, torch.zeros(g, dtype=torch.float64))
                assert e.reward == float(sum(s.token_ids) - p)


def _per_sample(models, samples):
    """The per-sample post-processing the batched one replaced, on the same forward."""
    seqs = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
    with torch.no_grad():
        logits = models.ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        rewards, values = models.reward(ids, mask), models.critic(ids, mask)
    out = []
    for i, s in enumerate(samples):
        p, g = len(s.prompt_ids), len(s.token_ids)
        rows = logits[i, p - 1: p - 1 + g].to(torch.float64)
        tok = torch.as_tensor(s.token_ids, dtype=torch.long)
        out.append((torch.log_softmax(rows, dim=-1).gather(1, tok[:, None])[:, 0],
                    values[i, p - 1: p - 1 + g].to(torch.float64), float(rewards[i, p + g - 1])))
    return out


def test_the_batched_post_processing_equals_the_per_sample_one_bit_for_bit():
    models = _models(True)
    samples = _samples()
    for k in range(0, len(samples), models.micro_batch):
        mb = samples[k: k + models.micro_batch]
        for e, (ref, values, reward) in zip(models.score(mb), _per_sample(models, mb),
                                            strict=True):
            assert torch.equal(e.ref_logprobs, ref) and torch.equal(e.values, values)
            assert e.reward == reward


def test_peers_change_a_sample_s_numbers_by_float64_rounding_at_most():
    # The forward of a padded micro-batch may round differently with other peers.
    models = _models(True)
    samples = _samples()
    alone = {e.sample_id: e for s in samples for e in models.score([s])}
    for e in models.score(samples[::-1]):
        a = alone[e.sample_id]
        torch.testing.assert_close(e.ref_logprobs, a.ref_logprobs, rtol=0, atol=1e-12)
        torch.testing.assert_close(e.values, a.values, rtol=0, atol=1e-12)
        assert e.reward == pytest.approx(a.reward, abs=1e-12)


def test_an_empty_prompt_is_refused_by_name():
    from rlhf_fusion.rollout.types import SampleResult

    with pytest.raises(ValueError, match=r"samples \[7\] have empty prompts"):
        _models(False).score([SampleResult(7, (), (3, 4), (-1.0, -1.0), "stop")])
