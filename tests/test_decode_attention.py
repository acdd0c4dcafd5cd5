"""Paged decode attention: the Triton kernel and the torch fallback against a naive gather + SDPA.

``test_kernel_*`` tests run the Triton kernel: on CUDA when present, else in one child process
under ``TRITON_INTERPRET=1`` (see ``rlhf_fusion.testing.kernels``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from rlhf_fusion.testing import InterpreterChild, in_interpreter_child
from rlhf_fusion.triton_kernels import (
    ATTENTION_NAME,
    decode_attention,
    decode_attention_reference,
    decode_attention_torch,
    decode_attention_triton,
    register_transformers_attention,
)

_DA = importlib.import_module("rlhf_fusion.triton_kernels.decode_attention")
_CHILD = InterpreterChild(__file__, select="kernel")


@pytest.fixture
def kernel_device(request: pytest.FixtureRequest) -> str | None:
    pytest.importorskip("triton")
    return _CHILD.device_for(request.node.name)


def make_cache(
    lens: list[int],
    *,
    q_heads: int,
    kv_heads: int,
    dim: int,
    page: int,
    dtype: torch.dtype = torch.float32,
    spare_pages: int = 3,
    seed: int = 0,
    device: str = "cpu",
):
    """A shuffled page pool: each sequence's pages are scattered, as in a real allocator."""
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    per_seq = max(1, max((n + page - 1) // page for n in lens))
    pool = bsz * per_seq + spare_pages
    k = torch.randn(pool, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pool, page, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[: bsz * per_seq].view(bsz, per_seq)
    q = torch.randn(bsz, q_heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(x.to(device) for x in (q, k, v, table.to(torch.int32), seq_lens))


def tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-5)
    return dict(rtol=2e-2, atol=2e-2)  # one rounding of the output to bf16/fp16, plus p in bf16


def check(fn, q, k, v, table, lens, **kw):
    scale = q.shape[-1] ** -0.5
    out = fn(q, k, v, table, lens, sm_scale=scale, **kw)
    ref = decode_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), sm_scale=scale
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **tolerance(q.dtype))
    return out


# --------------------------------------------------------------------------------------------
# reference and torch fallback
# --------------------------------------------------------------------------------------------


def test_reference_against_dense_sdpa():
    q, k, v, table, lens = make_cache([5, 9], q_heads=4, kv_heads=2, dim=16, page=4)
    ref = decode_attention_reference(q, k, v, table, lens, sm_scale=0.25)
    for b, n in enumerate([5, 9]):
        tok = torch.arange(n)
        kk = k[table[b, tok // 4].long(), tok % 4]  # [n, Hkv, D]
        vv = v[table[b, tok // 4].long(), tok % 4]
        for h in range(4):
            s = (q[b, h] @ kk[:, h // 2].T) * 0.25
            o = torch.softmax(s, dim=0) @ vv[:, h // 2]
            torch.testing.assert_close(ref[b, h], o, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page", [1, 16, 32, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_torch_matches_reference(page, heads):
    q, k, v, table, lens = make_cache(
        [0, 1, 37, 100], q_heads=heads[0], kv_heads=heads[1], dim=32, page=page
    )
    check(decode_attention_torch, q, k, v, table, lens)


def test_public_dispatch_cpu_uses_torch(monkeypatch):
    q, k, v, table, lens = make_cache([3, 7], q_heads=4, kv_heads=2, dim=16, page=4)
    monkeypatch.setattr(_DA, "decode_attention_triton", lambda *a, **k: 1 / 0)
    check(decode_attention, q, k, v, table, lens)


def test_compiled_kernel_rejects_cpu_tensors():
    pytest.importorskip("triton")
    if in_interpreter_child():
        pytest.skip("the interpreter runs CPU tensors")
    q, k, v, table, lens = make_cache([3], q_heads=4, kv_heads=2, dim=16, page=4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        decode_attention_triton(q, k, v, table, lens, sm_scale=0.25)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"][..., :8]), "head_dim"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of kv_heads"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
        (lambda a: a.update(block_table=a["block_table"].float()), "int32 or int64"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :, :1]), "must match"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), "num_pages, page_size"),
    ],
)
def test_validation_errors(change, match):
    q, k, v, table, lens = make_cache([3, 7], q_heads=4, kv_heads=2, dim=16, page=4)
    args = dict(q=q, k_cache=k, v_cache=v, block_table=table, seq_lens=lens)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        decode_attention(sm_scale=0.25, **args)


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (lens, q_heads, kv_heads, dim, page, num_splits)
    ([5, 40, 1], 8, 2, 64, 16, None),
    ([7, 3], 4, 4, 32, 1, 4),  # page size 1, MHA, 4 splits
    ([70, 33], 8, 8, 32, 1, 1),
    ([100, 1, 64], 32, 8, 128, 32, 8),  # the benchmark's head layout
    ([33, 17], 6, 2, 40, 16, 3),  # head dim not a power of two, group 3
    ([130, 64], 16, 1, 64, 64, 2),  # one KV head for 16 query heads
    ([9, 2], 2, 1, 16, 16, 16),  # more splits than pages (and than tokens)
    ([0, 12], 4, 2, 32, 16, 1),  # empty sequence
    ([0, 0], 4, 2, 32, 16, 5),  # all empty, with splits
    ([48], 4, 2, 256, 16, 2),  # wide heads (BLOCK_N 32)
]


def _case_id(case):
    lens, hq, hkv, dim, page, splits = case
    return f"lens{'-'.join(map(str, lens))}-{hq}q{hkv}kv-d{dim}-p{page}-s{splits}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[_case_id(c) for c in KERNEL_CASES])
def test_kernel_matches_reference(kernel_device, case, dtype):
    if kernel_device is None:
        return  # ran under TRITON_INTERPRET=1 in the child process
    lens, hq, hkv, dim, page, splits = case
    q, k, v, table, seq_lens = make_cache(
        lens, q_heads=hq, kv_heads=hkv, dim=dim, page=page, dtype=dtype, device=kernel_device
    )
    out = check(decode_attention_triton, q, k, v, table, seq_lens, num_splits=splits)
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all()


def test_kernel_fp16_and_int64_table(kernel_device):
    if kernel_device is None:
        return
    q, k, v, table, lens = make_cache(
        [50, 3, 17], q_heads=8, kv_heads=2, dim=64, page=16, dtype=torch.float16,
        device=kernel_device,
    )  # fmt: skip
    check(decode_attention_triton, q, k, v, table.long(), lens.long(), num_splits=2)


def test_kernel_splits_agree(kernel_device):
    if kernel_device is None:
        return
    q, k, v, table, lens = make_cache(
        [200, 90, 0], q_heads=8, kv_heads=2, dim=32, page=16, device=kernel_device
    )
    outs = [
        decode_attention_triton(q, k, v, table, lens, sm_scale=0.2, num_splits=s)
        for s in (1, 2, 7, 32)
    ]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


def test_kernel_strided_cache_views(kernel_device):
    """The transformers adapter's zero-copy views of a [B, Hkv, S, D] cache."""
    if kernel_device is None:
        return
    gen = torch.Generator().manual_seed(1)
    bsz, hkv, hq, slen, dim = 3, 2, 8, 23, 32
    key = torch.randn(bsz, hkv, slen, dim, generator=gen).to(kernel_device)
    value = torch.randn(bsz, hkv, slen, dim, generator=gen).to(kernel_device)
    q = torch.randn(bsz, hq, dim, generator=gen).to(kernel_device)
    valid = torch.rand(bsz, slen, generator=gen) < 0.7
    valid[:, -1] = True
    valid = valid.to(kernel_device)
    dense = []
    for b in range(bsz):
        kk = key[b][:, valid[b]].repeat_interleave(hq // hkv, 0)
        vv = value[b][:, valid[b]].repeat_interleave(hq // hkv, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kk, vv, scale=0.3)
        dense.append(o[:, 0])
    dense = torch.stack(dense)
    for mask in (None, valid):
        kp, table, lens = _DA._paged_view(key, mask)
        vp, _, _ = _DA._paged_view(value, mask)
        out = decode_attention_triton(q, kp, vp, table, lens, sm_scale=0.3, num_splits=2)
        if mask is None:
            full = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], key.repeat_interleave(4, 1), value.repeat_interleave(4, 1), scale=0.3
            )[:, :, 0]
            torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)


def test_kernel_int64_page_offsets(kernel_device):
    """Pages that start beyond 2**31 elements: offsets must be computed in int64.

    The page pool is a 4 GiB allocation that is never written except for the few pages in use
    (the interpreter reads only the addressed elements, and untouched memory is not committed).
    """
    if kernel_device is None:
        return
    hkv, dim, page = 2, 64, 16
    per_page = page * hkv * dim
    n_pages = 2**31 // per_page + 8  # > 2**31 elements in the pool
    try:
        pool_k = torch.empty(n_pages * per_page, dtype=torch.bfloat16, device=kernel_device)
        pool_v = torch.empty(n_pages * per_page, dtype=torch.bfloat16, device=kernel_device)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot reserve the 2x4 GiB page pool: {exc}")
    k_cache = pool_k.view(n_pages, page, hkv, dim)
    v_cache = pool_v.view(n_pages, page, hkv, dim)
    high = torch.arange(n_pages - 6, n_pages)  # these start past 2**31 elements
    gen = torch.Generator().manual_seed(0)
    for cache in (k_cache, v_cache):
        cache[high.to(kernel_device)] = torch.randn(6, page, hkv, dim, generator=gen).to(
            device=kernel_device, dtype=torch.bfloat16
        )
    table = torch.stack([high[:3], high[3:]]).to(torch.int32).to(kernel_device)
    lens = torch.tensor([40, 33], dtype=torch.int32, device=kernel_device)
    q = torch.randn(2, 8, dim, generator=gen).to(device=kernel_device, dtype=torch.bfloat16)
    out = decode_attention_triton(q, k_cache, v_cache, table, lens, sm_scale=0.125, num_splits=2)
    # reference on just the pages in use
    used = high.to(kernel_device)
    remap = torch.arange(6, dtype=torch.int32, device=kernel_device).view(2, 3)
    ref = decode_attention_reference(
        q.cpu(), k_cache[used].cpu(), v_cache[used].cpu(), remap.cpu(), lens.cpu(), sm_scale=0.125
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), **tolerance(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# transformers integration
# --------------------------------------------------------------------------------------------


def _tiny_llama(attn: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attn
    model.eval()
    return model


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def _compare_generation(monkeypatch, expect_kernel: bool, device: str = "cpu"):
    name = register_transformers_attention()
    assert name == ATTENTION_NAME
    calls = []
    real = _DA.decode_attention_triton

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(_DA, "decode_attention_triton", counting)
    ids = torch.tensor([[0, 0, 5, 17, 23, 9], [3, 44, 12, 8, 61, 2]], device=device)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], device=device)  # left padding
    sdpa_model = _tiny_llama("sdpa").to(device)
    ref = _generate(sdpa_model, ids, mask)
    model = _tiny_llama(ATTENTION_NAME).to(device)
    got = _generate(model, ids, mask)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # without padding the mask is None and one page per sequence is used
    got = _generate(model, ids[1:], mask[1:])
    ref = _generate(sdpa_model, ids[1:], mask[1:])
    assert torch.equal(got.sequences, ref.sequences)
    if expect_kernel:
        # 5 decode steps x 2 layers x 2 generations; prefill goes to SDPA
        assert len(calls) == 20, len(calls)
    else:
        assert calls == []


def test_transformers_registration_falls_back_on_cpu(monkeypatch):
    if in_interpreter_child():
        pytest.skip("the kernel path is covered by test_kernel_transformers_generation")
    _compare_generation(monkeypatch, expect_kernel=False)


def test_kernel_transformers_generation(kernel_device, monkeypatch):
    if kernel_device is None:
        return
    _compare_generation(monkeypatch, expect_kernel=True, device=kernel_device)
