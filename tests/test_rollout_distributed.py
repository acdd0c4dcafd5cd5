"""The streaming coordinator across spawned gloo ranks (2 processes; a few tests, they are slow).

Fault tests: ``run_ranks``'s deadline (``timeout``) is the rollout timeout plus process start-up;
a rank that hangs past it is reported as ``"Deadline"`` and fails the error-type checks.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_fusion.launch import DistributedRunError, run_ranks
from rlhf_fusion.rollout import RolloutConfig, RolloutConfigError, SampleSpec, check_rollout
from rlhf_fusion.testing import TinyJob, tiny_job_worker

SMALL = dict(vocab_size=64, hidden_size=32, layers=2, heads=4, kv_heads=2)
# Ids alternate between the two ranks; each rank gets two long-tail samples.
TAIL = {2: 60, 3: 55, 4: 45, 7: 50}
SPECS = [SampleSpec(i, [(7 * i) % 64, 1, 2][: 1 + i % 3], max_new_tokens=TAIL.get(i, 2 + i % 5),
                    seed=21, stop_token_ids=(9,) if i == 11 else ()) for i in range(16)]


def job(configs, specs=SPECS, **kw):
    return TinyJob(specs=specs, configs=configs, actor=dict(SMALL, seed=1),
                   ref=dict(SMALL, seed=2), reward=dict(SMALL, seed=3),
                   critic=dict(SMALL, seed=4), bs_max=8, micro_batch=3, **kw)


def serial_and_fused(world, configs, **kw):
    """Rank 0's outputs of ``configs`` (the serial rollout, then the fused one) on ``world``
    ranks."""
    out = [r.value for r in run_ranks(tiny_job_worker, world, job(configs, **kw),
                                      collective_timeout=60)]
    return out[0][0]["output"], out[0][1]["output"]


def assert_equals_serial(serial, fused, n):
    """Every one of the ``n`` samples once, in order, each with the serial rollout's tokens,
    finish reason, Ref logprobs and reward."""
    assert [e.sample_id for e in fused.experiences] == list(range(n))
    for a, b in zip(serial.experiences, fused.experiences, strict=True):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert torch.max(torch.abs(a.ref_logprobs - b.ref_logprobs)).item() < 1e-9
        assert abs(a.reward - b.reward) < 1e-9


def test_two_ranks_fused_equals_serial_for_both_mechanisms():
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=6, mechanism="kv"),
               RolloutConfig(rt=6, mechanism="tokens", report_every=1)]
    out = [r.value for r in run_ranks(tiny_job_worker, 2, job(configs), collective_timeout=60)]
    serial = out[0][0]["output"]
    assert [e.sample_id for e in serial.experiences] == list(range(16))
    for k, mech in ((1, "kv"), (2, "tokens")):
        fused = out[0][k]["output"]
        ranks = fused.stats["ranks"]
        assert {st["mechanism"] for st in ranks} == {mech}
        assert {st["board"] for st in ranks} == {"shared"}  # one host: the shared board
        assert [t for st in ranks for t in st.get("tickets", [])] == ["file"]
        moved = ranks[0]["moved"]
        assert moved, "the long tail of the freed rank must migrate"
        dest = ranks[0]["destinations"]
        assert len(dest) == 1 and all(r.migrated == (r.sample_id in moved) for r in fused.results)
        assert sum(st["scored"] for st in ranks) == 16
        # Whole micro-batches but for at most one per rank, however the stream cut them: no
        # more scoring forwards than the serial rollout's (8 samples a rank, micro-batches of
        # 3: 3 each).
        assert sum(st["scoring_batches"] for st in ranks) <= sum(
            st["scoring_batches"] for st in serial.stats["ranks"]) == 6
        assert [e.sample_id for e in fused.experiences] == list(range(16))
        for a, b in zip(serial.experiences, fused.experiences, strict=True):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            for f in ("logprobs", "ref_logprobs", "values"):
                assert torch.max(torch.abs(getattr(a, f) - getattr(b, f))).item() < 1e-5
            assert abs(a.reward - b.reward) < 1e-5
        # Freed rank started inference before the destination finished generating.
        freed = 1 - dest[0]
        assert ranks[freed]["inference_start_s"] < ranks[dest[0]]["generation_end_s"]


def test_a_rank_whose_shard_ends_before_the_trigger_scores_its_samples_meanwhile():
    """Rank 0's samples end after two tokens, rank 1's run 30-42: rank 0 has nothing to decode
    long before the total falls to R_t. It scores its own finished samples meanwhile (whole
    micro-batches of 3: 6 of its 8) instead of idling, is the freed rank at the trigger, and
    the rollout equals the serial one, every sample scored once."""
    specs = [SampleSpec(i, [(5 * i) % 64, 3], max_new_tokens=2 if i % 2 == 0 or i == 15
                        else 30 + i, seed=5) for i in range(16)]
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=4, mechanism="kv")]
    serial, fused = serial_and_fused(2, configs, specs=specs)
    ranks = fused.stats["ranks"]
    assert ranks[0]["destinations"] == [1] and not ranks[0]["moved"]
    assert ranks[0]["inference_start_s"] < ranks[0]["trigger_s"], ranks[0]
    assert ranks[1]["inference_start_s"] > ranks[1]["trigger_s"]
    assert sum(st["scored"] for st in ranks) == 16
    assert sum(st["scoring_batches"] for st in ranks) <= sum(
        st["scoring_batches"] for st in serial.stats["ranks"])
    assert_equals_serial(serial, fused, 16)


def test_a_destination_still_generating_streams_two_micro_batches_a_chunk():
    """Rank 1 holds six 10-token completions and two 40-token ones, rank 0 only 2-token
    ones: at the trigger rank 1 is the destination with six finished samples (two
    micro-batches of 3) and 30 steps still to decode. Rank 0, hungry, gets all six in one
    chunk: a push and a pop on the critical paths instead of two. The tail's last two come
    after the generation, in chunks of at most one micro-batch."""
    specs = [SampleSpec(i, [(5 * i) % 64, 3], max_new_tokens=(
        2 if i % 2 == 0 else 40 if i in (13, 15) else 10), seed=5) for i in range(16)]
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=4, mechanism="kv")]
    serial, fused = serial_and_fused(2, configs, specs=specs)
    ranks = fused.stats["ranks"]
    assert ranks[1]["destinations"] == [1] and not ranks[1]["moved"]
    chunks = ranks[1]["stream_chunks"]
    assert chunks[0] == 6 and all(c <= 3 for c in chunks[1:]), chunks
    assert sum(st["scored"] for st in ranks) == 16
    assert_equals_serial(serial, fused, 16)


def test_the_rank_that_claims_the_trigger_sends_its_samples_to_a_peer_still_decoding():
    """Rank 0 holds four 60-token completions and decodes 10 ms a step slower; rank 1 two of
    60 tokens, the rest of both shards end after two. Rank 0's second step brings the total
    to R_t = 6 and it claims the trigger with more samples left (4 against 2) than rank 1,
    which is in the middle of a step. It is the source nonetheless: it exports at once and
    rank 1, the destination, finds the tickets when its step ends, where it would have idled
    until rank 1's step ended and rank 1 had exported."""
    specs = [SampleSpec(i, [(5 * i) % 64, 3], max_new_tokens=60 if i in (0, 2, 4, 6, 1, 3)
                        else 2, seed=5) for i in range(16)]
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=6, mechanism="kv")]
    serial, fused = serial_and_fused(2, configs, specs=specs, slow_decoding={0: 0.01})
    ranks = fused.stats["ranks"]
    counts, claimer = ranks[0]["trigger_claim"]
    assert ranks[1]["trigger_claim"] == (counts, claimer)
    assert min(counts) > 0, counts   # both ranks still decode at the claim
    assert ranks[0]["destinations"] == ranks[1]["destinations"] == [1 - claimer]
    assert sorted(ranks[0]["moved"]) == (
        [0, 2, 4, 6] if claimer == 0 else [1, 3]), (ranks[0]["moved"], counts)
    assert sum(st["scored"] for st in ranks) == 16
    assert_equals_serial(serial, fused, 16)


