"""The RLHF loop end to end: fused vs serial vs one device, faults, resume, config errors."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from rlhf_fusion.launch import DistributedRunError  # noqa: E402
from rlhf_fusion.loop import (  # noqa: E402
    FusionLoopConfig,
    GenerationConfig,
    LoopConfigError,
    ModelsConfig,
    PPOLoopConfig,
    RLHFConfig,
    train,
)
from rlhf_fusion.loop import advantages as adv  # noqa: E402
from rlhf_fusion.loop.demo import demo_prompts  # noqa: E402
from rlhf_fusion.loop.resolve import resolve_run  # noqa: E402
from rlhf_fusion.loop.run import prompts_for  # noqa: E402
from rlhf_fusion.rollout.inference import Experience  # noqa: E402
from rlhf_fusion.triton_kernels import gae_reference  # noqa: E402

ITERATIONS = 3
# Layouts that sum gradients across processes (data-parallel replicas, Critic copies): the
# bound docs/loop.md ("Exactness") documents. Pipeline layouts are compared with tol=0.
DP_BOUND = 1e-5


def tiny(world: int = 2, *, inter: bool = True, intra: bool = True, mechanism: str = "kv",
         critic_stages: int | None = None, pipeline_stages: int | None = None,
         rt: str | float = "auto", micro_batches: int = 2, **kw) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 4, "hidden": 32}, seed=3),
        generation=GenerationConfig(prompts_per_iteration=16, max_new_tokens=40, seed=5),
        ppo=PPOLoopConfig(num_ppo_epochs=2, num_mini_batches=2, micro_batches=micro_batches,
                          learning_rate=3e-3, kl_coef=0.05),
        fusion=FusionLoopConfig(inter=inter, intra=intra, rt=rt, mechanism=mechanism,
                            critic_stages=critic_stages, pipeline_stages=pipeline_stages,
                            solver="greedy", timeout_s=60.0),
        world_size=world, iterations=ITERATIONS, **kw)


def run(cfg: RLHFConfig, **kw) -> dict:
    return train(cfg, demo_prompts(), progress=False, keep_experiences=True, **kw)


def merged(res: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for st in res["states"]:
        for k, v in st.items():
            assert k not in out, f"{k} saved by two ranks"
            out[k] = v
    return out


def assert_same_run(a: dict, b: dict, *, tol: float = DP_BOUND) -> None:
    assert len(a["experience_log"]) == len(b["experience_log"]) == ITERATIONS
    for it, (ea, eb) in enumerate(zip(a["experience_log"], b["experience_log"], strict=True)):
        assert [e.sample_id for e in ea] == list(range(16)), f"iteration {it}: exactly once"
        for x, y in zip(ea, eb, strict=True):
            assert x.response_ids == y.response_ids, f"iteration {it} sample {x.sample_id}"
            for field in ("logprobs", "ref_logprobs", "values"):
                d = (getattr(x, field) - getattr(y, field)).abs().max().item()
                assert d <= max(tol, 1e-12), (it, x.sample_id, field, d)
            assert abs(x.reward - y.reward) <= max(tol, 1e-12)
    sa, sb = merged(a), merged(b)
    assert sa.keys() == sb.keys()
    worst = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert worst <= tol, worst
    # Training moved the weights: the equality above is not the initial state twice.
    assert a["history"][-1]["objective/kl"] > 0


def one_thread_run(cfg: RLHFConfig) -> dict:
    """A one-device run with the ranks' intra-op thread count (1): torch splits some
    reductions by thread, and bit-identity compares runs that split them alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_device():
    return one_thread_run(tiny(1, inter=False, intra=False))


@pytest.fixture(scope="module")
def serial2():
    return run(tiny(2, inter=False, intra=False))


