"""Reference backend: correctness of paged continuous batching, keyed sampling, migration."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from rlhf_fusion.rollout import (
    GenerationBackend,
    KVCapacityError,
    RolloutConfigError,
    RolloutError,
    SampleSpec,
)
from rlhf_fusion.rollout.paged import joined_kv
from rlhf_fusion.rollout.reference import ReferenceBackend
from rlhf_fusion.rollout.sampling import (
    derive_seed,
    keyed_sample,
    keyed_uniform,
    keyed_uniform_torch,
)
from rlhf_fusion.rollout.wire import pack_ticket_parts, pack_tickets, unpack_tickets
from rlhf_fusion.testing import build_causal_lm, tiny_config

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return build_causal_lm(tiny_config(vocab_size=VOCAB, hidden_size=32, layers=2, heads=4,
                                       kv_heads=2), seed=1)


def make_specs(n, seed=0, max_len=24, temperature=1.0, stop=()):
    rng = random.Random(seed)
    return [SampleSpec(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))],
                       max_new_tokens=rng.randint(1, max_len), seed=11, temperature=temperature,
                       stop_token_ids=stop) for i in range(n)]


def run_all(backend, specs):
    backend.submit(specs)
    return {r.sample_id: r for r in backend.results()}


# -- sampling -------------------------------------------------------------------------------------


def test_keyed_uniform_is_a_pure_function_of_the_key():
    a = keyed_uniform([1, 1, 2], [5, 6, 5], [0, 0, 0], 50)
    b = keyed_uniform([2, 1], [5, 6], [0, 0], 50)
    assert (a[2] == b[0]).all() and (a[1] == b[1]).all()
    assert not (a[0] == a[1]).all()
    assert ((a > 0) & (a < 1)).all()
    # roughly uniform: mean of many draws near 1/2
    u = keyed_uniform(list(range(200)), [0] * 200, [0] * 200, 500)
    assert abs(u.mean() - 0.5) < 0.01


_HASH_KEYS = (
    [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 123456789012345, -987654321],
    [0, 7, 2**40 + 3, 5, 2**63 + 11, 1, 99, 2**31],
    [0, 1, 2, 2**62, 3, 2**64 - 2, 4095, 17],
)


def _splitmix64_numpy(x):
    # An independent reference: splitmix64's finaliser in numpy uint64, where wrap-around
    # multiplication is defined behaviour (the library runs it in torch int64).
    golden = np.uint64(0x9E3779B97F4A7C15)
    x = x + golden
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keyed_uniform_numpy(seeds, sample_ids, positions, vocab):
    def u64(vs):
        return np.asarray([int(v) & 0xFFFFFFFFFFFFFFFF for v in vs], dtype=np.uint64)

    with np.errstate(over="ignore"):
        h = _splitmix64_numpy(u64(seeds))
        h = _splitmix64_numpy(h ^ u64(sample_ids))
        h = _splitmix64_numpy(h ^ u64(positions))
        cols = np.arange(vocab, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = _splitmix64_numpy(h[:, None] ^ cols[None, :])
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def test_splitmix64_gives_its_published_outputs():
    # splitmix64 seeded with 0: its first three outputs, as published with the generator
    # (Vigna's splitmix64.c). The state advances by the golden gamma before each mix.
    from rlhf_fusion.rollout.sampling import _signed, _splitmix64_torch

    state = torch.tensor([_signed(k * 0x9E3779B97F4A7C15) for k in range(3)], dtype=torch.int64)
    got = [int(v) & 0xFFFFFFFFFFFFFFFF for v in _splitmix64_torch(state)]
    assert got == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_keyed_uniform_has_the_uint64_hash_bits():
    # keyed_sample hashes in torch int64 on the logits' device; it must be the uint64
    # splitmix64 bit for bit, sign bits and high vocabulary indices included.
    ref = _keyed_uniform_numpy(*_HASH_KEYS, 151936)
    assert (keyed_uniform_torch(*_HASH_KEYS, 151936).numpy() == ref).all()
    assert (keyed_uniform(*_HASH_KEYS, 151936) == ref).all()
    u64 = [[int(v) & 0xFFFFFFFFFFFFFFFF] for v in (-5, 2**64 + 9, 3)]
    with np.errstate(over="ignore"):
        h = _splitmix64_numpy(np.asarray(u64[0], dtype=np.uint64))
        h = _splitmix64_numpy(h ^ np.asarray(u64[1], dtype=np.uint64))
        h = _splitmix64_numpy(h ^ np.asarray(u64[2], dtype=np.uint64))
    assert derive_seed(-5, 2**64 + 9, 3) == int(h[0] >> np.uint64(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_keyed_uniform_on_cuda_has_the_uint64_hash_bits():
    ref = _keyed_uniform_numpy(*_HASH_KEYS, 151936)
    got = keyed_uniform_torch(*_HASH_KEYS, 151936, device="cuda").cpu().numpy()
    assert (got == ref).all()
    logits = torch.randn(8, 151936, generator=torch.Generator().manual_seed(0))
    args = (list(range(8)), list(range(8)), [3] * 8, [1.0] * 8)
    on_gpu, lp_gpu = keyed_sample(logits.cuda(), *args)
    on_cpu, lp_cpu = keyed_sample(logits, *args)
    assert on_gpu == on_cpu
    assert max(abs(a - b) for a, b in zip(lp_gpu, lp_cpu, strict=True)) < 1e-12


def test_keyed_sample_matches_softmax_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    n = 4000
    toks, _ = keyed_sample(logits.expand(n, 4), [3] * n, list(range(n)), [0] * n, [1.0] * n)
    freq = torch.bincount(torch.tensor(toks), minlength=4).double() / n
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    greedy, lps = keyed_sample(logits, [0], [0], [0], [0.0])
    assert greedy == [0] and math.isclose(lps[0], torch.log_softmax(logits[0], -1)[0].item())


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
    assert len({derive_seed(1, 2, p) for p in range(100)}) == 100
    assert 0 <= derive_seed(-5, 2, 3) < 2**63


# -- generation -----------------------------------------------------------------------------------


def test_protocol_and_greedy_matches_full_recompute(model):
    backend = ReferenceBackend(model, max_batch_size=3)
    assert isinstance(backend, GenerationBackend)
    specs = make_specs(7, temperature=0.0)
    res = run_all(backend, specs)
    for s in specs:
        ids = list(s.prompt_ids)
        with torch.no_grad():
            for _ in range(s.max_new_tokens):
                logits = backend.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
        assert list(res[s.sample_id].token_ids) == ids[len(s.prompt_ids):]
        assert res[s.sample_id].finish_reason == "length"


def test_backend_registers_its_paged_attention_without_masks(model):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from rlhf_fusion.rollout.paged import ATTN_IMPL_NAME, paged_attention_forward
    from rlhf_fusion.triton_kernels import ATTENTION_NAME

    backend = ReferenceBackend(model)
    assert ATTN_IMPL_NAME != ATTENTION_NAME
    assert backend.model.config._attn_implementation == ATTN_IMPL_NAME
    assert AttentionInterface._global_mapping[ATTN_IMPL_NAME] is paged_attention_forward
    # the model passes no mask: the paged context says what each query attends to
    assert ATTN_IMPL_NAME not in AttentionMaskInterface._global_mapping


def test_tokens_do_not_depend_on_batching(model):
    specs = make_specs(10, seed=3)
    ref = run_all(ReferenceBackend(model, max_batch_size=1), specs)
    for bs in (2, 4, 16):
        got = run_all(ReferenceBackend(model, max_batch_size=bs, block_size=bs + 1), specs)
        for i, r in got.items():
            assert r.token_ids == ref[i].token_ids
            assert max(abs(a - b) for a, b in zip(r.logprobs, ref[i].logprobs, strict=True)) < 1e-9


def test_a_shared_prompt_is_prefilled_once_and_samples_as_if_alone(model):
    # GRPO's groups: n samples of one prompt. The prompt is prefilled once per distinct
    # prompt and its KV copied; every sample must still get the tokens it gets alone.
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (5, 5, 3)]
    specs = [SampleSpec(i, prompts[i % 3], max_new_tokens=12, seed=11) for i in range(12)]
    alone = run_all(ReferenceBackend(model, max_batch_size=1), specs)
    backend = ReferenceBackend(model, max_batch_size=16, block_size=4)
    rows = []
    forward = backend._forward
    backend._forward = lambda ids, pos, ctx: (rows.append(ids.shape) if not ctx.decode
                                              else None) or forward(ids, pos, ctx)
    got = run_all(backend, specs)
    assert sorted(rows) == [(1, 3), (2, 5)]   # one row per distinct prompt
    assert len({tuple(r.token_ids) for r in got.values()}) > 3   # the samples still differ
    for i, r in got.items():
        assert r.token_ids == alone[i].token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, alone[i].logprobs, strict=True)) < 1e-9


def test_stop_tokens_end_samples_and_are_kept(model):
    specs = make_specs(12, seed=4, max_len=60, stop=(5, 9))
    res = run_all(ReferenceBackend(model), specs)
    stopped = [r for r in res.values() if r.finish_reason == "stop"]
    assert stopped, "some sample should hit a stop token in 60 steps over a 64-token vocab"
    for r in res.values():
        assert len(r.token_ids) == len(r.logprobs)
        assert all(t not in (5, 9) for t in r.token_ids[:-1])
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in (5, 9)


def test_results_stream_in_finish_order(model):
    backend = ReferenceBackend(model, max_batch_size=8)
    specs = [SampleSpec(i, [1, 2], max_new_tokens=n) for i, n in enumerate([9, 2, 5, 1])]
    backend.submit(specs)
    order = [r.sample_id for r in backend.results()]
    assert order == [3, 1, 2, 0]


@pytest.mark.parametrize("mode", ["kv", "tokens"])
def test_export_import_reproduces_unmoved_tokens(model, mode):
    specs = make_specs(8, seed=5, max_len=30)
    unmoved = run_all(ReferenceBackend(model, max_batch_size=4), specs)
    src = ReferenceBackend(model, instance_id=0, max_batch_size=4)
    dst = ReferenceBackend(model, instance_id=1, max_batch_size=3, block_size=5)
    src.submit(specs)
    got = {}
    for _ in range(6):
        got.update({r.sample_id: r for r in src.step()})
    moving = src.unfinished()
    assert moving, "the test needs samples in flight"
    tickets = src.export_samples(moving, mode=mode)
    assert sorted(t.sample_id for t in tickets) == moving and not src.unfinished()
    assert all((t.spec.kv is not None) == (mode == "kv" and bool(t.spec.generated_ids))
               for t in tickets)
    if mode == "kv":   # one gathered block, which the message carries as it is
        kvs = [t.spec.kv.data for t in tickets if t.spec.kv is not None]
        assert joined_kv(kvs) is not None
        assert pack_ticket_parts(tickets)[1][1].data_ptr() == kvs[0].data_ptr()
    ints, floats = pack_tickets(tickets)
    dst.import_samples(unpack_tickets(len(tickets), ints, floats))
    for r in dst.results():
        assert r.sample_id not in got and r.migrated
        got[r.sample_id] = r
    assert sorted(got) == sorted(unmoved)
    for i, r in got.items():
        assert r.token_ids == unmoved[i].token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, unmoved[i].logprobs, strict=True)) < 1e-9


def test_export_of_finished_or_unknown_samples_gives_no_ticket(model):
    backend = ReferenceBackend(model)
    backend.submit([SampleSpec(0, [1], max_new_tokens=1), SampleSpec(1, [1], max_new_tokens=9)])
    done = backend.step()
    assert [r.sample_id for r in done] == [0]
    tickets = backend.export_samples([0, 1, 77], mode="kv")
    assert [t.sample_id for t in tickets] == [1]
    assert list(backend.results()) == []


def test_a_source_whose_planned_samples_all_finished_sends_an_empty_ticket_file(model):
    """At the trigger a rank may go on decoding until its peer's progress report is there, so
    every sample the plan moves can finish first: the export is empty, and the destination
    reads the file's empty body as no tickets (``frombuffer`` refuses empty bytes)."""
    from rlhf_fusion.rollout.distributed import _view

    backend = ReferenceBackend(model)
    backend.submit([SampleSpec(0, [1], max_new_tokens=1)])
    backend.step()
    ints, floats = pack_tickets(backend.export_samples([0], mode="kv"))
    assert ints.numel() == floats.numel() == 0
    buf = bytearray(32 + len(ints.numpy().tobytes()) + len(floats.numpy().tobytes()))
    assert len(buf) == 32
    assert unpack_tickets(0, _view(buf, 32, 0, torch.int64), _view(buf, 32, 0, torch.float64)) == []
    other = ReferenceBackend(model)
    other.import_samples([])
    assert other.unfinished() == []


