"""FusedGRPOTrainer / FusedRLOOTrainer against TRL's own trainers, on tiny local models."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from rlhf_fusion.integrations.trl.compat import TRLCompatError  # noqa: E402
from rlhf_fusion.integrations.trl.fusion import FusionConfig, FusionConfigError  # noqa: E402
from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer  # noqa: E402
from rlhf_fusion.integrations.trl.rloo import FusedRLOOTrainer  # noqa: E402
from rlhf_fusion.testing.trl import (  # noqa: E402
    length_reward,
    tiny_model_dir,
    tiny_prompt_dataset,
    tiny_tokenizer,
    vowel_reward,
)

ALGOS = {
    "grpo": (GRPOTrainer, FusedGRPOTrainer, GRPOConfig),
    "rloo": (RLOOTrainer, FusedRLOOTrainer, RLOOConfig),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def tailed_model_dir(tmp_path_factory):
    # EOS-biased: sampled lengths are geometric, so the batch has a long tail.
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


def make(cls, config_cls, model, tmp_path, *, fusion=None, **overrides):
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
              num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1e-2,
              beta=0.04, bf16=False, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              save_strategy="no", disable_tqdm=True)
    kw.update(overrides)
    extra = {} if fusion is None else {"fusion": fusion}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model, reward_funcs=[vowel_reward, length_reward],
                      args=config_cls(**kw), train_dataset=tiny_prompt_dataset(None, 16),
                      processing_class=tiny_tokenizer(), **extra)
    trainer.model.train()
    return trainer


def generation_inputs(n_prompts=3, g=4):
    prompts = ["the cat sings", "hello there", "what is it?", "a dog runs"][:n_prompts]
    return [{"prompt": p} for p in prompts for _ in range(g)]


def spy(monkeypatch, cls, name, log):
    """Record every call of ``cls.name`` (signature kept, so the seam check still passes)."""
    real = getattr(cls, name)

    @functools.wraps(real)
    def wrapper(self, *args, **kwargs):
        log.append((self, args, kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)


def masked(t, mask):
    return t[mask.bool()]


# -- (1) fused scoring = stock scoring of the same completions ---------------------------------
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_streamed_scores_equal_stock_on_the_same_completions(algo, model_dir, tmp_path,
                                                             monkeypatch):
    stock_cls, fused_cls, cfg = ALGOS[algo]
    fused = make(fused_cls, cfg, model_dir, tmp_path)
    stock = make(stock_cls, cfg, model_dir, tmp_path)
    rewards, logps = [], []
    spy(monkeypatch, stock_cls, "_calculate_rewards", rewards)
    spy(monkeypatch, stock_cls, "_get_per_token_logps_and_entropies", logps)
    inputs = generation_inputs()
    out_f = fused._generate_and_score_completions(inputs)

    # Streaming did the scoring, in micro-batches: no full-batch reward or Ref pass.
    n = len(inputs)
    assert sum(len(a[1]) for _, a, _ in rewards) == n
    assert max(len(a[1]) for _, a, _ in rewards) <= 4
    assert all(a[1].size(0) <= 4 for _, a, _ in logps)
    assert any(a[0] is fused.ref_model for _, a, _ in logps)

    # Feed the same completions through the stock trainer's own generation seam.
    ids = [row[m.bool()].tolist() for row, m in
           zip(out_f["completion_ids"], out_f["completion_mask"])]
    monkeypatch.setattr(
        stock, "_generate_single_turn",
        lambda *a, **k: (ids, None) if algo == "grpo" else ids)
    out_s = stock._generate_and_score_completions(inputs)

    mask = out_s["completion_mask"]
    assert torch.equal(out_f["completion_ids"], out_s["completion_ids"])
    assert torch.equal(out_f["completion_mask"], mask)
    for name in ("vowel_reward", "length_reward"):
        assert fused._logs["rewards"][name] == stock._logs["rewards"][name]
    assert torch.allclose(out_f["advantages"], out_s["advantages"], atol=1e-5, rtol=0)
    assert torch.allclose(masked(out_f["ref_per_token_logps"], mask) if algo == "grpo"
                          else out_f["old_logps"],
                          masked(out_s["ref_per_token_logps"], mask) if algo == "grpo"
                          else out_s["old_logps"], atol=1e-5, rtol=0)
    for t in (fused, stock):
        t.current_gradient_accumulation_steps = 1  # set by Trainer.train otherwise
    loss_f = fused.compute_loss(fused.model, out_f)
    loss_s = stock.compute_loss(stock.model, out_s)
    assert torch.isfinite(loss_f)
    assert abs(loss_f.item() - loss_s.item()) <= 1e-5


# -- (2) FusionConfig.off() = stock, step for step ------------------------------------------------
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_off_matches_stock_parameters_after_three_steps(algo, model_dir, tmp_path):
    stock_cls, fused_cls, cfg = ALGOS[algo]
    runs = []
    for cls, fusion in ((stock_cls, None), (fused_cls, FusionConfig.off())):
        trainer = make(cls, cfg, model_dir, tmp_path / cls.__name__, fusion=fusion, max_steps=3)
        trainer.train()
        runs.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    initial = make(stock_cls, cfg, model_dir, tmp_path / "init").model.state_dict()
    assert any(not torch.equal(initial[k], runs[0][k]) for k in initial)  # training moved it
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_fused_training_runs_and_moves_the_policy(model_dir, tmp_path):
    trainer = make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert all("reward" in h for h in trainer.state.log_history[:2])


# -- (3) exactly once; streaming = scoring after generation -----------------------------------
def test_streaming_equals_non_streaming_and_every_completion_comes_back_once(
        tailed_model_dir, tmp_path, monkeypatch):
    outs, unfinished_at_scoring = [], []
    emitted = []
    for stream in (True, False):
        trainer = make(FusedGRPOTrainer, GRPOConfig, tailed_model_dir, tmp_path,
                       fusion=FusionConfig(max_batch_size=5), max_completion_length=24)
        trainer.score_while_decoding = stream
        log: list = []
        monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", _recording_unfinished(
            GRPOTrainer._calculate_rewards, log))
        ids: list[int] = []
        _record_steps(monkeypatch, trainer._generation_backend(), ids)
        outs.append(trainer._generate_and_score_completions(generation_inputs(4, 4)))
        unfinished_at_scoring.append(log)
        emitted.append(ids)
        monkeypatch.undo()
    for ids in emitted:
        assert sorted(ids) == list(range(16))  # every completion exactly once
    lengths = outs[0]["completion_mask"].sum(1)
    assert lengths.max() > 2 * lengths.float().median()  # a tail to stream past
    assert max(unfinished_at_scoring[0]) > 0  # streaming scored while samples still decoded
    assert max(unfinished_at_scoring[1]) == 0
    a, b = outs
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    assert torch.equal(a["advantages"], b["advantages"])
    m = a["completion_mask"]
    assert torch.allclose(masked(a["ref_per_token_logps"], m),
                          masked(b["ref_per_token_logps"], m), atol=1e-6, rtol=0)


def _record_steps(monkeypatch, backend, ids):
    real = backend.step

    def step():
        out = real()
        ids.extend(r.sample_id for r in out)
        return out

    monkeypatch.setattr(backend, "step", step)


def _recording_unfinished(real, log):
    @functools.wraps(real)
    def wrapper(self, *args, **kwargs):
        backend = getattr(self, "_fusion_backend", None)
        log.append(len(backend.unfinished()) if backend is not None else -1)
        return real(self, *args, **kwargs)
    return wrapper


def test_generation_is_deterministic_per_seed_and_round(model_dir, tmp_path):
    a = make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path)
    b = make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path)
    first = [a._generate_and_score_completions(generation_inputs())["completion_ids"]
             for _ in range(2)]
    again = b._generate_and_score_completions(generation_inputs())["completion_ids"]
    assert torch.equal(first[0], again)
    assert not torch.equal(first[0], first[1])  # a new round draws new samples


# -- (4) an unsupported TRL fails at construction, naming the version and the range ------------
def test_bad_private_signature_fails_at_construction(model_dir, tmp_path, monkeypatch):
    def _generate_single_turn(self, prompt_ids, sampling_params):
        raise AssertionError("never called")

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", _generate_single_turn)
    with pytest.raises(TRLCompatError) as err:
        make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path)
    msg = str(err.value)
    assert f"installed TRL {trl.__version__}" in msg
    assert "1.12 through 1.16" in msg
    assert "_generate_single_turn(prompt_ids, sampling_params)" in msg


def test_unsupported_sampling_settings_are_refused(model_dir, tmp_path):
    with pytest.raises(FusionConfigError, match="top_p=0.9"):
        make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path, top_p=0.9)
    make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path, top_p=0.9,
         fusion=FusionConfig(stream=False, migrate=False))


# -- (5) the example runs on a tiny local model ------------------------------------------------
def test_example_runs_on_a_tiny_local_model(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny-model")
    example = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--model", model, "--max-steps", "2", "--cpu",
         "--max-completion-length", "8", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout


def test_benchmark_quick_mode_runs():
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "trl.py"
    proc = subprocess.run([sys.executable, str(bench), "--algos", "grpo", "--quick",
                           "--no-write"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo: fused" in proc.stderr and "x stock samples/s" in proc.stderr


# -- long-tail migration across 2 processes = per-process streaming ---------------------------
def test_two_process_migration_gives_the_same_batch(tailed_model_dir, tmp_path):
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.testing.trl import grpo_rank_worker

    runs = []
    # R_t at 90% of the batch: migration starts while both processes still decode, so
    # samples move whatever the timing of the first finishes.
    for kw in ({"migrate": True, "rt": 0.9, "mechanism": "kv"}, {"migrate": False}):
        res = run_ranks(grpo_rank_worker, 2, tailed_model_dir, str(tmp_path / "out"), kw,
                        timeout=240)
        runs.append([r.value for r in sorted(res, key=lambda r: r.rank)])
    assert runs[0][0]["moved"] and runs[0][0]["moved"] == runs[0][1]["moved"]  # it migrated
    for migrated, local in zip(*runs):
        assert migrated["num_processes"] == 2
        assert local["moved"] == []
        assert migrated["completion_ids"] == local["completion_ids"]
        assert migrated["advantages"] == pytest.approx(local["advantages"], abs=1e-6)
        m = torch.tensor(local["completion_mask"]).bool()
        assert torch.allclose(torch.tensor(migrated["ref"])[m], torch.tensor(local["ref"])[m],
                              atol=1e-5, rtol=0)


def test_a_scoring_pass_waits_for_enough_padded_tokens_or_rows():
    from rlhf_fusion.integrations.trl.scoring import pass_is_full
    from rlhf_fusion.rollout.types import SampleResult

    def done(n: int, length: int) -> list[SampleResult]:
        return [SampleResult(sample_id=i, prompt_ids=(2,), token_ids=(3,) * length,
                             logprobs=(0.0,) * length, finish_reason="stop")
                for i in range(n)]

    # Short completions: 8 finished samples of width 10 + 4 are far from one pass's worth
    # of tokens, so they wait (scoring them now would pay a pass's fixed cost for 112 tokens).
    assert not pass_is_full(done(8, 4), 10, max_rows=64, min_tokens=1024)
    assert pass_is_full(done(74, 4), 10, max_rows=128, min_tokens=1024)  # 74 x 14 >= 1024
    assert pass_is_full(done(8, 120), 10, max_rows=64, min_tokens=1024)  # 8 x 130 >= 1024
    assert pass_is_full(done(4, 4), 10, max_rows=4, min_tokens=1024)     # a full batch
    assert not pass_is_full([], 10, max_rows=1, min_tokens=0)
