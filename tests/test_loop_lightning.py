"""The RLHF loop through Lightning: RLHFModule alone (one device) and with RLHFLoopStrategy."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import lightning as L  # noqa: E402
from test_loop import merged, run, tiny  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from rlhf_fusion.loop.demo import demo_prompts  # noqa: E402
from rlhf_fusion.plugins import PromptLoader, RLHFLoopStrategy, RLHFModule  # noqa: E402


def loader(n: int) -> DataLoader:
    return DataLoader(demo_prompts()[:n], batch_size=16, shuffle=False, drop_last=True)


def fit(tmp_path, name: str, cfg, *, devices: int, epochs: int, prompts: int = 48,
        ckpt_path=None, precision="32-true", data=None, every_step: bool = False):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / name, save_last=True,
        **({"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"} if every_step
           else {"save_top_k": 0}))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_epochs=epochs, precision=precision,
        strategy=RLHFLoopStrategy(timeout_s=60) if devices > 1 else "auto",
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name=name), callbacks=[ckpt],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        log_every_n_steps=1)
    trainer.fit(RLHFModule(cfg), data if data is not None else loader(prompts),
                ckpt_path=ckpt_path)
    return tmp_path / name / "last.ckpt", trainer


def ckpt_state(path) -> dict[str, torch.Tensor]:
    """The Actor/Critic parameters held by the ranks' shares of a checkpoint."""
    shares = torch.load(path, map_location="cpu", weights_only=False)["rlhf_loop_ranks"]
    out: dict[str, torch.Tensor] = {}
    for share in shares:
        for role, sd in share["models"].items():
            for k, v in sd.items():
                out[f"{role}.{k}"] = v
    return out


def max_diff(a: dict, ref: dict) -> float:
    assert set(ref) <= set(a), sorted(set(ref) - set(a))[:3]
    return max((a[k] - ref[k]).abs().max().item() for k in ref)


@pytest.fixture(scope="module")
def reference():
    return merged(run(tiny(1, inter=False, intra=False)))


def test_module_on_one_device_and_fused_on_two_equal_the_loop(tmp_path, reference):
    one, _ = fit(tmp_path, "one", tiny(2), devices=1, epochs=1)
    assert max_diff(ckpt_state(one), reference) <= 1e-6
    two, _ = fit(tmp_path, "two", tiny(2), devices=2, epochs=1)
    assert max_diff(ckpt_state(two), reference) <= 1e-6
    import csv

    rows = list(csv.DictReader(open(tmp_path / "two" / "version_0" / "metrics.csv")))
    assert len(rows) == 3
    for key in ("objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg",
                "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg",
                "val/clipfrac_avg", "time/generation", "time/inference", "time/training",
                "time/weight_sync", "samples_per_s", "response_length/p99"):
        assert math.isfinite(float(rows[-1][key])), key


def test_resume_from_an_epoch_checkpoint_is_exact(tmp_path):
    whole, _ = fit(tmp_path, "whole", tiny(2), devices=2, epochs=2, prompts=32)
    first, _ = fit(tmp_path, "first", tiny(2), devices=2, epochs=1, prompts=32)
    resumed, _ = fit(tmp_path, "resumed", tiny(2), devices=2, epochs=2, prompts=32,
                     ckpt_path=first)
    a, b = ckpt_state(resumed), ckpt_state(whole)
    assert max_diff(a, b) == 0.0
    assert max_diff(b, ckpt_state(first)) > 0  # the second epoch trained


