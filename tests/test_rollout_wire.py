"""Migration tickets cross processes as one int64 and one float64 tensor (``rollout.wire``):
what a destination unpacks must be the spec the source exported, field for field and its KV
bit for bit, whatever the ticket holds; a message that does not add up is refused."""

from __future__ import annotations

import pytest
import torch

from rlhf_fusion.rollout.paged import KVHandle, joined_kv
from rlhf_fusion.rollout.types import MigrationTicket, SampleSpec
from rlhf_fusion.rollout.wire import pack_ticket_parts, pack_tickets, unpack_tickets


def tickets() -> list[MigrationTicket]:
    g = torch.Generator().manual_seed(0)

    def kv(tokens: int) -> KVHandle:
        return KVHandle(torch.randn(2, 2, tokens, 3, 8, generator=g, dtype=torch.float64))

    return [
        # mid-generation, with its KV (the kv mechanism)
        MigrationTicket(SampleSpec(7, (5, 6, 7), 12, seed=3, temperature=0.7,
                                   stop_token_ids=(2, 9), generated_ids=(4, 4, 1),
                                   logprobs=(-0.5, -0.0, -1e-310), kv=kv(5)), "kv", 1),
        # mid-generation, token ids only (re-prefill at the destination)
        MigrationTicket(SampleSpec(8, (1,), 4, generated_ids=(3,), logprobs=(-2.25,)),
                        "tokens", 1),
        # queued, never started: a fresh request
        MigrationTicket(SampleSpec(9, (1, 2), 4, seed=5), "kv", 0),
        # a greedy one with a one-token context
        MigrationTicket(SampleSpec(10, (3,), 2, temperature=0.0, generated_ids=(6,),
                                   logprobs=(float("-inf"),), kv=kv(1)), "kv", 0),
    ]


def test_tickets_round_trip_field_for_field_and_kv_bit_for_bit():
    sent = tickets()
    ints, floats = pack_tickets(sent)
    got = unpack_tickets(len(sent), ints, floats)
    assert [(t.mode, t.source) for t in got] == [(t.mode, t.source) for t in sent]
    for a, b in zip(sent, got, strict=True):
        # equal to the spec the public constructor checks and normalises, not only to the
        # sender's: a destination's admission and sampling read these fields
        assert b.spec.without_kv() == a.spec.without_kv()
        for k in ("prompt_ids", "generated_ids", "stop_token_ids", "logprobs"):
            assert type(getattr(b.spec, k)) is tuple
        assert all(type(x) is int for x in b.spec.prompt_ids + b.spec.generated_ids)
        assert all(type(x) is float for x in b.spec.logprobs)
        assert (a.spec.kv is None) == (b.spec.kv is None)
        if a.spec.kv is not None:
            x, y = a.spec.kv.data, b.spec.kv.data
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y)
    # -0.0 and a subnormal logprob survive as themselves
    assert str(got[0].spec.logprobs[1]) == "-0.0" and got[0].spec.logprobs[2] == -1e-310


def test_kv_of_another_dtype_comes_back_in_the_destination_s():
    t = MigrationTicket(SampleSpec(1, (1, 2), 8, generated_ids=(3,), logprobs=(-1.0,),
                                   kv=KVHandle(torch.randn(1, 2, 2, 1, 4).to(torch.bfloat16))),
                        "kv", 0)
    ints, floats = pack_tickets([t])
    (got,) = unpack_tickets(1, ints, floats, kv_dtype=torch.bfloat16)
    assert got.spec.kv.data.dtype == torch.bfloat16
    assert torch.equal(got.spec.kv.data, t.spec.kv.data)


def test_no_tickets_pack_to_empty_tensors():
    ints, floats = pack_tickets([])
    assert ints.numel() == floats.numel() == 0
    assert unpack_tickets(0, ints, floats) == []