def test_three_ranks_on_one_host_plan_from_the_trigger_or_from_reports():
    """One destination (m = 1): the roles come with the trigger and no rank reports its
    progress; two destinations (m = 2): the reports are exchanged and ``assign_migration``
    balances the tail between them. Both equal the serial rollout, every migrated sample is
    flagged, and every rank says the same about what moved."""
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=6, mechanism="kv"),
               RolloutConfig(rt=8, m=2, mechanism="kv")]
    out = [r.value for r in run_ranks(tiny_job_worker, 3, job(configs), collective_timeout=60)]
    serial = out[0][0]["output"]
    for k, m in ((1, 1), (2, 2)):
        fused = out[0][k]["output"]
        ranks = fused.stats["ranks"]
        assert {st["board"] for st in ranks} == {"shared"}
        assert all(("reports_s" in st) == (m == 2) for st in ranks), ranks
        assert all(len(st["destinations"]) == m for st in ranks)
        moved = ranks[0]["moved"]
        assert moved and all(st["moved"] == moved for st in ranks)
        assert fused.assignment is not None and fused.assignment.moved_ids == moved
        assert all(r.migrated == (r.sample_id in moved) for r in fused.results)
        for other in out[1:]:   # every rank returns the same plan
            assert all(st["moved"] == moved for st in other[k]["stats"]["ranks"])
        assert_equals_serial(serial, fused, 16)