def test_fused_equals_serial_equals_one_device(one_device, serial2):
    fused = run(tiny(2))
    assert_same_run(fused, serial2, tol=0.0)
    assert_same_run(fused, one_device, tol=0.0)
    # Inter-stage fusion ran: migration triggered at R_t in the first iteration (a quarter of
    # the batch before any length is seen); later ones migrate unless the simulator predicts
    # no gain (R_t = 0), and then the rollout is the serial one.
    assert fused["history"][0]["fusion/rt"] >= 1
    for h, tl in zip(fused["history"], fused["timelines"], strict=True):
        assert all(r["fused"] == (h["fusion/rt"] >= 1) for r in tl["ranks"]), h["fusion/rt"]
    assert fused["history"][0]["realloc/bytes"] == fused["history"][0]["realloc/min_bytes"] > 0


def test_tokens_mechanism_and_fixed_rt_equal_serial(serial2):
    fixed = run(tiny(2, mechanism="tokens", rt=0.5))
    assert_same_run(fixed, serial2, tol=0.0)
    # R_t fixed at half the batch: the long tail moves (unless the assignment finds the
    # ranks balanced at the trigger), and the loop says how many samples moved; the serial
    # run moves none
    moved = [h["fusion/migrated"] for h in fixed["history"]]
    assert moved == [float(len(tl["ranks"][0]["moved"])) for tl in fixed["timelines"]]
    assert sum(moved) > 0, moved
    assert [h["fusion/migrated"] for h in serial2["history"]] == [0.0] * ITERATIONS


def test_four_ranks_and_two_critic_copies_equal_one_device(one_device):
    assert_same_run(run(tiny(4, critic_stages=2)), one_device)
    assert_same_run(run(tiny(4, mechanism="tokens", intra=False)), one_device, tol=0.0)


def test_two_pipeline_replicas_equal_one_device():
    """4 ranks as 2 data-parallel replicas of a 2-stage fused pipeline: each replica runs
    ``micro_batches`` of every mini-batch, so one device runs twice as many."""
    assert_same_run(run(tiny(4, pipeline_stages=2)),
                    one_thread_run(tiny(1, inter=False, intra=False, micro_batches=4)))


def test_prompts_cycle_through_the_dataset():
    ids = [[i + 2] for i in range(5)]
    assert prompts_for(ids, 0, 3) == [[2], [3], [4]]
    assert prompts_for(ids, 1, 3) == [[5], [6], [2]]


def test_resume_after_a_kill_between_iterations_is_exact(tmp_path, serial2):
    cfg = tiny(2, inter=False, intra=False)
    run(cfg, out_dir=tmp_path, checkpoint_every=1, stop_after=2)
    resumed = run(cfg, out_dir=tmp_path, checkpoint_every=1, resume=True)
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2]
    sa, sb = merged(resumed), merged(serial2)
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) == 0.0
    assert resumed["history"][2]["objective/scores"] == serial2["history"][2]["objective/scores"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c.models.__setattr__("actor", {"family": "bert"}), "unknown model family"),
        (lambda c: c.fusion.__setattr__("rt", 40), "outside the batch"),
        (lambda c: c.ppo.__setattr__("micro_batches", 3), "micro-batches"),
        (lambda c: c.ppo.__setattr__("num_mini_batches", 5), "does not divide"),
        (lambda c: c.fusion.__setattr__("mechanism", "rdma"), "fusion.mechanism"),
    ],
)
def test_bad_config_is_rejected_before_any_process_starts(monkeypatch, change, match):
    import rlhf_fusion.launch as launch

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("a process started"))
    cfg = tiny(2)
    change(cfg)
    with pytest.raises(LoopConfigError, match=match):
        train(cfg, demo_prompts(), progress=False)


def test_config_from_dict_names_unknown_keys():
    with pytest.raises(LoopConfigError, match="unknown keys \\['lr'\\]"):
        RLHFConfig.from_dict({"ppo": {"lr": 1}})
    cfg = RLHFConfig.from_dict({"fusion": {"rt": 0.3}, "world_size": 2})
    assert cfg.rt_samples(None) == round(0.3 * cfg.generation.prompts_per_iteration)


def _die_in_training(stage: str, rank: int, iteration: int) -> None:
    import os

    if stage == "training" and rank == 1 and iteration == 1:
        os._exit(3)


