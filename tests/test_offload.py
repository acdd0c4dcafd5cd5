"""Host offload of the frozen Ref and Reward (``rlhf_fusion.runtime.offload``) and the loop
with it: the module holds nothing on the device between calls, comes back bit-identical (tied
weights still tied), refuses to run while offloaded, and the loop's experience and parameters
are those of the loop without offload."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_loop import ITERATIONS, assert_same_run, run, tiny  # noqa: E402

from rlhf_fusion.loop import LoopConfigError, PlacementSection  # noqa: E402
from rlhf_fusion.loop.demo import demo_prompts  # noqa: E402
from rlhf_fusion.loop.iteration import PPOWorker  # noqa: E402
from rlhf_fusion.loop.models import (  # noqa: E402
    build_causal_lm,
    build_models,
    build_value_model,
    load_tokenizer,
    tiny_config,
)
from rlhf_fusion.loop.resolve import resolve_run  # noqa: E402
from rlhf_fusion.loop.run import prompts_for  # noqa: E402
from rlhf_fusion.runtime.offload import HostOffload, OffloadedModelError  # noqa: E402

REWARD_MODEL = {"family": "llama", "layers": 2, "hidden": 32}


def _gpt2(tie: bool = True) -> torch.nn.Module:
    return build_causal_lm(tiny_config("gpt2", vocab_size=40, hidden_size=32, layers=2,
                                       tie=tie), seed=1)


def _snapshot(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}


def _assert_bit_identical(m: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    now = dict([*m.named_parameters(), *m.named_buffers()])
    assert now.keys() == ref.keys()
    for k, v in ref.items():
        assert now[k].shape == v.shape and now[k].dtype == v.dtype, k
        assert torch.equal(now[k], v), k


# -- the offload object ---------------------------------------------------------------------------
def test_offload_frees_storage_and_prefetch_restores_bit_exact_over_rounds():
    model = _gpt2().double()
    before = _snapshot(model)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    expected = model(input_ids=ids).logits
    off = HostOffload(model, "cpu", name="ref")
    # named_parameters lists the tied lm_head weight once, under wte: counted once.
    assert "lm_head.weight" not in before
    assert off.device_elements() == sum(v.numel() for v in before.values())
    host = None
    for _ in range(3):
        off.offload()
        assert off.state == "offloaded"
        assert off.device_elements() == 0
        assert all(p.numel() == 0 for p in model.parameters())
        assert all(b.numel() == 0 for b in model.buffers())
        if host is None:
            host = {d: h.data_ptr() for d, h in off._host.items()}
        assert {d: h.data_ptr() for d, h in off._host.items()} == host  # allocated once
        off.prefetch()
        off.wait()
        _assert_bit_identical(model, before)
        assert torch.equal(model(input_ids=ids).logits, expected)
    st = off.take_stats()
    assert st.bytes == 4 * off.nbytes   # the copy to host once, then three prefetches
    assert off.nbytes == sum(v.numel() * 8 for v in before.values())


def test_tied_weights_stay_tied_after_restore():
    model = _gpt2(tie=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    off = HostOffload(model, "cpu")
    with off:
        pass
    assert model.lm_head.weight.numel() == 0
    with off:
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
        # One storage: writing through one name shows through the other.
        model.transformer.wte.weight.data[0, 0] += 1.0
        assert model.lm_head.weight[0, 0] == model.transformer.wte.weight[0, 0]


def test_calling_while_offloaded_raises_naming_the_fix():
    reward = build_value_model(tiny_config("llama", vocab_size=40, hidden_size=32, layers=2),
                               seed=2)
    ids = torch.tensor([[3, 4, 5]])
    mask = torch.ones_like(ids)
    want = reward(ids, mask)
    off = HostOffload(reward, "cpu", name="reward")
    off.offload()
    with pytest.raises(OffloadedModelError, match=r"reward is offloaded.*call prefetch\(\)"):
        reward(ids, mask)
    with pytest.raises(OffloadedModelError, match="prefetch"):
        off.wait()
    off.prefetch()
    # The first call after a prefetch waits for it by itself.
    assert torch.equal(reward(ids, mask), want)
    assert off.state == "resident"
    off.offload()
    with off as m:
        assert torch.equal(m(ids, mask), want)
    assert off.state == "offloaded"
    off.close()
    assert torch.equal(reward(ids, mask), want)


def test_a_module_on_another_device_is_refused():
    model = _gpt2()
    with pytest.raises(ValueError, match="move the module to meta"):
        HostOffload(model, "meta")


@pytest.mark.gpu
def test_prefetch_copies_on_a_side_stream_and_overlaps_compute():
    """CUDA: the prefetch's copy runs on its own stream from pinned memory while the compute
    stream is busy; the compute stream waits for it only at the first call."""
    dev = torch.device("cuda")
    big = torch.nn.Linear(4096, 4096, bias=False).to(dev)   # 64 MiB of float32
    before = big.weight.detach().clone()
    off = HostOffload(big, dev, name="big")
    off.offload()
    assert all(h.is_pinned() for h in off._host.values())
    assert torch.cuda.memory_allocated(dev) < before.numel() * 4 * 2  # the module's copy freed
    x = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    busy = torch.cuda.Event()
    for _ in range(20):       # queue long compute on the compute stream
        x = x @ x
        x = x / x.norm()
    busy.record(compute)
    off.prefetch()
    assert off._stream is not None and off._stream != compute
    off._done.synchronize()   # the copy finished ...
    assert not busy.query()   # ... while the compute stream was still busy: it overlapped
    off.wait()
    assert torch.equal(big.weight, before)
    ones = torch.ones(2, 4096, device=dev)
    y = big(ones)   # the compute stream waits for the copy's event first
    assert torch.equal(y, torch.nn.functional.linear(ones, before))
    assert off.take_stats().prefetch_s > 0


# -- the loop -------------------------------------------------------------------------------------
def _with_reward_model(cfg):
    cfg.models.reward = REWARD_MODEL
    return cfg


def test_one_device_loop_with_offload_is_bit_identical():
    """One process, three iterations: the same experience and parameters, bit for bit, and
    between iterations the Ref and the Reward hold nothing on the device."""
    base_cfg = _with_reward_model(tiny(1, inter=False, intra=False))
    tok = load_tokenizer(base_cfg.models)
    prompt_ids = [tok.encode(p) for p in demo_prompts()]
    torch.manual_seed(0)
    base = PPOWorker(base_cfg)
    off_cfg = _with_reward_model(tiny(1, inter=False, intra=False,
                                      placement=PlacementSection(offload=True)))
    torch.manual_seed(0)
    off = PPOWorker(off_cfg)
    assert {o.name for o in off.frozen} == {"ref", "reward"}
    nbytes = sum(o.nbytes for o in off.frozen)
    for it in range(ITERATIONS):
        ps = prompts_for(prompt_ids, it, base_cfg.generation.prompts_per_iteration)
        a, b = base.iteration(ps), off.iteration(ps)
        assert all(o.device_elements() == 0 for o in off.frozen), it
        assert b.metrics["offload/bytes"] == nbytes
        assert "offload/bytes" not in a.metrics
        for x, y in zip(a.experiences, b.experiences, strict=True):
            assert x.response_ids == y.response_ids
            assert torch.equal(x.ref_logprobs, y.ref_logprobs), (it, x.sample_id)
            assert x.reward == y.reward and torch.equal(x.values, y.values)
    sa, sb = base.canonical_state(), off.canonical_state()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def colocated2():
    return run(_with_reward_model(tiny(2)))


def test_colocated_loop_with_offload_equals_without(colocated2):
    res = run(_with_reward_model(tiny(2, placement=PlacementSection(offload=["ref", "reward"]))))
    # Within 1e-6, as every multi-rank comparison: which samples share a scoring micro-batch
    # depends on when they finish, which may move float64 rounding (the one-process run above
    # is bit for bit).
    assert_same_run(colocated2, res)
    b = _frozen_bytes()
    assert all(h["offload/bytes"] == 2 * (b["ref"] + b["reward"]) for h in res["history"])


def test_placed_loop_with_offload_equals_colocated(colocated2):
    """interleaved2 on 4 ranks: the Ref on the generation ranks 0-1, the Reward on 2-3 (fed
    by the sample queues), both offloaded: the co-located run without offload."""
    res = run(_with_reward_model(tiny(4, micro_batches=2, placement=PlacementSection(
        preset="interleaved2", offload=True))))
    assert_same_run(colocated2, res)
    b = _frozen_bytes()
    assert all(h["offload/bytes"] == 2 * b["ref"] + 2 * b["reward"] for h in res["history"])
    assert all(h["offload/prefetch_s"] > 0 for h in res["history"])


def _frozen_bytes() -> dict[str, int]:
    """Bytes of the tiny Ref and Reward as scored (float64): what one rank holding each
    prefetches per iteration."""
    m = build_models(_with_reward_model(tiny(1)).models)
    return {name: 8 * sum(t.numel() for t in [*mod.parameters(), *mod.buffers()])
            for name, mod in (("ref", m.ref), ("reward", m.reward))}


def test_bad_offload_values_name_the_fix():
    with pytest.raises(LoopConfigError, match="actor is trained.*only the frozen ref"):
        resolve_run(tiny(2, placement=PlacementSection(offload=["actor"])))
    with pytest.raises(LoopConfigError, match="unknown model 'refs'"):
        resolve_run(tiny(2, placement=PlacementSection(offload=["refs"])))
    with pytest.raises(LoopConfigError, match="give true"):
        resolve_run(tiny(2, placement=PlacementSection(offload="ref")))
    cfg = tiny(2, placement=PlacementSection(offload=True))
    resolve_run(cfg)
    assert cfg.offloaded() == ("ref", "reward")
    assert tiny(2).offloaded() == ()


def test_a_search_at_start_plans_with_the_runs_offload(tmp_path):
    """placement: {search: S, offload: true}: the plan is searched with the frozen models in
    host memory (offload_frozen) and says so; without offload it offloads nothing."""
    import json

    from rlhf_fusion.loop.placement import search_plan

    for offload, want in ((True, ["ref", "reward"]), (None, [])):
        cfg = tiny(4, micro_batches=4, placement=PlacementSection(search=0.5, offload=offload))
        path = search_plan(cfg, 8.0, tmp_path / f"plan-{offload}.json")
        assert json.loads(open(path).read())["offload"] == want
