"""``train(resume_from_checkpoint=...)`` of FusedGRPOTrainer / FusedRLOOTrainer, every plugin on.

TRL's own trainers resume exactly on these settings (one generation per optimizer step): a run
of 4 steps checkpointed at step 2 and resumed from there ends with the uninterrupted run's
weights, bit for bit (``test_stock_resume_is_exact``, slow: it pins what the fused tests
claim to match). The fused trainers must do the same: their sampling seeds derive from a
generation round that the checkpoint carries (``rlhf_fusion_state.json``); without it a resumed
run would draw round 0's samples again (``test_resume_without_fusion_state_warns``, slow: it shows
that the round is what makes resume exact, and the warning).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from rlhf_fusion.integrations.trl.fusion import FusionConfig  # noqa: E402
from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer  # noqa: E402
from rlhf_fusion.integrations.trl.rloo import FusedRLOOTrainer  # noqa: E402
from rlhf_fusion.integrations.trl.streaming import FUSION_STATE_NAME  # noqa: E402
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
STEPS, SAVE = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # EOS-biased: completions of different lengths, so other samples give other updates.
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


def make(cls, config_cls, model, out, **extra):
    args = config_cls(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=12, max_steps=STEPS, save_strategy="steps", save_steps=SAVE,
        learning_rate=1e-2, beta=0.04, bf16=False, use_cpu=True, report_to=[],
        logging_steps=1, seed=0, disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model=model, reward_funcs=[vowel_reward, length_reward], args=args,
                   train_dataset=tiny_prompt_dataset(None, 16),
                   processing_class=tiny_tokenizer(), **extra)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def rewards(trainer):
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def uninterrupted(cls, config_cls, model, tmp_path):
    """(the uninterrupted trainer, its final weights, a copy of its step-2 checkpoint in the
    output folder of the run that resumes from it, a fresh trainer as a new process has)."""
    full = make(cls, config_cls, model, tmp_path / "full")
    full.train()
    ckpt = tmp_path / "resumed" / f"checkpoint-{SAVE}"
    shutil.copytree(tmp_path / "full" / ckpt.name, ckpt)
    return full, weights(full), ckpt


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_fused_resume_equals_the_uninterrupted_run(algo, model_dir, tmp_path):
    _, fused_cls, config_cls = ALGOS[algo]
    full, final, ckpt = uninterrupted(fused_cls, config_cls, model_dir, tmp_path)
    state = json.loads((ckpt / FUSION_STATE_NAME).read_text())
    assert state == {"generation_round": SAVE}  # one rollout per step here
    resumed = make(fused_cls, config_cls, model_dir, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == full.state.global_step == STEPS
    assert resumed._fusion_round == full._fusion_round == STEPS
    got = weights(resumed)
    for k in final:
        assert torch.equal(got[k], final[k]), k
    # The resumed run logged the same rewards for steps 3 and 4 (its history holds 1 and 2
    # from the checkpoint's trainer_state.json).
    assert rewards(resumed) == rewards(full)


@pytest.mark.slow
def test_resume_without_fusion_state_warns(model_dir, tmp_path):
    """A checkpoint without the round (written by the stock trainer, say) resumes with a
    warning that the samples differ, and they do: the round is what makes resume exact."""
    full, final, ckpt = uninterrupted(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path)
    (ckpt / FUSION_STATE_NAME).unlink()
    resumed = make(FusedGRPOTrainer, GRPOConfig, model_dir, tmp_path / "resumed")
    with pytest.warns(UserWarning, match=f"has no {FUSION_STATE_NAME}.*restarts at round 0"):
        resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == STEPS
    got = weights(resumed)
    assert any(not torch.equal(got[k], final[k]) for k in final)


def test_off_writes_no_fusion_state(model_dir, tmp_path):
    """FusionConfig.off() checkpoints exactly the files the stock trainer writes."""
    runs = {}
    for name, cls, extra in (("stock", GRPOTrainer, {}),
                             ("off", FusedGRPOTrainer, {"fusion": FusionConfig.off()})):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=4, max_steps=1,
                          save_strategy="steps", save_steps=1, bf16=False, use_cpu=True,
                          report_to=[], disable_tqdm=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = cls(model=model_dir, reward_funcs=[length_reward], args=args,
                    train_dataset=tiny_prompt_dataset(None, 8),
                    processing_class=tiny_tokenizer(), **extra)
        t.train()
        runs[name] = sorted(os.listdir(tmp_path / name / "checkpoint-1"))
    assert runs["off"] == runs["stock"]
    assert FUSION_STATE_NAME not in runs["off"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_stock_resume_is_exact(algo, model_dir, tmp_path):
    """What the fused tests match: TRL's own trainer resumes bit for bit on these settings."""
    stock_cls, _, config_cls = ALGOS[algo]
    full, final, ckpt = uninterrupted(stock_cls, config_cls, model_dir, tmp_path)
    resumed = make(stock_cls, config_cls, model_dir, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == STEPS
    got = weights(resumed)
    for k in final:
        assert torch.equal(got[k], final[k]), k
