"""The one-host trigger board (rollout/board.py): what every rank reads is what the others
wrote, through separate mappings of one file, as separate processes have; each rollout under
its own sequence number."""

from __future__ import annotations

import os

import pytest

from rlhf_fusion.rollout.board import NO_TRIGGER, SharedBoard, shm_dir

pytestmark = pytest.mark.skipif(shm_dir() is None, reason="needs /dev/shm")


def boards(world):
    first = SharedBoard.create(world, 0)
    rest = [SharedBoard.attach(first.path, world, i) for i in range(1, world)]
    assert first is not None and all(b is not None for b in rest)
    first.unlink()   # the ranks keep their mappings; nothing stays in /dev/shm
    assert not os.path.exists(first.path)
    return [first, *rest]


def test_counts_heartbeats_and_trigger_cross_mappings():
    a, b, c = boards(3)
    for x in (a, b, c):
        x.begin([6, 5, 4])
    assert a.trigger() == NO_TRIGGER and c.total() == 15
    a.publish(5)
    b.publish(3)
    c.publish(2)
    assert a.total() == b.total() == c.total() == 5 + 3 + 2
    assert a.heartbeats() == [2, 2, 2]
    c.set_trigger()
    assert a.trigger() == b.trigger() == 2
    for x in (a, b, c):
        x.close()


def test_a_rank_that_has_not_started_this_rollout_counts_as_its_whole_shard():
    a, b = boards(2)
    for x in (a, b):
        x.begin([4, 4])
        x.publish(0)
    a.set_trigger()
    # Rollout 2: rank 0 starts, rank 1 is still in the last one (its count and the old
    # trigger are rollout 1's): neither its 0 nor the trigger may count.
    a.begin([7, 3])
    assert a.counts() == [7, 3] and a.trigger() == NO_TRIGGER
    a.publish(2)
    b.begin([7, 3])
    assert b.counts() == [2, 3]
    b.publish(1)
    assert a.counts() == [2, 1] and a.total() == 3


def test_a_board_this_rank_cannot_open_is_none():
    assert SharedBoard.attach("", 2, 1) is None
    assert SharedBoard.attach(os.path.join(shm_dir(), "rlhf_fusion_board_gone"), 2, 1) is None


def test_a_dead_jobs_messages_are_swept_when_a_new_board_is_made():
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = os.path.join(shm_dir(), f"rlhf_fusion_board_{dead}_0123abcd.r3.1")
    live = os.path.join(shm_dir(), f"rlhf_fusion_board_{os.getpid()}_0123abcd.r3.1")
    for p in (left, live):
        with open(p, "wb") as f:
            f.write(b"x")
    board = SharedBoard.create(2, 0)
    try:
        assert not os.path.exists(left) and os.path.exists(live)
    finally:
        board.unlink()
        board.close()
        os.unlink(live)


def test_a_destination_waits_for_its_tickets_only_as_long_as_it_was_told(tmp_path):
    """Before its first step after the plan a destination waits a bounded time for the
    sources' ticket files (``_Incoming.wait``): it returns as soon as every one is there, and
    gives up at the bound when one is late; either way nothing is read or imported yet."""
    import threading
    import time
    from types import SimpleNamespace

    from rlhf_fusion.rollout.distributed import _Incoming

    board = SimpleNamespace(seq=3, mailbox=lambda name: str(tmp_path / name))
    rank = SimpleNamespace(rank=0)
    inc = _Incoming(rank, backend=None, board=board, sources=[1, 2])
    paths = [tmp_path / "m3.1.0", tmp_path / "m3.2.0"]

    t = time.perf_counter()
    inc.wait(0.05)
    assert 0.05 <= time.perf_counter() - t < 1.0   # nothing came: the bound
    paths[0].write_bytes(b"")
    t = time.perf_counter()
    inc.wait(0.05)
    assert time.perf_counter() - t >= 0.05         # one source is still missing

    threading.Timer(0.02, paths[1].write_bytes, args=(b"",)).start()
    t = time.perf_counter()
    inc.wait(5.0)
    assert time.perf_counter() - t < 2.0           # back once both are there
    assert inc.pending == [1, 2] and all(p.exists() for p in paths)


def test_the_first_claim_of_the_trigger_fixes_the_counts_every_rank_reads():
    """Two ranks may see the total fall to R_t at once and both claim the trigger with the
    counts each read: every rank must plan from the same claim, the first one's, or two
    ranks could each take themselves for the destination."""
    a, b, c = boards(3)
    for x in (a, b, c):
        x.begin([6, 5, 4])
    assert a.trigger_claim() is None
    b.claim_trigger([3, 2, 1])
    a.claim_trigger([3, 1, 1])     # the slower claim: the trigger word is its, the claim not
    assert a.trigger() == b.trigger() == c.trigger() == 0
    assert a.trigger_claim() == b.trigger_claim() == c.trigger_claim() == ([3, 2, 1], 1)
    assert not [n for n in os.listdir(shm_dir()) if n.startswith(os.path.basename(a.path))
                and ".part" in n]   # no claim's draft is left behind
    for x in (a, b, c):
        x.begin([6, 5, 4])
    assert c.trigger_claim() is None   # the next rollout starts without one
    for x in (a, b, c):
        x.seq -= 1
    a.remove_trigger_claim()
    assert b.trigger_claim() is None
    a.remove_trigger_claim()           # twice: nothing to remove, no error
    for x in (a, b, c):
        x.close()
