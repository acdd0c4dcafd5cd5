"""OpenRLHF integration: streaming sample generation with long-tail migration, on real local Ray
actors running OpenRLHF's RolloutRayActor over a fake engine with vLLM AsyncLLM's semantics,
against the stock SamplesGenerator._generate_vllm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from rlhf_fusion.integrations.openrlhf import FusionOptions  # noqa: E402
from rlhf_fusion.testing.openrlhf import (  # noqa: E402
    HOOK_WITH_STUBS,
    StubTokenizer,
    install_cpu_stubs,
    remove_cpu_stubs,
)

MODEL = "fake:vocab=12,eos=0,tick_s=0.01"  # slow enough that exports land mid-sample
PROMPTS = [f"prompt {i} " + "x" * (i % 5) for i in range(12)]
N = 2


@pytest.fixture(scope="module")
def setup():
    added = install_cpu_stubs()
    from openrlhf.trainer.ray import vllm_engine as ve

    from rlhf_fusion.integrations.openrlhf import plugins
    from rlhf_fusion.integrations.openrlhf.engine import make_fusion_rollout_actor
    from rlhf_fusion.integrations.openrlhf.launch import ray_runtime_env

    stock_actor = ve.RolloutRayActor
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env=ray_runtime_env(FusionOptions(), hook=HOOK_WITH_STUBS))

    def engines(cls):
        return [cls.options(num_cpus=0).remote(model=MODEL, seed=i, num_gpus=0)
                for i in range(2)]

    stock = engines(stock_actor)
    fused = engines(make_fusion_rollout_actor(stock_actor))
    ray.get([e.get_num_unfinished_requests.remote() for e in stock + fused], timeout=120)
    yield SimpleNamespace(stock=stock, fused=fused, plugins=plugins)
    plugins.uninstall_plugins()
    ray.shutdown()
    remove_cpu_stubs(added)


def _generator(engines):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=N, batch_size=len(PROMPTS)),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="tis"),
                             dynamic_filtering_range=(0.0, 1.0)),
        vllm=SimpleNamespace(enable_sleep=False))
    return SamplesGenerator(SimpleNamespace(args=args), None, None, StubTokenizer(), engines)


def _run(gen, temperature):
    loader = iter([(None, PROMPTS[i:i + 4], [f"l{i + j}" for j in range(4)], [None] * 4)
                   for i in range(0, len(PROMPTS), 4)])
    return gen._generate_vllm(loader, len(PROMPTS), False, max_len=40, max_new_tokens=24,
                              temperature=temperature, top_p=1.0)


def _key(e):
    return (e.prompts[0], e.labels[0], tuple(e.sequences[0].tolist()),
            tuple(e.action_mask[0].tolist()), tuple(e.rollout_log_probs[0].tolist()),
            bool(e.truncated[0]), int(e.response_length[0]))


def _stock(setup, temperature):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    setup.plugins.uninstall_plugins()
    assert SamplesGenerator._generate_vllm.__module__.startswith("openrlhf.")
    return _run(_generator(setup.stock), temperature)


def _fused(setup, temperature, rt):
    setup.plugins.install_plugins(FusionOptions(stream=True, rt=rt))
    gen = _generator(setup.fused)
    return gen, _run(gen, temperature)


def test_streaming_with_migration_returns_the_stock_samples_exactly_once(setup):
    want, consumed, exhausted = _stock(setup, temperature=0.0)
    gen, (got, consumed2, exhausted2) = _fused(setup, temperature=0.0, rt=0.75)
    stats = gen._fusion_stats
    assert stats.migrated, "the tail was not migrated; the test would prove nothing"
    assert len(got) == len(want) == len(PROMPTS) * N == stats.samples
    assert (consumed2, exhausted2) == (consumed, exhausted)
    # greedy: a migrated sample (prompt + generated ids resubmitted) continues as unmoved
    assert sorted(map(_key, got)) == sorted(map(_key, want))
    # every migrated sample was finished by another engine than the one it started on
    assert stats.requests == stats.samples + len(stats.migrated)


def test_sampled_streaming_with_migration_is_exactly_once(setup):
    gen, (got, _, _) = _fused(setup, temperature=1.0, rt=0.75)
    stats = gen._fusion_stats
    assert stats.migrated
    assert sorted(e.prompts[0] for e in got) == sorted(PROMPTS * N)
    for e in got:  # rollout logprobs line up with the tokens of migrated samples too
        n_act = int(e.action_mask[0].sum())
        assert n_act == int(e.response_length[0]) and 1 <= n_act <= 24


def test_driver_cost_tokenizer_once_per_engine_waits_per_engine_prompts_stay_local(
        setup, monkeypatch):
    """The tokenizer goes to each engine once (not with every request); each ray.wait covers
    at most one poll and one submit per engine (not every pending sample); without migration
    all of a prompt's samples finish on the engine its prompt went to (prefix cache)."""
    from rlhf_fusion.testing.openrlhf import StubTokenizer as Tok

    widths = []
    real_wait = ray.wait

    def wait(refs, **kw):
        widths.append(len(refs))
        return real_wait(refs, **kw)

    setup.plugins.install_plugins(FusionOptions(stream=True))
    gen = _generator(setup.fused)
    before = Tok.pickles
    monkeypatch.setattr(ray, "wait", wait)
    got, _, _ = _run(gen, temperature=0.0)
    got2, _, _ = _run(gen, temperature=0.0)
    monkeypatch.setattr(ray, "wait", real_wait)
    assert len(got) == len(got2) == len(PROMPTS) * N
    assert Tok.pickles - before == 1  # one ray.put, read by both engines, for both batches
    assert widths and max(widths) <= 2 * len(setup.fused)
    stats = gen._fusion_stats
    assert not stats.migrated
    by_prompt = {}
    for key, engine in stats.engines.items():
        by_prompt.setdefault(key // N, set()).add(engine)
    assert len(by_prompt) == len(PROMPTS)
    assert all(len(engines) == 1 for engines in by_prompt.values())
    assert len({e for es in by_prompt.values() for e in es}) == 2  # both engines used


def test_wait_bound_is_a_flag_and_the_counters_reach_the_status(setup, monkeypatch):
    from rlhf_fusion.integrations.openrlhf.streaming import fusion_metrics
    from rlhf_fusion.rollout.types import RolloutError

    gen, _ = _fused(setup, temperature=0.0, rt=0.75)
    migrated = len(gen._fusion_stats.migrated)
    metrics = fusion_metrics(gen)
    assert metrics["fusion/samples"] == len(PROMPTS) * N
    assert metrics["fusion/migrated_samples"] == migrated > 0
    assert metrics["fusion/requests"] == len(PROMPTS) * N + migrated
    assert fusion_metrics(gen) == {}  # reported once
    setup.plugins.uninstall_plugins()
    setup.plugins.install_plugins(FusionOptions(stream=True, wait_s=5.0))
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: ([], list(refs)))  # nothing finishes
    with pytest.raises(RolloutError, match=r"no sample finished in 5 s \(--fusion.wait_s\)"):
        _run(_generator(setup.fused), temperature=0.0)
