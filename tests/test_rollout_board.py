"""The one-host trigger board (rollout/board.py): what every rank reads is what the others
wrote, through separate mappings of one file, as separate processes have."""

from __future__ import annotations

import os

import pytest

from rlhf_fusion.rollout.board import NO_TRIGGER, SharedBoard, shm_dir

pytestmark = pytest.mark.skipif(shm_dir() is None, reason="needs /dev/shm")


def test_counts_heartbeats_and_trigger_cross_mappings():
    a = SharedBoard.create(3, 0)
    b = SharedBoard.attach(a.path, 3, 1)
    c = SharedBoard.attach(a.path, 3, 2)
    assert a is not None and b is not None and c is not None
    a.unlink()   # the ranks keep their mappings; nothing stays in /dev/shm
    assert not os.path.exists(a.path)
    assert a.trigger() == NO_TRIGGER and c.total() == 0
    a.publish(5)
    b.publish(4)
    b.publish(3)
    c.publish(2)
    assert a.total() == b.total() == c.total() == 5 + 3 + 2
    assert a.heartbeats() == [1, 2, 1]
    c.set_trigger()
    assert a.trigger() == b.trigger() == 2
    for x in (a, b, c):
        x.close()


def test_a_board_this_rank_cannot_open_is_none():
    assert SharedBoard.attach("", 2, 1) is None
    assert SharedBoard.attach(os.path.join(shm_dir(), "rlhf_fusion_board_gone"), 2, 1) is None