def faulty_rank_main(rank, world, cfg, *args):
    import dataclasses

    from rlhf_fusion.loop.resolve import RunHooks
    from rlhf_fusion.loop.run import rank_main

    run = dataclasses.replace(resolve_run(cfg), hooks=RunHooks(on_stage=_die_in_training))
    return rank_main(rank, world, run, *args)


def test_a_rank_dying_mid_iteration_names_rank_and_stage():
    from rlhf_fusion.launch import run_ranks

    cfg = tiny(2, inter=False, intra=False)
    cfg.fusion.timeout_s = 10.0
    prompt_ids = [list(range(2, 6))] * 16
    with pytest.raises(DistributedRunError) as info:
        run_ranks(faulty_rank_main, 2, cfg, prompt_ids, None, 0, None, False, None, False,
                  collective_timeout=10.0, timeout=120.0)
    by_rank = {r.rank: r for r in info.value.results}
    assert by_rank[1].error_type == "Died"
    assert "rank 0 of 2: training of iteration 1 failed" in by_rank[0].error


def _exp(sid: int, prompt: tuple, resp: tuple, reward: float) -> Experience:
    g = len(resp)
    lp = torch.linspace(-1, -2, g, dtype=torch.float64)
    return Experience(sid, prompt, resp, "stop", lp, lp - 0.1, torch.arange(g) * 0.5, reward)


def test_advantages_gae_and_layout_against_the_reverse_loop():
    exps = [_exp(0, (5, 6, 7), (8, 9), 1.0), _exp(1, (5,), (8, 9, 10, 11), -1.0)]
    rb = adv.response_batch(exps)
    rewards = adv.token_rewards(rb, kl_coef=0.1, kl_mode="reward", estimator="k1")
    # KL penalty on every token, the score on the last one only.
    assert torch.allclose(rewards[0, :2], torch.tensor([-0.01, 1.0 - 0.01], dtype=torch.float64))
    a, r = adv.advantages_and_returns(rb, rewards, gamma=0.9, lam=0.8, whiten_advantages=False)
    ra, rr = gae_reference(rewards, rb.values, rb.mask, gamma=0.9, lam=0.8)
    assert torch.allclose(a, ra.float(), atol=1e-6) and torch.allclose(r, rr.float(), atol=1e-6)
    w = adv.whiten(a.double(), rb.mask)
    valid = w[rb.mask]
    assert abs(valid.mean().item()) < 1e-9 and math.isclose(valid.std().item(), 1.0, rel_tol=1e-6)
    batch = adv.training_batch(exps, a, r, rb, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 11]]
    assert batch["action_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch["advantages"][1, 1:].tolist() == a[1].tolist()
    assert batch["old_logprobs"][0, 3:].tolist() == rb.logprobs[0, :2].float().tolist()


def save_tiny_hub_model(path) -> None:
    """A tiny Llama and a character tokenizer saved as a Hub-style directory (built locally)."""
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
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)).save_pretrained(path)