def test_queued_sample_exports_as_fresh_request(model):
    backend = ReferenceBackend(model, max_batch_size=1)
    backend.submit([SampleSpec(0, [1], max_new_tokens=5), SampleSpec(1, [2], max_new_tokens=5)])
    backend.step()
    (t,) = backend.export_samples([1], mode="kv")
    assert t.spec.generated_ids == () and t.spec.kv is None


def test_abort_drops_samples(model):
    backend = ReferenceBackend(model)
    backend.submit(make_specs(4))
    backend.step()
    backend.abort([0, 2])
    assert {r.sample_id for r in backend.results()} <= {1, 3}
    assert backend.unfinished() == []


def test_kv_capacity_is_enforced(model):
    with pytest.raises(KVCapacityError, match="kv_capacity_tokens"):
        ReferenceBackend(model, kv_capacity_tokens=32).submit([SampleSpec(0, [1] * 8, 40)])
    # Admission waits for blocks instead of failing when the pool is merely busy.
    backend = ReferenceBackend(model, kv_capacity_tokens=64, block_size=16)
    specs = [SampleSpec(i, [1, 2], max_new_tokens=20) for i in range(5)]
    res = run_all(backend, specs)
    assert sorted(res) == list(range(5))


def test_bad_specs_are_rejected(model):
    with pytest.raises(RolloutConfigError, match="max_new_tokens"):
        SampleSpec(0, [1], max_new_tokens=0)
    with pytest.raises(RolloutConfigError, match="vocabulary"):
        ReferenceBackend(model).submit([SampleSpec(0, [VOCAB + 3], max_new_tokens=2)])
    backend = ReferenceBackend(model)
    backend.submit([SampleSpec(0, [1], 3)])
    with pytest.raises(RolloutError, match="already here"):
        backend.submit([SampleSpec(0, [1], 3)])
    with pytest.raises(RolloutConfigError, match="mode"):
        backend.export_samples([0], mode="pages")  # type: ignore[arg-type]


