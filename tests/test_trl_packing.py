"""Padding-free forward (``FusionConfig.padding_free``): packing, and TRL's numbers from it."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from rlhf_fusion.integrations.trl.fusion import FusionConfig  # noqa: E402
from rlhf_fusion.integrations.trl.packing import (  # noqa: E402
    attention_mask_for,
    completion_targets,
    first_fit_decreasing,
    pack,
    unpack,
)

PROMPT, COMPLETION = 6, 10
PROMPT_LENS = [6, 3, 4, 2, 5, 1, 6, 2]
COMPLETION_LENS = [10, 2, 1, 5, 3, 7, 0, 4]  # row 6: a masked (e.g. truncated) completion


def ragged_batch(vocab: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's layout: prompts left-padded to PROMPT, completions right-padded to COMPLETION."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (len(PROMPT_LENS), PROMPT + COMPLETION), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        mask[i, PROMPT - p: PROMPT + c] = 1
    ids[mask == 0] = 0  # the pad token
    return ids, mask


# -- packing ------------------------------------------------------------------------------------
def test_first_fit_decreasing_fills_bins_longest_first():
    assert first_fit_decreasing([3, 9, 0, 5, 2, 6], 10) == [[1], [5, 0], [3, 4]]
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([11], 10)


def test_pack_unpack_round_trip_and_mask_structure():
    ids, mask = ragged_batch()
    p = pack(ids, mask)
    b, t = ids.shape
    assert p.rows < b and p.capacity == t
    real = mask.bool()
    assert len(p.src) == int(real.sum())
    # Round trip: every real token comes back to its place, padding gets the fill value.
    back = unpack(p.input_ids.unsqueeze(-1).float(), p, fill=-1.0).squeeze(-1)
    assert torch.equal(back[real], ids[real].float())
    assert (back[~real] == -1).all()
    # Positions are the original columns; bins hold whole sequences in column order.
    cols = torch.arange(t).expand(b, t)
    assert torch.equal(unpack(p.position_ids.unsqueeze(-1), p).squeeze(-1)[real], cols[real])
    m = p.attention_mask[:, 0]
    for r in range(p.rows):
        seq = p.seq_ids[r].tolist()
        for i in range(t):
            for j in range(t):
                same = seq[i] == seq[j] and seq[i] >= 0
                want = (same and j <= i) or (i == j)  # padding: itself only
                assert bool(m[r, i, j]) == want, (r, i, j)
    assert m.any(-1).all()  # no empty softmax row


def test_unpack_is_differentiable():
    ids, mask = ragged_batch()
    p = pack(ids, mask)
    x = torch.randn(p.rows, p.capacity, requires_grad=True)
    unpack(x, p).sum().backward()
    want = torch.zeros(p.rows * p.capacity)
    want[p.dst] = 1
    assert torch.equal(x.grad.reshape(-1), want)


def test_completion_targets_refuse_a_token_predicted_from_padding():
    ids, mask = ragged_batch()
    t = completion_targets(pack(ids, mask), PROMPT)
    assert t is not None and len(t.out) == sum(COMPLETION_LENS)
    mask[1, :PROMPT] = 0  # an empty prompt: its first completion token follows padding
    assert completion_targets(pack(ids, mask), PROMPT) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_llama_honours_the_packed_mask_and_positions(attn):
    from rlhf_fusion.testing.trl import tiny_causal_lm

    model = tiny_causal_lm(30, seed=0)
    model.config._attn_implementation = attn
    ids, mask = ragged_batch()
    p = pack(ids, mask)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=p.input_ids, position_ids=p.position_ids,
                    attention_mask=attention_mask_for(p.attention_mask, attn,
                                                      torch.float32)).logits
    real = mask.bool()
    assert torch.allclose(unpack(got, p)[real], want[real], atol=1e-5, rtol=0)
    if attn == "eager":  # why the additive mask: eager adds a boolean mask as 0/1
        with torch.no_grad():
            wrong = model(input_ids=p.input_ids, position_ids=p.position_ids,
                          attention_mask=p.attention_mask).logits
        assert not torch.allclose(unpack(wrong, p)[real], want[real], atol=1e-3)


# -- TRL: the packed forward gives TRL's numbers ------------------------------------------------
@pytest.fixture(scope="module")
def trl_mod():
    return pytest.importorskip("trl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, trl_mod):
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-pf"), seed=0)


@pytest.fixture(scope="module")
def tailed_model_dir(tmp_path_factory, trl_mod):
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-pf-tail"), seed=1, eos_bias=1.5)


def make(algo, model, tmp_path, fusion, **overrides):
    import warnings

    from trl import GRPOConfig, RLOOConfig

    from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer
    from rlhf_fusion.integrations.trl.rloo import FusedRLOOTrainer
    from rlhf_fusion.testing.trl import (
        length_reward,
        tiny_prompt_dataset,
        tiny_tokenizer,
        vowel_reward,
    )

    cls, cfg = {"grpo": (FusedGRPOTrainer, GRPOConfig), "rloo": (FusedRLOOTrainer, RLOOConfig)}[algo]
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
              num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1e-2,
              beta=0.04, bf16=False, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              save_strategy="no", disable_tqdm=True)
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model, reward_funcs=[vowel_reward, length_reward],
                      args=cfg(**kw), train_dataset=tiny_prompt_dataset(None, 16),
                      processing_class=tiny_tokenizer(), fusion=fusion)
    trainer.model.train()
    return trainer


def count_forwards(monkeypatch, model, log):
    """Record the input shape of every forward of ``model`` (the instance's own forward)."""
    real = model.forward

    @functools.wraps(real)
    def forward(*args, **kwargs):
        log.append(tuple(kwargs["input_ids"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)


@pytest.mark.parametrize("algo,attn", [("grpo", "sdpa"), ("grpo", "eager"), ("rloo", "sdpa")])
def test_packed_logps_entropies_and_grads_equal_trls_padded_forward(algo, attn, model_dir,
                                                                    tmp_path, monkeypatch):
    trainer = make(algo, model_dir, tmp_path, FusionConfig())
    stock = trainer._stock
    model = trainer.model
    model.config._attn_implementation = attn
    ids, mask = ragged_batch(vocab=model.config.vocab_size)
    keep = mask[:, PROMPT:].bool()
    weights = torch.randn(ids.size(0), COMPLETION, generator=torch.Generator().manual_seed(1))

    def run(fn):
        model.zero_grad()
        lp, ent, _ = fn(trainer, model, ids, mask, COMPLETION, compute_entropy=True)
        ((lp * weights)[keep].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), ent, grads

    shapes: list = []
    count_forwards(monkeypatch, model, shapes)
    lp_s, ent_s, grads_s = run(stock._get_per_token_logps_and_entropies)
    assert shapes == [tuple(ids.shape)]
    shapes.clear()
    lp_p, ent_p, grads_p = run(type(trainer)._get_per_token_logps_and_entropies)
    assert len(shapes) == 1 and shapes[0][0] < ids.size(0)  # one forward, fewer rows

    assert lp_p.shape == lp_s.shape == (ids.size(0), COMPLETION)
    assert torch.allclose(lp_p[keep], lp_s[keep], atol=1e-5, rtol=0)
    assert torch.allclose(ent_p[keep], ent_s[keep], atol=1e-5, rtol=0)
    assert (lp_p[~keep] == 0).all() and (ent_p[~keep] == 0).all()
    assert set(grads_p) == set(grads_s) and grads_s
    for name, g in grads_s.items():
        assert torch.allclose(grads_p[name], g, atol=1e-5, rtol=0), name


def test_batch_size_chunks_the_packed_bins(model_dir, tmp_path, monkeypatch):
    trainer = make("grpo", model_dir, tmp_path, FusionConfig())
    ids, mask = ragged_batch(vocab=trainer.model.config.vocab_size)
    keep = mask[:, PROMPT:].bool()
    with torch.no_grad():
        whole, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, COMPLETION)
        shapes: list = []
        count_forwards(monkeypatch, trainer.model, shapes)
        chunked, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, COMPLETION, batch_size=1)
    assert len(shapes) > 1 and all(s[0] == 1 for s in shapes)
    assert torch.allclose(whole[keep], chunked[keep], atol=1e-6, rtol=0)


def test_several_processes_run_as_many_forwards_as_trl(model_dir, tmp_path, monkeypatch):
    # A DDP forward is a collective (it broadcasts buffers): each process must run as many
    # forwards as the others, whatever its own packing gives. TRL runs ceil(rows / batch_size).
    trainer = make("grpo", model_dir, tmp_path, FusionConfig())
    ids, mask = ragged_batch(vocab=trainer.model.config.vocab_size)
    keep = mask[:, PROMPT:].bool()
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda _: 2))
    with torch.no_grad():
        whole, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, COMPLETION)
        for batch_size, forwards in ((3, 3), (8, 1), (None, 1)):
            shapes: list = []
            count_forwards(monkeypatch, trainer.model, shapes)
            got, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, COMPLETION, batch_size=batch_size)
            monkeypatch.setattr(trainer.model, "forward", trainer.model.forward.__wrapped__)
            assert len(shapes) == forwards, (batch_size, shapes)
            assert all(s[0] < ids.shape[0] for s in shapes)  # packed, not TRL's padded rows
            assert torch.allclose(whole[keep], got[keep], atol=1e-6, rtol=0)
        # Fewer bins than TRL's forwards: TRL's own forward (one row per forward here).
        shapes = []
        count_forwards(monkeypatch, trainer.model, shapes)
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION,
                                                   batch_size=1)
        assert len(shapes) == ids.shape[0] and all(s[0] == 1 for s in shapes)