def test_resume_in_the_middle_of_an_epoch_is_exact(tmp_path):
    """A step-1 checkpoint of a 3-iteration epoch, resumed: the same prompts and parameters as
    the uninterrupted run (PromptLoader restarts at batch 1); a plain DataLoader is refused."""
    prompts = demo_prompts()[:48]
    whole, _ = fit(tmp_path, "whole", tiny(2), devices=2, epochs=1, every_step=True,
                   data=PromptLoader(prompts, 16, shuffle=True, seed=7))
    # One Lightning step per PPO iteration (the ranks ran in spawned processes: read it back).
    assert torch.load(whole, map_location="cpu", weights_only=False)["global_step"] == 3
    mid = tmp_path / "whole" / "step=1.ckpt"
    assert mid.exists()
    resumed, _ = fit(tmp_path, "resumed", tiny(2), devices=2, epochs=1, ckpt_path=mid,
                     data=PromptLoader(prompts, 16, shuffle=True, seed=7))
    assert max_diff(ckpt_state(resumed), ckpt_state(whole)) == 0.0
    assert max_diff(ckpt_state(whole), ckpt_state(mid)) > 0   # steps 2 and 3 trained
    one = tiny(1, inter=False, intra=False)
    fit(tmp_path, "plain", one, devices=1, epochs=1, every_step=True)
    with pytest.raises(ValueError, match="PromptLoader"):
        fit(tmp_path, "plain2", one, devices=1, epochs=1,
            ckpt_path=tmp_path / "plain" / "step=1.ckpt")


def test_bf16_mixed_trains_through_the_pipeline(tmp_path):
    cfg = tiny(1, inter=False, intra=False)
    cfg.iterations = 1
    fp32 = merged(run(cfg))
    path, _ = fit(tmp_path, "bf16", tiny(2), devices=2, epochs=1, prompts=16,
                  precision="bf16-mixed")
    state = ckpt_state(path)
    diffs = [(state[k] - fp32[k]).abs().max().item() for k in fp32]
    assert all(math.isfinite(d) for d in diffs)
    # bf16 autocast changed the arithmetic, and training still went where fp32 went.
    assert 0 < max(diffs) < 0.05


class _SigtermAt(L.pytorch.Callback):
    """SIGTERM to this very process as step ``at`` starts (a scheduler's, mid-run)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_on_one_device_checkpoints_the_step_and_resumes_exactly(tmp_path):
    """RLHFModule alone: SIGTERM during step 1 ends fit normally after it, with an hpc
    checkpoint that ``ckpt_path="hpc"`` resumes to the uninterrupted run's parameters."""
    import signal

    cfg = tiny(1, inter=False, intra=False)
    prompts = demo_prompts()[:48]

    def trainer(name: str, callbacks=()) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         default_root_dir=tmp_path / name, callbacks=list(callbacks),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)

    before = signal.getsignal(signal.SIGTERM)
    whole = RLHFModule(cfg)
    trainer("whole").fit(whole, PromptLoader(prompts, 16))
    stopped = RLHFModule(cfg)
    t = trainer("run", [_SigtermAt(1)])
    t.fit(stopped, PromptLoader(prompts, 16))
    assert signal.getsignal(signal.SIGTERM) == before   # Lightning put the handler back
    assert t.global_step == 2 and stopped.stopped_checkpoint is not None
    assert stopped.stopped_checkpoint == str(tmp_path / "run" / "hpc_ckpt_1.ckpt")
    assert max_diff(ckpt_state(stopped.stopped_checkpoint), whole.trained_state()) > 0
    resumed = RLHFModule(cfg)
    trainer("run").fit(resumed, PromptLoader(prompts, 16), ckpt_path="hpc")
    assert max_diff(resumed.trained_state(), whole.trained_state()) == 0.0


def test_grpo_through_lightning_on_one_and_two_devices_equals_the_loop(tmp_path):
    """algorithm: grpo in RLHFModule: no Critic in the checkpoint, and the parameters of the
    loop's one-process run (one device, and 2 data-parallel ranks under the strategy)."""
    from test_critic_free import config

    from rlhf_fusion.loop import train
    from rlhf_fusion.loop.arithmetic import arithmetic_prompts

    prompts = arithmetic_prompts()
    ref = merged(train(config(), prompts, progress=False))
    data = DataLoader(prompts[:8], batch_size=4, shuffle=False, drop_last=True)
    one, _ = fit(tmp_path, "one", config(), devices=1, epochs=1, data=data)
    two, _ = fit(tmp_path, "two", config(world=2, inter=True), devices=2, epochs=1, data=data)
    for path in (one, two):
        got = ckpt_state(path)
        assert set(got) == set(ref) and all(k.startswith("actor.") for k in got)
        assert all(torch.equal(got[k], ref[k]) for k in ref)
