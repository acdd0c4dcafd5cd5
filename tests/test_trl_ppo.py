"""FusedPPOTrainer against trl 1.12's PPOTrainer: stock equality, each plugin, streaming, migration."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*right-padding was detected.*")

from rlhf_fusion.integrations.trl import FusedPPOTrainer, FusionConfig, FusionConfigError  # noqa: E402
from rlhf_fusion.integrations.trl.ppo_config import TRL_HAS_PPO, PPOConfig  # noqa: E402
from rlhf_fusion.integrations.trl.rollout import left_pad, score_padded  # noqa: E402
from rlhf_fusion.testing.trl import tiny_causal_lm, tiny_tokenizer  # noqa: E402

needs_stock = pytest.mark.skipif(not TRL_HAS_PPO, reason="stock PPOTrainer exists in trl<=1.12")
PROMPTS = ["the cat sings", "a dog runs", "hello there", "go on now", "blue sky", "say it"]


def _models(vocab: int, seed: int = 0, *, tie: bool = False):
    from transformers import LlamaConfig, LlamaForSequenceClassification, set_seed

    def cfg():
        return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, pad_token_id=0, num_labels=1)

    # A policy whose own sampling gives long-tailed lengths (so streaming and migration have
    # a tail to work on), then Critic and Reward.
    policy = tiny_causal_lm(vocab, seed, eos_bias=1.5)
    if tie:  # input and output embeddings one tensor, as most small Hub models have them
        policy.config.tie_word_embeddings = True
        policy.lm_head.weight = policy.model.embed_tokens.weight
    set_seed(seed)
    return policy, LlamaForSequenceClassification(cfg()), LlamaForSequenceClassification(cfg())


def _trainer(cls, tmp_path, *, steps: int = 3, batch: int = 4, config: dict | None = None,
             tie: bool = False, **kw):
    from datasets import Dataset

    tok = tiny_tokenizer()
    policy, value, reward = _models(len(tok), tie=tie)
    ds = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in PROMPTS * 4]})
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=batch,
        gradient_accumulation_steps=2, num_ppo_epochs=2, num_mini_batches=2,
        total_episodes=steps * 2 * batch, response_length=32, stop_token="eos",
        report_to=[], save_strategy="no", num_sample_generations=0,
        local_rollout_forward_batch_size=batch, seed=0, learning_rate=1e-3, logging_steps=1,
        bf16=False, disable_tqdm=True, kl_estimator="k3", missing_eos_penalty=0.1)
    args = PPOConfig(**{**settings, **(config or {})})
    return cls(args=args, processing_class=tok, model=policy, ref_model=None,
               reward_model=reward, train_dataset=ds, value_model=value, **kw)


def _params(tr) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _logs(tr) -> list[dict]:
    return [h for h in tr.state.log_history if "objective/kl" in h]


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """trl 1.12's PPOTrainer (or, where TRL has none, ours with every plugin off)."""
    if TRL_HAS_PPO:
        from trl.experimental.ppo import PPOTrainer

        tr = _trainer(PPOTrainer, tmp_path_factory.mktemp("stock"))
    else:
        tr = _trainer(FusedPPOTrainer, tmp_path_factory.mktemp("off"),
                      fusion=FusionConfig.off())
    tr.train()
    return _params(tr), _logs(tr)


@needs_stock
def test_off_is_stock_bit_for_bit(stock_run, tmp_path):
    tr = _trainer(FusedPPOTrainer, tmp_path, fusion=FusionConfig.off())
    tr.train()
    params, logs = stock_run
    assert _max_diff(_params(tr), params) == 0.0
    ours = _logs(tr)
    assert len(ours) == len(logs) == 3
    for mine, stock in zip(ours, logs):
        # Every metric stock TRL logs, with the same value ("eps" is wall-clock).
        assert {k: v for k, v in stock.items() if k != "eps"} == {
            k: mine[k] for k in stock if k != "eps"}
        assert {"time/generation", "time/inference", "time/training", "samples_per_s",
                "response_length/p99"} <= mine.keys()


@pytest.mark.parametrize("plugin", ["gae", "trim_padding", "padding_free"])
def test_one_plugin_stays_within_1e5_of_stock(stock_run, tmp_path, plugin):
    tr = _trainer(FusedPPOTrainer, tmp_path, fusion=FusionConfig.off().with_(**{plugin: True}))
    tr.train()
    params, logs = stock_run
    diff = _max_diff(_params(tr), params)
    assert diff <= 1e-5
    if plugin != "gae":
        assert diff > 0  # the micro-batches really were cut or packed (other matmul shapes)
    for mine, stock in zip(_logs(tr), logs):
        for k in ("objective/kl", "loss/policy_avg", "loss/value_avg", "val/ratio",
                  "policy/approxkl_avg"):
            assert mine[k] == pytest.approx(stock[k], rel=1e-4, abs=1e-6), k