def test_unsupported_inputs_take_trls_padded_forward(model_dir, tmp_path, monkeypatch):
    trainer = make("grpo", model_dir, tmp_path, FusionConfig())
    model = trainer.model
    ids, mask = ragged_batch(vocab=model.config.vocab_size)
    calls: list = []
    monkeypatch.setattr(trainer._stock, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: calls.append(k) or "trl")

    def took_trls(**kw):
        calls.clear()
        with torch.no_grad():
            out = trainer._get_per_token_logps_and_entropies(model, ids, mask, COMPLETION, **kw)
        assert (out == "trl") == bool(calls)
        return bool(calls)

    assert not took_trls()
    assert took_trls(pixel_values=torch.zeros(1))  # multimodal inputs
    assert took_trls(compute_aux_loss=True)  # MoE load-balancing loss over padded rows
    # An attention implementation without dense 4D masks, an unlisted model type.
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    assert took_trls()
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(type(trainer), "padding_free_model_types", frozenset())
    assert took_trls()
    monkeypatch.setattr(type(trainer), "padding_free_model_types", frozenset({"llama"}))
    assert not took_trls()
    # A completion token right after padding (an empty prompt), and padding_free off.
    mask[1, :PROMPT] = 0
    assert took_trls()
    mask[1, PROMPT - 1] = 1
    trainer.fusion = FusionConfig(padding_free=False)
    assert took_trls()