def test_train_command_and_hub_example_on_a_local_model_dir(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_fusion.cli import main

    model = tmp_path / "tiny-model"
    save_tiny_hub_model(model)
    (tmp_path / "prompts.txt").write_text("the cat sings, go on:\na dog runs, answer:\n")
    (tmp_path / "run.yaml").write_text(
        f"world_size: 2\niterations: 2\nprompts: prompts.txt\nmodels: {{actor: {model}}}\n"
        "generation: {prompts_per_iteration: 8, max_new_tokens: 16}\n"
        "ppo: {micro_batches: 2}\nfusion: {solver: greedy, rt: 0.5}\n")
    assert main(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert {"reward_mean", "kl", "samples", "seconds", "gen_s", "inf_s", "train_s",
            "fused"} <= rows[0].keys()
    assert (tmp_path / "run" / "checkpoints" / "iter_00002" / "rank1.pt").exists()
    example = Path(__file__).resolve().parents[1] / "examples" / "ppo_hub.py"
    out = subprocess.run(
        [sys.executable, str(example), "--model", str(model), "--iterations", "1",
         "--prompts-per-iteration", "8", "--max-new-tokens", "12", "--out",
         str(tmp_path / "ex")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOAD REPORT" not in out.stderr   # the Critic backbone leaves lm_head out on purpose
    assert (tmp_path / "ex" / "metrics.jsonl").read_text().count("\n") == 1


def test_bad_yaml_fails_with_the_field_named(tmp_path, capsys):
    from rlhf_fusion.cli import main

    (tmp_path / "bad.yaml").write_text("fusion: {rt: 2.5}\n")
    assert main(["train", str(tmp_path / "bad.yaml")]) == 2
    assert "fusion.rt" in capsys.readouterr().err


def test_vllm_generation_backend_in_the_loop(tmp_path, monkeypatch):
    """backend: vllm builds one engine per rank from the actor checkpoint, pushes the Actor's
    weights by name before generating, sleeps it while training and sends every prompt once
    (against the fake engine; tests/test_vllm_real.py runs the loop on real vLLM)."""
    from rlhf_fusion.loop.iteration import PPOWorker
    from rlhf_fusion.rollout import vllm_backend
    from rlhf_fusion.testing.vllm import FakeAsyncLLM, fake_vllm_module

    model = tmp_path / "tiny-model"
    save_tiny_hub_model(model)
    engine = FakeAsyncLLM(vocab=36)
    module = fake_vllm_module(engine)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: module)
    cfg = tiny(1, inter=False, intra=False)
    cfg.models = ModelsConfig(actor=str(model))
    cfg.generation.backend = "vllm"
    cfg.generation.vllm_engine_kwargs = {"gpu_memory_utilization": 0.3}
    worker = PPOWorker(cfg)
    prompts = [list(range(2, 8))] * 16
    result = worker.iteration(prompts)
    assert engine.asleep  # slept while training ran
    worker.close()
    (args,) = module.engine_args
    assert args["model"] == str(model) and args["gpu_memory_utilization"] == 0.3
    assert args["logprobs_mode"] == "processed_logprobs" and args["enable_sleep_mode"]
    assert sorted(e.sample_id for e in result.experiences) == list(range(16))
    assert len(engine.requests) == 16
    assert [m for m, _ in engine.rpc[:2]] == ["rlhf_fusion_seed_by_position",
                                              "rlhf_fusion_load_weights"]
    assert set(engine.loaded) == {n for n, _ in worker.models.actor.named_parameters()}
    with pytest.raises(LoopConfigError, match="vLLM engines export no KV cache"):
        bad = tiny(2, mechanism="kv")
        bad.models = ModelsConfig(actor=str(model))
        bad.generation.backend = "vllm"
        resolve_run(bad)


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_ppo_adapts_its_kl_coefficient_with_the_controller_grpo_uses(kl_mode):
    """algorithm.kl_ctrl: adaptive under ppo: each iteration's coefficient is the controller's
    update on the previous one's KL per token (Ziegler et al.'s rule, clipped at 20% per
    horizon), and it is the one the penalty used (in the reward: objective/non_score_reward)."""
    from rlhf_fusion.algorithms import AdaptiveKLController
    from rlhf_fusion.loop.algorithm_config import AlgorithmConfig

    cfg = tiny(1, inter=False, intra=False, algorithm=AlgorithmConfig(
        name="ppo", kl_ctrl="adaptive", target_kl=0.01, kl_horizon=16))
    cfg.ppo.kl_mode = kl_mode
    hist = run(cfg)["history"]
    want = AdaptiveKLController(0.05, 0.01, 16)
    for h in hist:
        assert h["objective/kl_coef"] == want.value
        if kl_mode == "reward":
            assert h["objective/non_score_reward"] == pytest.approx(
                -want.value * h["objective/kl"], rel=1e-12)
        want.update(h["objective/kl_per_token"], 16)
    assert hist[-1]["objective/kl_coef"] != 0.05