def test_streamed_experience_is_the_stock_scoring_of_the_same_tokens(tmp_path):
    tr = _trainer(FusedPPOTrainer, tmp_path, fusion=FusionConfig(migrate=False), batch=8)
    queries = next(iter(tr.dataloader))["input_ids"]
    unwrapped = tr.accelerator.unwrap_model(tr.model)
    got = tr._streamed_rollout(queries, 1, unwrapped)
    # Every query got exactly one response, in order, behind its own (left-padded) query row.
    assert got.query_responses.shape[0] == queries.shape[0]
    assert torch.equal(got.query_responses[:, : queries.shape[1]], left_pad(queries, 0))
    queries = left_pad(queries, 0)
    lp, ref, values, scores = score_padded(
        ref=tr.ref_model, critic=unwrapped.value_model, reward=tr.reward_model,
        queries=queries, query_responses=got.query_responses, gen_logits=None, chunk=4,
        pad_id=0, stop_id=tr.stop_token_id, temperature=tr.args.temperature)
    assert lp is None
    resp = got.responses
    lengths = (resp != 0).cumprod(1).sum(1)  # through the first pad: what TRL scores
    assert int(lengths.min()) < int(lengths.max())  # a ragged batch
    for i, g in enumerate(lengths.tolist()):
        torch.testing.assert_close(got.ref_logprobs[i, :g], ref[i, :g], atol=1e-5, rtol=0)
        n = min(g + 1, resp.shape[1])  # the Critic also reads one position past the end
        torch.testing.assert_close(got.values[i, :n], values[i, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.scores, scores, atol=1e-5, rtol=0)
    # Generation logprobs are the policy's, tempered, on those tokens.
    from rlhf_fusion.integrations.trl.rollout import lm_forward

    with torch.no_grad():
        logits = lm_forward(unwrapped.policy, got.query_responses, 0).logits
        logits = logits[:, queries.shape[1] - 1: -1] / (tr.args.temperature + 1e-7)
        pol = torch.log_softmax(logits, -1).gather(2, resp[..., None])[..., 0]
    for i, g in enumerate(lengths.tolist()):
        torch.testing.assert_close(got.logprobs[i, :g], pol[i, :g], atol=1e-4, rtol=0)


def test_streamed_training_runs_and_logs_fusion_timings(tmp_path):
    tr = _trainer(FusedPPOTrainer, tmp_path, steps=2, fusion=FusionConfig(migrate=False))
    tr.train()
    logs = _logs(tr)
    assert len(logs) == 2 and all(h["time/weight_sync"] >= 0 for h in logs)
    assert all(torch.isfinite(v).all() for v in _params(tr).values())


def _two_process_run(rank: int, world: int, out_dir: str, migrate: bool):
    import pathlib

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="true")
    fusion = FusionConfig(migrate=migrate, rt=0.9, mechanism="tokens")
    if migrate:
        # R_t scripted per rollout, 0 every other one: R_t = 0 must be a rollout without
        # migration (rt="auto" reaches it when the planner predicts no gain), and the next
        # rollout migrates again.
        from rlhf_fusion.integrations.trl import migration

        fixed = migration.RtChooser.rt
        calls = []

        def scripted(self, batch):
            calls.append(batch)
            return 0 if len(calls) % 2 == 0 else fixed(self, batch)

        migration.RtChooser.rt = scripted
    # One sample per scoring forward: a sample's scores then do not depend on which samples
    # finished beside it (float32 matmuls differ in the last bits with the batch shape), so
    # the runs with and without migration may agree to 1e-6.
    tr = _trainer(FusedPPOTrainer, pathlib.Path(out_dir) / f"{migrate}", steps=6, fusion=fusion,
                  config={"local_rollout_forward_batch_size": 1})
    tr.train()
    logs = _logs(tr)
    return _params(tr), [(h.get("fusion/rt"), h.get("fusion/migrated", 0)) for h in logs]