def test_a_planned_sample_that_finishes_before_its_export_is_not_reported_as_moved():
    """Two destinations: the plan comes from the progress reports, and a rank that sees the
    trigger decodes on until every report is there. Rank 0 reports half a second late, so the
    source's one long sample (rank 2's, 30 tokens) finishes before its export. The rollout
    reports as moved what was sent, not the plan: every rank agrees, the migrated flags match
    it, and the rollout equals the serial one."""
    long = {0: 50, 3: 50, 6: 50, 9: 50, 1: 40, 4: 40, 2: 30}
    specs = [SampleSpec(i, [(5 * i) % 64, 3], max_new_tokens=long.get(i, 2), seed=8)
             for i in range(12)]
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=7, m=2, mechanism="kv")]
    out = [r.value for r in run_ranks(tiny_job_worker, 3, job(
        configs, specs=specs, fault="late_progress_report_on_rank_0"), collective_timeout=60)]
    serial, fused = out[0][0]["output"], out[0][1]["output"]
    ranks = fused.stats["ranks"]
    assert all("reports_s" in st for st in ranks)
    planned = sorted(i for st in ranks for i in st.get("planned", []))
    assert 2 in planned, ranks   # the plan moves rank 2's sample ...
    moved = ranks[0]["moved"]
    assert 2 not in moved        # ... which finished on rank 2 before its export
    assert all(st["moved"] == moved for o in out for st in o[1]["stats"]["ranks"])
    assert fused.assignment is not None and fused.assignment.moved_ids == moved
    assert all(r.migrated == (r.sample_id in moved) for r in fused.results)
    assert_equals_serial(serial, fused, 12)


def test_tickets_too_large_for_dev_shm_go_over_gloo_on_one_host():
    """A KV cache can outgrow /dev/shm (64 MB in a Docker container): its tickets go over
    gloo, announced by a header-only file, and the rollout still equals the serial one."""
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=6, mechanism="kv")]
    out = [r.value for r in run_ranks(tiny_job_worker, 2, job(configs, shm_ticket_max_bytes=64),
                                      collective_timeout=60)]
    serial, fused = out[0][0]["output"], out[0][1]["output"]
    ranks = fused.stats["ranks"]
    assert {st["board"] for st in ranks} == {"shared"}
    assert [t for st in ranks for t in st.get("tickets", [])] == ["gloo"]
    assert ranks[0]["moved"]
    for a, b in zip(serial.experiences, fused.experiences, strict=True):
        assert a.response_ids == b.response_ids
        assert torch.max(torch.abs(a.ref_logprobs - b.ref_logprobs)).item() < 1e-9


