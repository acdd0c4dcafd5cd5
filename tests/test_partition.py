"""Stage partitioning: chained stages reproduce the unpartitioned model exactly."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlhf_fusion.runtime.errors import PartitionError  # noqa: E402
from rlhf_fusion.runtime.microbatch import split_micro_batches  # noqa: E402
from rlhf_fusion.runtime.partition import (  # noqa: E402
    CriticModel,
    Dropped,
    num_layers,
    partition_,
    split_layers,
)


def _llama(layers=4, tie=False):
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return cfg


def _qwen2(layers=4):
    return transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _gpt2(layers=4):
    return transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _batch(rows=4, seq=11, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    return split_micro_batches({"input_ids": ids, "attention_mask": mask}, 1)[0]


def _actor(cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def _critic(cfg):
    torch.manual_seed(1)
    return CriticModel.from_config(cfg).float()


def _full_out(model, role, mb):
    if role == "actor":
        return model(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            use_cache=False,
        ).logits
    return model(mb["input_ids"], mb["attention_mask"], mb["position_ids"])


def _chain(model, role, num_stages, layers, mb):
    stages = [
        partition_(copy.deepcopy(model), role, s, num_stages, layers) for s in range(num_stages)
    ]
    h, ins, outs = None, [], []
    for st in stages:
        if h is not None:
            h = h.detach().requires_grad_(True)
        ins.append(h)
        out = st(h, mb)
        outs.append(out)
        h = out
    return stages, ins, outs


@pytest.mark.parametrize(
    "make_cfg, role, num_stages, layers",
    [
        (_llama, "actor", 2, None),
        (_llama, "actor", 4, None),
        (_llama, "critic", 3, [1, 0, 3]),
        (lambda: _llama(tie=True), "actor", 2, [3, 1]),
        (_qwen2, "actor", 2, None),
        (_qwen2, "critic", 2, None),
        (_gpt2, "actor", 3, None),
        (_gpt2, "critic", 2, [1, 3]),
    ],
)
def test_chained_stages_match_full_model(make_cfg, role, num_stages, layers):
    cfg = make_cfg()
    model = _actor(cfg) if role == "actor" else _critic(cfg)
    mb = _batch()
    ref = _full_out(model, role, mb)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    stages, ins, outs = _chain(model, role, num_stages, layers, mb)
    assert torch.equal(outs[-1], ref), "pipelined forward must be bit-identical"
    # Backward stage by stage, passing the input gradient upstream like the runtime does.
    grad = None
    for s in reversed(range(num_stages)):
        if s == num_stages - 1:
            (outs[s] * w).sum().backward()
        else:
            torch.autograd.backward(outs[s], grad)
        grad = ins[s].grad if ins[s] is not None else None
    got: dict[str, torch.Tensor] = {}
    for st in stages:
        for n, p in st.named_parameters():
            if p.grad is None:
                continue
            got[n] = got[n] + p.grad if n in got and st.tied else p.grad
    # A tied embedding/head weight is held by the first and last stage under two names; the
    # runtime sums their gradients, so do the same here.
    if stages[0].tied:
        emb_name = next(n for n, p in stages[0].named_parameters() if p is stages[0].tied_weight())
        head_name = next(
            n for n, p in stages[-1].named_parameters() if p is stages[-1].tied_weight()
        )
        total = stages[0].tied_weight().grad + stages[-1].tied_weight().grad
        got[emb_name] = total
        got.pop(head_name, None)
    assert set(got) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_each_stage_keeps_only_its_parameters_under_original_names():
    cfg = _llama(layers=4)
    model = _actor(cfg)
    full = dict(model.named_parameters())
    st = partition_(copy.deepcopy(model), "actor", 1, 2)
    names = [n for n, _ in st.named_parameters()]
    assert names and all(n in full for n in names)
    assert all(
        n.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head")) for n in names
    )
    assert "model.embed_tokens.weight" not in names
    assert isinstance(st.module.model.layers[0], Dropped)
    first = partition_(copy.deepcopy(model), "actor", 0, 2)
    assert {n.split(".")[1] for n, _ in first.named_parameters()} == {"embed_tokens", "layers"}
    with pytest.raises(RuntimeError, match="not on pipeline stage 0"):
        first.module.lm_head(torch.zeros(1, 32))


def test_tied_weights_detected_only_across_stages():
    model = _actor(_gpt2())
    assert partition_(copy.deepcopy(model), "actor", 0, 2).tied
    assert not partition_(copy.deepcopy(model), "actor", 0, 1).tied
    assert not partition_(copy.deepcopy(_actor(_llama())), "actor", 0, 2).tied


def test_split_layers_and_errors():
    assert [len(r) for r in split_layers(5, 2)] == [3, 2]
    assert [list(r) for r in split_layers(4, 2, [1, 3])] == [[0], [1, 2, 3]]
    with pytest.raises(PartitionError, match="sum to"):
        split_layers(4, 2, [1, 1])
    with pytest.raises(PartitionError, match="one layer count per stage"):
        split_layers(4, 2, [4])
    with pytest.raises(PartitionError, match="at least 3"):
        split_layers(2, 3)
    with pytest.raises(PartitionError, match="CriticModel"):
        partition_(_actor(_llama()), "critic", 0, 2)
    with pytest.raises(PartitionError, match="not supported"):
        partition_(torch.nn.Linear(2, 2), "actor", 0, 2)
    assert num_layers(_critic(_gpt2(layers=3)), "critic") == 3


@pytest.mark.parametrize("make_cfg", [_llama, _qwen2, _gpt2])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_stage_forwards_raise_no_future_warning(make_cfg, role):
    """The stages call transformers' mask builders and decoder layers as its current API
    wants: no FutureWarning (transformers deprecates ``past_key_values`` for ``cache``,
    removed in 5.40) and no DeprecationWarning, as errors here."""
    import warnings

    cfg = make_cfg()
    model = _actor(cfg) if role == "actor" else _critic(cfg)
    mb = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        ref = _full_out(model, role, mb)
        _, _, outs = _chain(model, role, 2, None, mb)
    assert torch.equal(outs[-1], ref)
