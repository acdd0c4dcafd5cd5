"""Runtime: pipelined Actor+Critic training equals unpipelined training; faults raise, not hang.

Each multi-process run spawns its ranks once and trains several configurations in them (the
import of torch + transformers dominates the cost on a 2-core machine).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from rlhf_fusion.launch import run_ranks  # noqa: E402
from rlhf_fusion.testing import (  # noqa: E402
    Case,
    exactness_worker,
    fault_worker,
    max_abs_diff,
    merge_states,
    run_reference,
)

TOL = 1e-6  # fp32, max abs parameter difference after all steps

CASES_2 = [
    # Single copies, micro-batches in order on every stage: expected bit-identical.
    Case("llama4+llama2 S2/S2 M4", {"actor": ("llama", 4), "critic": ("llama", 2, 48)}, 2, 2, 2, 4),
    # Critic with two copies (K2 = 2), one stage each; different families and sizes.
    Case("llama4+qwen2 S2/S1xK2 M8", {"actor": ("llama", 4), "critic": ("qwen2", 2)}, 2, 2, 1, 8),
    # GPT-2 ties the embedding and LM head across stage 0 and stage 1; 1F1B concatenated.
    Case(
        "gpt2(tied)+llama S2/S2 M4 c1f1b",
        {"actor": ("gpt2", 3), "critic": ("llama", 2)},
        2,
        2,
        2,
        4,
        solver="concatenated_1f1b",
    ),
    # KL in the loss instead of the reward; tied Qwen2 actor; GPT-2 critic.
    Case(
        "qwen2(tied)+gpt2 S2/S2 M8 kl-loss",
        {"actor": ("qwen2", 3, 32, True), "critic": ("gpt2", 2)},
        2,
        2,
        2,
        8,
        ppo={"kl_mode": "loss", "kl_coef": 0.1},
    ),
]

CASES_4 = [
    # Critic K2 = 2 copies of 2 stages next to a 4-stage actor.
    Case("llama4+llama2 S4/S2xK2 M8", {"actor": ("llama", 4), "critic": ("llama", 2)}, 4, 4, 2, 8),
    # Both 4 stages, uneven layer split of a 5-layer tied actor.
    Case(
        "qwen2(tied)5+gpt2 S4/S4 M4",
        {"actor": ("qwen2", 5, 32, True), "critic": ("gpt2", 4)},
        4,
        4,
        4,
        4,
    ),
    # Actor with two copies, critic over all four groups.
    Case(
        "llama+llama S2xK2/S4 M8", {"actor": ("llama", 2), "critic": ("llama", 4, 48)}, 4, 2, 4, 8
    ),
    # Two data-parallel replicas of a 2-group fused pipeline (world = 2 x 2).
    Case(
        "dp2 x (llama S2 + qwen2 S1xK2) M4",
        {"actor": ("llama", 2), "critic": ("qwen2", 2)},
        2,
        2,
        1,
        4,
        replicas=2,
    ),
]


@pytest.fixture(scope="module")
def results_2():
    return run_ranks(exactness_worker, 2, CASES_2, timeout=300)


@pytest.fixture(scope="module")
def results_4():
    return run_ranks(exactness_worker, 4, CASES_4, timeout=400)


def _check(case: Case, index: int, results) -> None:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run_reference(case)
    finally:
        torch.set_num_threads(prev)
    got = merge_states([r.value for r in results], index)
    diff, identical = max_abs_diff(ref["state"], got)
    assert diff <= TOL, f"{case.name}: max abs parameter difference {diff:.3g} > {TOL}"
    # The parameters must actually have moved, or equality would prove nothing.
    init = run_reference(Case(**{**case.__dict__, "steps": 0}))["state"]
    moved, _ = max_abs_diff(init, got)
    assert moved > 1e-4, f"{case.name}: parameters did not change ({moved})"
    # Logged losses are the reduced (mean over all micro-batches) values of the reference.
    for step, (r, p) in enumerate(zip(ref["stats"], results[0].value[index]["stats"], strict=True)):
        for model in ("actor", "critic"):
            assert p["stats"][model]["loss"] == pytest.approx(
                r["stats"][model]["loss"], rel=1e-5
            ), (
                case.name,
                step,
                model,
            )
            assert p["grad_norm"][model] == pytest.approx(r["grad_norm"][model], rel=1e-5)
    return identical


@pytest.mark.parametrize("index", range(len(CASES_2)), ids=[c.name for c in CASES_2])
def test_two_ranks_match_unpipelined(results_2, index):
    identical = _check(CASES_2[index], index, results_2)
    if index == 0:
        assert identical, "single-copy, in-order schedule should be bit-identical"


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[c.name for c in CASES_4])
def test_four_ranks_match_unpipelined(results_4, index):
    _check(CASES_4[index], index, results_4)


def _assert_grid_marks_the_wait(msg: str, rank: int, stream=None) -> None:
    """Below its first line, the message shows the step x rank grid of the streams with
    ``rank``'s failing instruction marked ``>x<``, and that instruction is the transfer the first
    line names (and the ``step``-th of ``stream`` when given)."""
    from rlhf_fusion.runtime.comm import Transfer
    from rlhf_fusion.schedule import Action

    first, _, grid = msg.partition("\n\n")
    title = re.match(rf"rank {rank} failed at step (\d+) of its instruction stream \((\S+)\)", grid)
    assert title, msg
    step, action = int(title.group(1)), Action.parse(title.group(2))
    header, *rows = grid.splitlines()[1:]
    assert re.match(r"^ +rank 0 +rank 1$", header), grid
    marked = [row for row in rows if re.search(r">\S+<", row)]
    assert len(marked) == 1, grid
    row = marked[0]
    assert row.startswith(f"step {step}:"), grid
    assert row.index(">") == header.index(f"rank {rank}") - 1, grid  # in rank's column
    assert row[row.index(">") + 1 : row.index("<")] == str(action), grid
    assert Transfer.of(action).describe() in first, msg
    if stream is not None:
        assert stream[step] == action, (step, action)


@pytest.mark.parametrize("mode", ["stall", "die", "mismatch"])
def test_faulty_peer_raises_within_timeout(mode):
    timeout = 2.0
    victim = 1
    res = run_ranks(
        fault_worker, 2, mode, victim, timeout, timeout=120, raise_on_error=False, wait_for=[0]
    )
    survivor = res[0]
    assert survivor.ok, survivor.traceback
    out = survivor.value
    assert out["error_type"] in ("PipelineTimeoutError", "PeerError"), out
    # Within the configured timeout (plus scheduling slack), never a hang.
    assert out["elapsed"] < timeout + 3.0, out
    msg = out["message"]
    assert "rank 0" in msg and ("actor" in msg or "critic" in msg), msg
    if mode == "stall":
        assert out["error_type"] == "PipelineTimeoutError"
        assert "micro-batch" in msg and "stage" in msg, msg
    # Where: the survivor's failing wait is marked in the step x rank grid of the plan's streams.
    from rlhf_fusion.runtime.plan import PipelinePlan
    from rlhf_fusion.schedule import solve
    from rlhf_fusion.testing import fault_case

    case = fault_case()
    _assert_grid_marks_the_wait(msg, 0, PipelinePlan(solve(case.problem(), case.solver)).stream(0))
    if mode == "mismatch":
        # The victim itself sees the wrong micro-batch header first.
        assert res[1].ok and res[1].value["error_type"] == "PeerError", res[1]
        assert "do not match" in res[1].value["message"]
        _assert_grid_marks_the_wait(res[1].value["message"], 1)


def _serial_trace_worker(rank: int, world: int, barrier: bool) -> list[tuple[str, float, float]]:
    from rlhf_fusion.runtime.comm import PipelineComm
    from rlhf_fusion.runtime.engine import EmulatedStageRunner, PipelineEngine
    from rlhf_fusion.runtime.fused import fused_problem
    from rlhf_fusion.runtime.plan import PipelinePlan
    from rlhf_fusion.schedule import solve

    problem = fused_problem(stage_groups=2, micro_batches=2)
    plan = PipelinePlan(solve(problem, "concatenated_1f1b", time_limit=1.0))
    comm = PipelineComm(plan, rank, timeout=60.0)
    runners = {name: EmulatedStageRunner(0.01, 0.02, is_first=res.stage == 0,
                                         is_last=res.stage == 1)
               for name, res in plan.residents(rank).items()}
    engine = PipelineEngine(plan, comm, runners, trace=True, model_barrier=barrier)
    engine.run(None)
    comm.barrier("end")
    comm.close()
    return engine.last_trace.events


@pytest.mark.parametrize("barrier", [True, False])
def test_serial_mode_finishes_the_actor_everywhere_before_the_critic(barrier):
    """RLHFuse-Base: with ``model_barrier`` no Critic action starts on any rank before the
    Actor's last action ended on every rank; the concatenated order alone lets them overlap
    (ranks share one monotonic clock)."""
    res = run_ranks(_serial_trace_worker, 2, barrier, timeout=120)
    events = [e for r in res for e in r.value]
    actor_end = max(end for a, _s, end in events if a.startswith("actor"))
    critic_start = min(start for a, start, _e in events if a.startswith("critic"))
    assert (critic_start >= actor_end) == barrier


@pytest.mark.gpu
def test_gradient_norm_of_cuda_gradients_equals_the_cpu_one():
    # Found by the first GPU run (benchmarks/gpu_check.sh, H200): the float64 accumulator lived on
    # the CPU while the gradients were on cuda:0, so FusedPPOModule's first clip failed.
    from rlhf_fusion.runtime.engine import clip_grad_norm_, grad_norm_sq

    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(7, 5)) for _ in range(3)]
    for p in cpu:
        p.grad = torch.randn_like(p)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    for p, q in zip(gpu, cpu):
        p.grad = q.grad.cuda()
    got = grad_norm_sq(gpu)
    # float32 norms reduced by CUDA's kernels: equal to the CPU's within rounding
    assert got.device.type == "cpu" and torch.allclose(got, grad_norm_sq(cpu), rtol=1e-6)
    assert clip_grad_norm_(gpu, 0.5) == pytest.approx(clip_grad_norm_(cpu, 0.5), rel=1e-6)
    for p, q in zip(gpu, cpu):
        assert torch.allclose(p.grad.cpu(), q.grad, rtol=0, atol=1e-6)