@pytest.mark.parametrize("cut", ["ints", "floats", "extra float", "count"])
def test_a_message_that_does_not_add_up_is_refused(cut):
    sent = tickets()
    ints, floats = pack_tickets(sent)
    n = len(sent)
    if cut == "ints":
        ints = ints[:-1]
    elif cut == "floats":
        floats = floats[:-1]
    elif cut == "extra float":
        floats = torch.cat([floats, torch.zeros(1, dtype=torch.float64)])
    else:
        n -= 1
    with pytest.raises(ValueError, match="malformed ticket message"):
        unpack_tickets(n, ints, floats)


def test_kv_exported_together_goes_into_the_message_as_one_block_without_a_copy():
    """``PagedKVPool.export`` hands out views of the one block it gathered; the message's KV
    part is that block itself (the same memory), and unpacked, every sample's KV is its own
    again, bit for bit."""
    block = torch.randn(2, 2, 9, 3, 8, dtype=torch.float64)
    views = torch.split(block, [4, 2, 3], dim=2)
    joined = joined_kv(list(views))
    assert joined.data_ptr() == block.data_ptr() and torch.equal(joined, block)
    sent = [MigrationTicket(SampleSpec(i, (1, 2), 16, generated_ids=(3,) * n,
                                       logprobs=(-1.0,) * n, kv=KVHandle(v)), "kv", 0)
            for i, (n, v) in enumerate(zip((5, 3, 4), views, strict=True))]
    ints, parts = pack_ticket_parts(sent)
    assert len(parts) == 2 and parts[1].data_ptr() == block.data_ptr()
    floats = torch.cat(parts)
    got = unpack_tickets(3, ints, floats)
    for a, b in zip(sent, got, strict=True):
        assert torch.equal(a.spec.kv.data, b.spec.kv.data)
    # and the destination loads them from the message's memory as one block again
    again = joined_kv([t.spec.kv.data for t in got])
    assert again.data_ptr() == floats[parts[0].numel():].data_ptr() and torch.equal(again, block)
    assert torch.equal(pack_tickets(sent)[1], torch.cat(parts))


def test_kv_that_is_not_one_block_in_order_is_joined_by_a_copy():
    block = torch.randn(2, 2, 9, 3, 8, dtype=torch.float64)
    a, b, c = torch.split(block, [4, 2, 3], dim=2)
    assert joined_kv([b, a, c]) is None                           # out of order
    assert joined_kv([a, b]) is None                              # not all of it
    assert joined_kv([a, b, c.clone()]) is None                   # another tensor
    assert joined_kv([block.transpose(3, 4)[:, :, :9]]) is None   # another layout
    assert joined_kv([a, b.float(), c]) is None                   # another dtype
    sent = [MigrationTicket(SampleSpec(i, (1,), 16, generated_ids=(3,) * (k.shape[2] + 1),
                                       logprobs=(-1.0,) * (k.shape[2] + 1), kv=KVHandle(k)),
                            "kv", 0) for i, k in enumerate((b, a, c))]
    got = unpack_tickets(3, *pack_tickets(sent))
    assert [torch.equal(x.spec.kv.data, y.spec.kv.data) for x, y in zip(sent, got)] == [True] * 3


def test_kv_of_two_models_in_one_message_is_refused():
    sent = [MigrationTicket(SampleSpec(i, (1,), 16, generated_ids=(3, 3), logprobs=(-1.0,) * 2,
                                       kv=KVHandle(torch.zeros(2, 2, 1, h, 8))), "kv", 0)
            for i, h in enumerate((3, 4))]
    with pytest.raises(ValueError, match="different layouts"):
        pack_tickets(sent)
    # and a message whose tickets claim two layouts is refused by name on arrival
    one = [MigrationTicket(t.spec._replace(kv=KVHandle(torch.zeros(2, 2, 1, 3, 8))), "kv", 0)
           for t in sent]
    ints, floats = pack_tickets(one)
    # the second ticket (from int 16: 13 + its prompt, 2 tokens) says (2, 2, 1, 4, 6): as
    # many floats, another layout
    assert ints[24:29].tolist() == [2, 2, 1, 3, 8]
    ints[27:29] = torch.tensor([4, 6])
    with pytest.raises(ValueError, match=r"2 layouts \[\(2, 2, 3, 8\), \(2, 2, 4, 6\)\]"):
        unpack_tickets(2, ints, floats)