def test_ranks_that_cannot_share_memory_trigger_through_the_store():
    """Rank 1 cannot open rank 0's board (another host): both trigger through the c10d store,
    and the fused rollout still equals the serial one."""
    configs = [RolloutConfig(fused=False), RolloutConfig(rt=6, mechanism="kv")]
    out = [r.value for r in run_ranks(tiny_job_worker, 2, job(configs, no_board_ranks=(1,)),
                                      collective_timeout=60)]
    serial, fused = out[0][0]["output"], out[0][1]["output"]
    assert {st["board"] for st in fused.stats["ranks"]} == {"store"}
    assert fused.stats["ranks"][0]["moved"]
    for a, b in zip(serial.experiences, fused.experiences, strict=True):
        assert a.response_ids == b.response_ids
        assert torch.max(torch.abs(a.ref_logprobs - b.ref_logprobs)).item() < 1e-9
        assert abs(a.reward - b.reward) < 1e-9


@pytest.mark.parametrize("board", ["shared", "store"])
def test_balanced_scoring_hands_a_slow_rank_s_micro_batches_to_the_other(board):
    """``balance_scoring``: a rollout without migration whose rank 0 scores 40 ms slower per
    micro-batch. The static split leaves each rank its own 8 samples (3 micro-batches of 3);
    balanced, rank 1 scores some of rank 0's after its own, and the experiences equal the
    static serial rollout's."""
    configs = [RolloutConfig(fused=False), RolloutConfig(fused=False, balance_scoring=True)]
    out = [r.value for r in run_ranks(
        tiny_job_worker, 2, job(configs, slow_scoring={0: 0.04},
                                no_board_ranks=(1,) if board == "store" else ()),
        collective_timeout=60)]
    static, balanced = out[0][0]["output"], out[0][1]["output"]
    assert {st["board"] for st in balanced.stats["ranks"]} == {board}
    assert [st["scoring_batches"] for st in static.stats["ranks"]] == [3, 3]
    ranks = balanced.stats["ranks"]
    assert sum(st["scored"] for st in ranks) == 16
    assert ranks[1]["scored"] > 8 and ranks[0]["scoring_batches"] < 3, ranks
    # nothing is generating: every chunk is one micro-batch (or the last, partial one)
    assert all(c <= 3 for st in ranks for c in st.get("stream_chunks", ())), ranks
    # No overlap: scoring starts after every rank's generation, as in the static split.
    assert min(st["inference_start_s"] + st["t0"] for st in ranks) >= max(
        st["generation_end_s"] + st["t0"] for st in ranks)
    assert [e.sample_id for e in balanced.experiences] == list(range(16))
    for a, b in zip(static.experiences, balanced.experiences, strict=True):
        assert a.response_ids == b.response_ids
        for f in ("logprobs", "ref_logprobs", "values"):
            assert torch.max(torch.abs(getattr(a, f) - getattr(b, f))).item() < 1e-9
        assert abs(a.reward - b.reward) < 1e-9


def failures(world, cfg, fault, timeout_s, no_board_ranks=()):
    """Every rank's outcome of a rollout with ``fault`` injected: (dead rank, {rank: result})."""
    with pytest.raises(DistributedRunError) as info:
        run_ranks(tiny_job_worker, world, job([cfg], warmup=False, fault=fault,
                                              no_board_ranks=no_board_ranks),
                  collective_timeout=timeout_s, timeout=timeout_s + 60)
    failed = info.value.failed
    code = {"kill_destination_during_migration": 17, "kill_destination_while_streaming": 18}
    dead = [r for r, res in failed.items() if res.error_type == "Died"]
    assert len(dead) == 1 and failed[dead[0]].exitcode == code[fault], failed
    return dead[0], failed


