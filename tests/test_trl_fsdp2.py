"""FusedGRPOTrainer / FusedRLOOTrainer with a policy that accelerate shards with FSDP2, on the CPU (gloo, 2 ranks).

accelerate 1.15 runs an FSDP config with ``use_cpu`` as plain DDP (no DTensor parameter): it
promotes ``distributed_type`` to FSDP only from a multi-accelerator type. The worker
(``rlhf_fusion.testing.trl.fsdp2_grpo_worker``) switches the shared accelerator state to FSDP
with an FSDP2 plugin before ``train()`` prepares the model, so accelerate's own
``fsdp2_prepare_model`` shards the policy, and checks what the issue asks of a sharded policy:
its parameters are DTensors (each rank holds about half), the generation copy is built from
the gathered full weights and generates with the sharded policy's logprobs, the copy is
refreshed after every optimizer step, and every sample comes back exactly once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tail"), seed=1, eos_bias=1.5)


@pytest.mark.parametrize("algo", ["grpo", pytest.param("rloo", marks=pytest.mark.slow)])
def test_fused_grpo_on_an_fsdp2_sharded_policy(algo, model_dir, tmp_path):
    """GRPO in the default selection; RLOO (the same seams) is ``slow``."""
    from rlhf_fusion.launch import run_ranks
    from rlhf_fusion.testing.trl import fsdp2_grpo_worker

    res = sorted(run_ranks(fsdp2_grpo_worker, 2, model_dir, str(tmp_path / "out"), STEPS,
                           algo, timeout=300), key=lambda r: r.rank)
    for rank, r in enumerate(res):
        v = r.value
        assert v["is_fsdp2"] and v["global_step"] == STEPS, v
        recs = v["records"]
        assert len(recs) == STEPS, recs  # one rollout per optimizer step
        for rec in recs:
            # accelerate's FSDP2 path prepared it (fully_shard's class swap), and says so
            assert rec["is_fsdp2"] and rec["wrapped"] == "FSDPLlamaForCausalLM", rec
            assert rec["dtensor"] and rec["policy_sharded"] == "fsdp2", rec
            assert rec["local_numel"] < 0.75 * rec["full_numel"], rec  # about half here
            assert rec["copy_sharded"] is None and rec["copy_diff"] == 0.0, rec
            assert rec["lp_diff"] <= 1e-4, rec
            n = rec["prompts"]
            assert rec["ids"] == list(range(rank * n, rank * n + n)), rec  # each sample once
        sums = [rec["copy_sum"] for rec in recs]
        assert len(set(sums)) == STEPS, sums  # refreshed after every optimizer step