def test_sleep_wake_and_update_weights(model):
    backend = ReferenceBackend(build_causal_lm(tiny_config(vocab_size=VOCAB, hidden_size=32,
                                                           layers=2, heads=4, kv_heads=2), 1))
    backend.submit([SampleSpec(0, [1], 3)])
    with pytest.raises(RolloutError, match="unfinished"):
        backend.sleep()
    with pytest.raises(RolloutError, match="unfinished"):
        backend.update_weights(model.state_dict())
    list(backend.results())
    backend.sleep()
    with pytest.raises(RolloutError, match="wake_up"):
        backend.submit([SampleSpec(1, [1], 3)])
    backend.wake_up()
    other = build_causal_lm(tiny_config(vocab_size=VOCAB, hidden_size=32, layers=2, heads=4,
                                        kv_heads=2), seed=99)
    before = run_all(backend, [SampleSpec(2, [1, 2], 12, temperature=0.0)])[2].token_ids
    backend.update_weights(other.state_dict())
    after = run_all(backend, [SampleSpec(3, [1, 2], 12, temperature=0.0)])[3].token_ids
    expect = run_all(ReferenceBackend(other), [SampleSpec(3, [1, 2], 12, temperature=0.0)])
    assert after == expect[3].token_ids and after != before


def test_qwen2_and_triton_layout_path(model):
    """Qwen2 works too; the decode kernel's API (its torch path on CPU) gives the same tokens."""
    from rlhf_fusion.triton_kernels.decode_attention import decode_attention

    qwen = build_causal_lm(tiny_config("qwen2", vocab_size=VOCAB, hidden_size=32, layers=2,
                                       heads=4, kv_heads=2), seed=2)
    specs = make_specs(6, seed=8)
    plain = run_all(ReferenceBackend(qwen, max_batch_size=4), specs)
    kernel = ReferenceBackend(qwen, max_batch_size=4)
    kernel._triton = decode_attention
    got = run_all(kernel, specs)
    for i, r in got.items():
        assert r.token_ids == plain[i].token_ids