def test_grpo_training_padding_free_equals_padded(tailed_model_dir, tmp_path, monkeypatch):
    params, packed_rows = [], []
    for fusion in (FusionConfig(), FusionConfig(padding_free=False)):
        trainer = make("grpo", tailed_model_dir, tmp_path / str(fusion.padding_free), fusion,
                       max_steps=3, max_completion_length=24, per_device_train_batch_size=8,
                       learning_rate=1e-3)
        trainer._generation_backend()  # its copy of the policy is made before the spy goes in
        shapes: list = []
        count_forwards(monkeypatch, trainer.model, shapes)
        trainer.train()
        monkeypatch.undo()
        packed_rows.append([s[0] for s in shapes])
        params.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    # The padding-free run trained on packed rows; the padded one on the batch's 8 rows.
    assert all(r < 8 for r in packed_rows[0]) and packed_rows[1] == [8, 8, 8]
    initial = make("grpo", tailed_model_dir, tmp_path / "init", FusionConfig.off())
    before = initial.model.state_dict()
    assert any(not torch.equal(before[k], params[1][k]) for k in before)  # training moved it
    for k in params[0]:
        assert torch.allclose(params[0][k], params[1][k], atol=1e-5, rtol=0), k


def test_off_turns_padding_free_off():
    assert FusionConfig().padding_free
    assert not FusionConfig.off().padding_free