@pytest.mark.parametrize("board", ["shared", "store"])
def test_destination_dying_during_migration_is_a_clear_error_within_the_timeout(board):
    """One host: the tickets go through files beside the shared board, and the source sees
    the destination's process gone; across hosts (``store``): gloo point-to-point."""
    cfg = RolloutConfig(rt=8, mechanism="kv", timeout_s=8)
    dead, failed = failures(2, cfg, "kill_destination_during_migration", 8,
                            no_board_ranks=(1,) if board == "store" else ())
    (alive,) = [r for r in failed if r != dead]
    res = failed[alive]
    assert res.error_type == "MigrationError", res
    assert f"destination rank {dead}" in res.error, res.error
    assert "acknowledge" in res.error and "died or hung" in res.error


@pytest.mark.parametrize("board", ["shared", "store"])
def test_destination_dying_while_streaming_is_detected_by_the_freed_rank(board):
    """One host: the board's pid says the process is gone; across hosts: its heartbeat in
    the store stops."""
    cfg = RolloutConfig(rt=8, mechanism="kv", timeout_s=4, heartbeat_s=0.2)
    dead, failed = failures(2, cfg, "kill_destination_while_streaming", 4,
                            no_board_ranks=(1,) if board == "store" else ())
    (alive,) = [r for r in failed if r != dead]
    res = failed[alive]
    assert res.error_type == "CoordinatorTimeout", res
    if board == "shared":   # the board's pid: the process is gone, whichever rank it was
        want = f"generation rank {dead} sent no heartbeat: its process is gone"
    else:   # rank 0 also serves the c10d store, so its death shows up as a lost store instead
        want = "sent no heartbeat" if dead != 0 else "lost the c10d store (served by rank 0)"
    assert want in res.error and "died" in res.error, res.error


def test_bad_configurations_are_rejected_before_any_process_starts():
    with pytest.raises(RolloutConfigError, match="outside the batch"):
        check_rollout(SPECS, RolloutConfig(rt=17), 2, bs_max=8)
    with pytest.raises(RolloutConfigError, match="lower R_t to at most 8"):
        check_rollout(SPECS, RolloutConfig(rt=9), 2, bs_max=8)
    with pytest.raises(RolloutConfigError, match="m=2 destinations leave none"):
        check_rollout(SPECS, RolloutConfig(rt=4, m=2), 2, bs_max=8)
    with pytest.raises(RolloutConfigError, match="raise the KV capacity"):
        check_rollout(SPECS, RolloutConfig(rt=4, kv_capacity_tokens=32), 2, bs_max=8)
    with pytest.raises(RolloutConfigError, match="rt_fraction"):
        check_rollout(SPECS, RolloutConfig(rt_fraction=1.5), 2, bs_max=8)
    with pytest.raises(RolloutConfigError, match="set rt"):
        check_rollout(SPECS, RolloutConfig(), 2, bs_max=8)
    assert check_rollout(SPECS, RolloutConfig(rt_fraction=0.25), 2, bs_max=8) == 1


@pytest.mark.slow
def test_three_ranks_every_survivor_reports_the_dead_destination():
    """m = 1 of 3 ranks: sources see a missing acknowledgement; a freed rank with nothing to
    send sees the destination's heartbeat stop (or the store go away with rank 0)."""
    cfg = RolloutConfig(rt=8, mechanism="tokens", timeout_s=6)
    dead, failed = failures(3, cfg, "kill_destination_during_migration", 6)
    assert len(failed) == 3, failed
    for rank, res in failed.items():
        if rank != dead:
            assert res.error_type in ("MigrationError", "CoordinatorTimeout"), res
            assert "died or hung" in res.error or "rank 0 died" in res.error, res.error