def test_long_contexts_cross_the_attention_path_switch(model):
    """Contexts grow past PADDED_MAX_LEN mid-generation: both decode paths, same tokens."""
    from rlhf_fusion.rollout.paged import PADDED_MAX_LEN

    specs = [SampleSpec(i, [i + 1] * (3 + i), max_new_tokens=PADDED_MAX_LEN + 10 + 7 * i, seed=2)
             for i in range(4)]
    alone = {}
    for s in specs:
        alone.update(run_all(ReferenceBackend(model, max_batch_size=1), [s]))
    batched = run_all(ReferenceBackend(model, max_batch_size=4, block_size=8), specs)
    moved_src = ReferenceBackend(model, max_batch_size=4)
    moved_src.submit(specs)
    for _ in range(PADDED_MAX_LEN - 5):
        assert not moved_src.step()
    dst = ReferenceBackend(model, max_batch_size=2)
    dst.import_samples(moved_src.export_samples([0, 1, 2, 3], mode="kv"))
    moved = {r.sample_id: r for r in dst.results()}
    for i, r in alone.items():
        assert batched[i].token_ids == r.token_ids == moved[i].token_ids
        assert max(abs(a - b) for a, b in zip(batched[i].logprobs, r.logprobs, strict=True)) < 1e-9


def test_pool_gives_each_sample_consecutive_blocks():
    from rlhf_fusion.rollout.paged import PagedKVPool

    pool = PagedKVPool(1, 1, 2, block_size=4, max_tokens=40)  # 10 blocks
    a = pool.allocate(9)  # 3 blocks
    b = pool.allocate(8)
    c = pool.allocate(12)
    for blocks in (a, b, c):
        assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))
    pool.release(b)
    assert pool.can_allocate(8) and not pool.can_allocate(9)  # 2 + 1 free, not consecutive
    with pytest.raises(KVCapacityError, match="consecutive"):
        pool.allocate(9)
    pool.release(a)
    assert pool.allocate(20) == [0, 1, 2, 3, 4]
    grow = PagedKVPool(1, 1, 2, block_size=4, initial_tokens=8)
    assert grow.allocate(8) == [0, 1] and grow.allocate(20) == [2, 3, 4, 5, 6]