def test_migration_across_two_processes_changes_nothing(tmp_path):
    """Two processes migrating the long tail at R_t = 90% of the batch, and at R_t = 0 (no
    migration) every other rollout, end with the parameters of two processes without
    migration (1e-6)."""
    from rlhf_fusion.launch import run_ranks

    moved = run_ranks(_two_process_run, 2, str(tmp_path), True, timeout=240)
    still = run_ranks(_two_process_run, 2, str(tmp_path), False, timeout=240)
    for a, b in zip(moved, still):
        assert _max_diff(a.value[0], b.value[0]) <= 1e-6
    rts = [rt for rt, _ in moved[0].value[1]]
    assert rts == [14, 0, 14]  # 90% of 16 samples, none, then 90% again
    migrated = [n for _, n in moved[0].value[1]]
    assert migrated[1] == 0 and migrated[0] + migrated[2] > 0


def test_unsupported_settings_fail_with_the_fix(tmp_path):
    with pytest.raises(FusionConfigError, match="rt=2"):
        FusionConfig(rt=2)
    with pytest.raises(FusionConfigError, match="migrate=True needs stream=True"):
        FusionConfig(stream=False)
    with pytest.raises(FusionConfigError, match="unknown FusionConfig field"):
        FusionConfig.off().with_(gea=True)
    with pytest.raises(FusionConfigError, match="pipeline_stages"):
        _trainer(FusedPPOTrainer, tmp_path, fusion=FusionConfig(pipeline_stages=2))
    if importlib.util.find_spec("peft") is not None:
        with pytest.raises(FusionConfigError, match="cannot cut a PEFT model"):
            _trainer(FusedPPOTrainer, tmp_path, peft_config=_lora(),
                     fusion=FusionConfig(pipeline_stages=2))


