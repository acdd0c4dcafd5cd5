"""R_t = 0 ("the planner predicts no gain") is a rollout without migration on every path:
the rollout layer, the TRL trainers' migrating rollout, and ``rt="auto"`` falling back to 0
and coming back over several generation batches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlhf_fusion.rollout.config import RolloutConfig, check_rollout  # noqa: E402
from rlhf_fusion.rollout.local import LocalFusedRollout  # noqa: E402
from rlhf_fusion.rollout.rt_control import RtPlanner  # noqa: E402
from rlhf_fusion.rollout.types import RolloutConfigError, SampleSpec  # noqa: E402


def _specs(n: int = 8) -> list[SampleSpec]:
    return [SampleSpec(sample_id=i, prompt_ids=(2, 3, 4), max_new_tokens=6, seed=0,
                       temperature=1.0, stop_token_ids=(1,)) for i in range(n)]


def test_rt_zero_is_no_migration_in_the_rollout_config():
    specs = _specs()
    assert check_rollout(specs, RolloutConfig(fused=True, rt=0), 2, bs_max=8) is None
    assert not RolloutConfig(fused=True, rt=0).migrates(8)
    assert RolloutConfig(fused=True, rt=1).migrates(8)
    assert check_rollout(specs, RolloutConfig(fused=True, rt=2), 2, bs_max=8) == 1
    with pytest.raises(RolloutConfigError, match="use 0 for no migration"):
        RolloutConfig(fused=True, rt=-1).resolve_rt(8)


def test_local_rollout_with_rt_zero_equals_the_serial_rollout():
    from rlhf_fusion.rollout.reference import ReferenceBackend
    from rlhf_fusion.testing.trl import tiny_causal_lm

    def run(rt):
        backends = [ReferenceBackend(tiny_causal_lm(40, seed=0), instance_id=i)
                    for i in range(2)]
        return LocalFusedRollout(backends, rt=rt).run(_specs())

    zero, serial = run(0), run(None)
    assert zero.assignment is None
    assert [r.token_ids for r in zero.results] == [r.token_ids for r in serial.results]
    assert [r.sample_id for r in zero.results] == list(range(8))


def test_rt_auto_falls_back_to_zero_and_comes_back():
    """The planner alone over scripted rollouts (what the 2-process test below feeds the
    trainer's planner): migration while the batch has a tail, 0 while every response is as
    long as the others, back once the tail returns (hysteresis: twice MIN_GAIN to return)."""
    from rlhf_fusion.testing.trl import script_planner

    p = RtPlanner(16, 2, bs_max=8)
    history = []
    for kind in ["tail", "flat", "flat", "tail", "tail"]:
        script_planner(p, kind)
        history.append(p.rt())
    assert history[0] >= 1 and history[1] == 0 and history[2] == 0, history
    assert history[4] >= 1, history


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("trl")
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


@pytest.mark.parametrize("algo", ["grpo", pytest.param("rloo", marks=pytest.mark.slow)])
def test_two_process_grpo_with_rt_auto_falling_to_zero_and_back(algo, model_dir, tmp_path):
    """2 processes, FusedGRPOTrainer with ``rt="auto"``: the planner is driven to 0 and back
    (scripted observations, so the choice does not depend on timings); every generation batch
    runs through the trainer's migrating rollout at that R_t and gives the same completions and
    advantages as the run without migration; then one optimizer step (``train()``) runs with
    the planner at 0. FusedRLOOTrainer the same (slow: the same migration code)."""
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.testing.trl import grpo_rt_script_worker

    script = ["tail", "flat", "tail"]
    runs = []
    for s in (script, []):
        res = run_ranks(grpo_rt_script_worker, 2, model_dir, str(tmp_path / "out"), s, algo,
                        timeout=300)
        runs.append([r.value for r in sorted(res, key=lambda r: r.rank)])
    scripted, local = runs
    rts = scripted[0]["rt"]
    assert rts == scripted[1]["rt"]  # rank 0 decides, every rank follows
    assert rts[0] >= 1 and rts[1] == 0 and rts[2] >= 1, rts
    assert len(rts) == len(script) + 1 and rts[-1] == 0  # the train() step's rollout
    for rank in range(2):
        for i, (a, b) in enumerate(zip(scripted[rank]["batches"], local[rank]["batches"])):
            assert a["completion_ids"] == b["completion_ids"], (rank, i)
            assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-6), (rank, i)
            if rts[i] == 0:
                assert a["moved"] == [], (rank, i)
        assert scripted[rank]["global_step"] == 1 and len(scripted[rank]["loss"]) == 1


# -- the generation copy of a sharded policy ----------------------------------------------------
@pytest.mark.parametrize("kind", [pytest.param("zero3", marks=pytest.mark.slow), "fsdp2"])
def test_generation_copy_of_a_sharded_policy_is_whole_and_follows_the_step(model_dir, kind):
    """ZeRO-3 (DeepSpeed's CPU accelerator) and FSDP2 (``fully_shard`` over gloo), 2 ranks:
    each rank holds part of the weights; the copy built from the gathered weights is a plain
    model whose logits equal the unsharded model's bit for bit, and after one optimizer step
    the refreshed copy equals the sharded model's own forward, bit for bit (both measured 0.0).
    ZeRO-3 is ``slow`` (about a minute: importing DeepSpeed and its engine set-up)."""
    if kind == "zero3":
        pytest.importorskip("deepspeed")
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.testing.trl import sharded_copy_worker

    res = run_ranks(sharded_copy_worker, 2, model_dir, kind, timeout=240)
    for r in res:
        v = r.value
        assert v["sharding"] == kind and v["copy_sharded"] is None, v
        assert v["copy_type"] == "LlamaForCausalLM"
        assert v["local_numel"] < 0.75 * v["full_numel"], v  # this rank holds about half
        assert v["before"] == 0.0, v
        assert v["moved"] > 0.0, v   # the step changed the policy, and the copy followed
        assert v["after"] == 0.0, v


def test_building_the_generation_copy_leaves_the_trainer_rng_alone(model_dir):
    """The copy of a sharded policy is built from its config (random init, then the gathered
    weights). The trainer's torch RNG is checkpointed, and a resumed run builds the copy at a
    later step than the uninterrupted run, so drawing from that RNG made a resumed ZeRO-3 run
    end with other weights (``test_trl_launch.py::test_launch_resume_...[grpo-zero3-on]``)."""
    from transformers import AutoModelForCausalLM

    from rlhf_fusion.integrations.trl.sharded import plain_copy

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    clone = plain_copy(model, model.state_dict())
    assert torch.equal(torch.rand(8), expected)
    for k, v in model.state_dict().items():
        assert torch.equal(clone.state_dict()[k], v), k