@needs_stock
def test_checkpoints_have_the_stock_layout_and_weights(tmp_path):
    from safetensors.torch import load_file
    from trl.experimental.ppo import PPOTrainer

    dirs = {}
    for name, cls, kw in (("stock", PPOTrainer, {}),
                          ("ours", FusedPPOTrainer, {"fusion": FusionConfig.off()})):
        tr = _trainer(cls, tmp_path / name, steps=2, **kw)
        tr.args.save_strategy = "steps"
        tr.args.save_steps = 2
        tr.train()
        (ckpt,) = sorted((tmp_path / name).glob("checkpoint-*"))
        dirs[name] = ckpt
    assert dirs["stock"].name == dirs["ours"].name
    files = {n: sorted(p.name for p in d.iterdir()) for n, d in dirs.items()}
    assert files["stock"] == files["ours"] and "model.safetensors" in files["ours"]
    a, b = (load_file(str(d / "model.safetensors")) for d in dirs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_example_runs_on_a_local_model_dir(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_fusion.testing.trl import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny", eos_bias=1.5)
    example = Path(__file__).resolve().parents[1] / "examples" / "trl_ppo.py"
    out = subprocess.run(
        [sys.executable, str(example), "--model", model, "--output-dir", str(tmp_path / "run"),
         "--episodes", "16", "--response-length", "16", "--cpu"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done: 2 iterations, episode 16, objective/scores" in out.stdout
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_vllm_backend_gets_every_query_and_the_policy_weights(tmp_path, monkeypatch):
    from rlhf_fusion.rollout import vllm_backend
    from rlhf_fusion.testing.vllm import FakeAsyncLLM, fake_vllm_module

    engine = FakeAsyncLLM(vocab=len(tiny_tokenizer()))
    module = fake_vllm_module(engine)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: module)
    tr = _trainer(FusedPPOTrainer, tmp_path, steps=1,
                  fusion=FusionConfig(backend="vllm", migrate=False,
                                      vllm_engine_kwargs={"gpu_memory_utilization": 0.3}))
    tr.policy_model.config._name_or_path = "tiny-policy"  # as from_pretrained leaves it
    tr.train()
    (args,) = module.engine_args
    assert args["model"] == "tiny-policy" and args["gpu_memory_utilization"] == 0.3
    assert args["logprobs_mode"] == "processed_logprobs"
    # Every query of the step went to the engine once, with TRL's budget and temperature.
    assert len(engine.requests) == 2 * 4
    assert {tuple(p) for _, p, _ in engine.requests} <= set(_prompt_ids())
    assert all(p.max_tokens == 32 and p.temperature == pytest.approx(0.7)
               for _, _, p in engine.requests)
    # The policy's weights were pushed before generating, under their HF names.
    assert [m for m, _ in engine.rpc[:2]] == ["rlhf_fusion_seed_by_position",
                                              "rlhf_fusion_load_weights"]
    assert engine.loaded == list(tr.accelerator.unwrap_model(tr.model).policy.state_dict())


def _prompt_ids() -> list[tuple[int, ...]]:
    tok = tiny_tokenizer()
    return [tuple(tok(p)["input_ids"]) for p in PROMPTS]


def test_vllm_backend_needs_a_checkpoint_path(tmp_path):
    tr = _trainer(FusedPPOTrainer, tmp_path, steps=1,
                  fusion=FusionConfig(backend="vllm", migrate=False))
    tr.policy_model.config._name_or_path = ""
    with pytest.raises(FusionConfigError, match="save_pretrained"):
        tr.train()


def _pipeline_run(rank: int, world: int, out_dir: str, stages: int, mini_batches: int,
                  tie: bool = False):
    import pathlib

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="true")
    fusion = FusionConfig(migrate=False, pipeline_stages=stages, solver="greedy")
    tr = _trainer(FusedPPOTrainer, pathlib.Path(out_dir) / f"{stages}-{mini_batches}-{tie}",
                  steps=4, fusion=fusion, config={"num_mini_batches": mini_batches}, tie=tie)
    # accelerate ends gradient accumulation at a dataloader's last batch (every micro-batch
    # then steps); the pipeline steps every gradient_accumulation_steps micro-batches. Compare
    # the two on the accumulation both intend.
    tr.accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"] = False
    tr.train()
    whole = tr._whole_models()
    params = {f"policy.{k}": v.detach().clone() for k, v in whole.policy.named_parameters()}
    params.update({f"value_model.{k}": v.detach().clone()
                   for k, v in whole.value_model.named_parameters()})
    logs = _logs(tr)
    if tr._pipeline is not None:
        tr._pipeline.close()
    return params, [(h["loss/policy_avg"], h["loss/value_avg"]) for h in logs]


@pytest.mark.parametrize(("mini_batches", "tie"), [(1, False), (2, False), (1, True)])
def test_fused_pipeline_equals_data_parallel(tmp_path, mini_batches, tie):
    """Two processes as one Actor/Critic pipeline of 2 stages train like two DDP processes:
    same parameters (1e-6) and losses, with one or several optimizer steps per batch, and
    with the policy's input and output embeddings tied (the embedding on stage 0, the head
    on stage 1)."""
    from rlhf_fusion.launch import run_ranks

    piped = run_ranks(_pipeline_run, 2, str(tmp_path), 2, mini_batches, tie, timeout=300)
    ddp = run_ranks(_pipeline_run, 2, str(tmp_path), 1, mini_batches, tie, timeout=300)
    for a, b in zip(piped, ddp):
        assert _max_diff(a.value[0], b.value[0]) <= 1e-6
        for (pa, va), (pb, vb) in zip(a.value[1], b.value[1]):
            assert pa == pytest.approx(pb, rel=1e-4, abs=1e-7)
            assert va == pytest.approx(vb, rel=1e-4, abs=1e-7)
    assert _max_diff(piped[0].value[0], piped[1].value[0]) == 0.0  # one model, everywhere


def test_rt_auto_starts_at_a_quarter_then_follows_the_simulator():
    from types import SimpleNamespace

    from rlhf_fusion.integrations.trl.migration import RtChooser

    assert RtChooser(0.5, 8, 2).rt(64) == 32
    auto = RtChooser("auto", 8, 2)
    assert auto.rt(64) == 16  # no lengths seen yet: a quarter of the batch
    # A long tail, decode steps that cost the same at any batch size, and scoring worth
    # overlapping with the tail: migrating early pays (by more than the planner's MIN_GAIN; at
    # 1 ms per 1000 scored tokens the predicted gain is 0.6% and R_t falls back to 0).
    lengths = [4] * 56 + [200] * 8
    timed = SimpleNamespace(steps=[(b, 1e-3) for b in range(1, 9) for _ in range(5)])
    results = [SimpleNamespace(token_ids=(0,) * n) for n in lengths]
    auto.observe(results, timed, [(8, 1000, 1e-2)], prompt_len=8)
    chosen = auto.rt(64)
    assert auto.planner.dist is not None and auto.planner.by_batch  # the rollout was seen
    assert 1 <= chosen <= 64 and chosen != 16 and auto.planner.history == [16, chosen]


@needs_stock
def test_masked_mean_and_whiten_trl_exact_are_trls_own():
    from trl.experimental.ppo.ppo_trainer import masked_mean as trl_mean
    from trl.experimental.ppo.ppo_trainer import masked_whiten as trl_whiten

    from rlhf_fusion.runtime.masked import masked_mean, whiten

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        v = torch.randn(4, 9, generator=g).to(dtype) * 3 + 1
        m = torch.rand(4, 9, generator=g) > 0.3
        assert torch.equal(masked_mean(v, m, trl_exact=True), trl_mean(v, m))
        for shift in (True, False):
            assert torch.equal(whiten(v, m, shift_mean=shift, trl_exact=True),
                               trl_whiten(v, m, shift_mean=shift))
        # The default keeps TRL's statistics and zeroes the masked positions.
        w = whiten(v, m)
        torch.testing.assert_close(w[m], trl_whiten(v, m)[m])
        assert not w[~m].any()
    # An empty mask: 0 by default, NaN as TRL's; whitening over it raises as TRL's does.
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(torch.ones(2, 3), empty).item() == 0.0
    assert masked_mean(torch.ones(2, 3), empty, trl_exact=True).isnan()
    with pytest.raises(ValueError):
        trl_whiten(torch.ones(2, 3), empty)
    with pytest.raises(ValueError, match="empty mask"):
        whiten(torch.ones(2, 3), empty, trl_exact=True)


def _lora():
    peft = pytest.importorskip("peft")
    # Random A and B (init_lora_weights=False): the adapter changes the policy from the start,
    # so the adapter-free Ref differs from the policy and a wrong Ref changes the KL.
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@needs_stock
def test_peft_off_is_stock_bit_for_bit(tmp_path):
    """peft_config with every plugin off: the same LoRA policy, Ref (the adapter-free policy),
    parameters and logged metrics as trl 1.12's PPOTrainer, bit for bit."""
    from trl.experimental.ppo import PPOTrainer

    runs = {}
    for name, cls, kw in (("stock", PPOTrainer, {}),
                          ("ours", FusedPPOTrainer, {"fusion": FusionConfig.off()})):
        tr = _trainer(cls, tmp_path / name, steps=2, peft_config=_lora(), **kw)
        assert tr.ref_model is None and tr.is_peft_model
        tr.train()
        runs[name] = _params(tr), _logs(tr)
    (p_stock, l_stock), (p_ours, l_ours) = runs["stock"], runs["ours"]
    assert any("lora_A" in k for k in p_ours)
    assert _max_diff(p_ours, p_stock) == 0.0
    assert len(l_ours) == len(l_stock) == 2
    for mine, stock in zip(l_ours, l_stock):
        assert {k: v for k, v in stock.items() if k != "eps"} == {
            k: mine[k] for k in stock if k != "eps"}
    assert l_ours[0]["objective/kl"] != 0.0  # the Ref really is not the adapted policy


def test_peft_streamed_ref_is_the_adapter_free_policy(tmp_path):
    """peft_config with the plugins on: every query answered once, generation logprobs equal
    the adapted policy's teacher-forced ones, Ref logprobs the adapter-free policy's; then
    two iterations train only the adapter and the Critic."""
    from rlhf_fusion.integrations.trl.rollout import lm_forward

    tr = _trainer(FusedPPOTrainer, tmp_path, steps=2, peft_config=_lora(),
                  fusion=FusionConfig(migrate=False))
    queries = next(iter(tr.dataloader))["input_ids"]
    net = tr.accelerator.unwrap_model(tr.model)
    got = tr._streamed_rollout(queries, 1, net)
    queries = left_pad(queries, 0)
    assert torch.equal(got.query_responses[:, : queries.shape[1]], queries)
    resp = got.responses
    lengths = (resp != 0).cumprod(1).sum(1)
    ctx = queries.shape[1]

    def logprobs(model):
        with torch.no_grad():
            logits = lm_forward(model, got.query_responses, 0).logits[:, ctx - 1: -1]
            logits = logits / (tr.args.temperature + 1e-7)
            return torch.log_softmax(logits, -1).gather(2, resp[..., None])[..., 0]

    pol = logprobs(net.policy)
    with net.policy.disable_adapter():
        ref = logprobs(net.policy)
    gap = max((pol[i, :g] - ref[i, :g]).abs().max().item() for i, g in
              enumerate(lengths.tolist()))
    assert gap > 1e-2  # the adapter matters, so answering with the wrong model fails
    for i, g in enumerate(lengths.tolist()):
        torch.testing.assert_close(got.logprobs[i, :g], pol[i, :g], atol=1e-4, rtol=0)
        torch.testing.assert_close(got.ref_logprobs[i, :g], ref[i, :g], atol=1e-5, rtol=0)
    base = {k: v.clone() for k, v in _params(tr).items() if "lora_" not in k}
    tr.train()
    after = _params(tr)
    assert all(torch.isfinite(v).all() for v in after.values())
    for k, v in base.items():  # the base policy is frozen; the Critic trains
        assert torch.equal(after[k], v) == k.startswith("policy."), k
