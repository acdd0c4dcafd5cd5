"""``rlhf-fusion train --resume auto`` under torchrun's restarts (``--max-restarts``).

A rank SIGKILLed mid-run makes torchrun restart every rank with the same command; with
``--resume auto`` the restart continues from the newest checkpoint and the run ends as an
uninterrupted one would. Every wait has a deadline; a failing test kills what it started.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_loop_torchrun import (  # noqa: E402
    LEARNING,
    TORCHRUN,
    _config,
    _env,
    _finish,
    _max_diff,
    _params,
    _rows,
    _torchrun,
)

from rlhf_fusion.loop.checkpoint import complete_checkpoints  # noqa: E402

N = 5
DIE = str(Path(__file__).with_name("_die_once_cli.py"))


def _standalone(tmp: Path, out: Path, *args: str, die_at: int | None = None
                ) -> subprocess.Popen:
    """Two ranks on this machine under one torchrun that restarts them once."""
    # torchrun's own store would outlive the first attempt with its ranks' addresses in it
    # (pytorch/pytorch#135712): docs/loop.md says to set this for restarts
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if die_at is not None:
        env.update(DIE_RANK="1", DIE_AT=str(die_at))
    return subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.5", DIE, "train", str(_config(tmp)), "--out", str(out),
         "--iterations", str(N), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def test_a_rank_killed_under_torchrun_restarts_resumes_auto_and_equals_the_uninterrupted_run(
        tmp_path):
    """Rank 1 is SIGKILLed in iteration 3's training; torchrun restarts both ranks with the
    same command, which continues from iteration 3's checkpoint: the final parameters,
    optimizer state and every metrics row equal an uninterrupted run's, bit for bit."""
    ref = tmp_path / "ref"
    (err,) = _finish([_standalone(tmp_path, ref, "--resume", "auto")], 600)
    assert "resume: no complete checkpoint" in err, err[-3000:]
    out = tmp_path / "out"
    proc = _standalone(tmp_path, out, "--resume", "auto", die_at=3)
    (err,) = _finish([proc], 600)
    assert proc.returncode == 0, err[-5000:]
    assert "(exitcode: -9) local_rank: 1" in err, err[-5000:]   # torchrun saw the kill
    assert "resume: no complete checkpoint" in err   # the first attempt started the run
    assert [it for it, _ in complete_checkpoints(out)] == [N - 1, N]
    a, b = _params(out, N), _params(ref, N)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in b), _max_diff(a, b)
    rows, want = _rows(out), _rows(ref)
    assert [r["iteration"] for r in rows] == list(range(N))
    for x, y in zip(rows, want, strict=True):
        assert {k: x[k] for k in LEARNING} == {k: y[k] for k in LEARNING}, x["iteration"]


def test_resume_stops_when_another_node_sees_a_newer_checkpoint_than_rank_0(tmp_path):
    """After an elastic restart another node may be rank 0; with --out not shared it finds
    no checkpoint while the old rank 0's node has one: every rank stops with an error naming
    --out, rather than starting the run over."""
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    old = outs[1] / "checkpoints" / "iter_00003"
    old.mkdir(parents=True)
    (old / "COMPLETE").write_text('{"iteration": 3, "world_size": 2, "files": {}}')
    procs = _torchrun(tmp_path, outs, "--resume", "auto")
    errs = _finish(procs, 300)
    # each rank exits 2 (a configuration error); torchrun then reports its failed worker
    assert all(p.returncode != 0 for p in procs), [e[-3000:] for e in errs]
    for err in errs:
        assert "rlhf-fusion train: error: --resume: rank 1" in err, err[-3000:]
        assert "rank 1" in err and "iteration 3" in err and "rank 0" in err, err[-3000:]
        assert "every node shares" in err, err[-3000:]
    assert not (outs[0] / "metrics.jsonl").exists()


def test_restarts_through_torchruns_shared_store_are_refused_at_the_start(monkeypatch):
    """With torchrun's store shared with the ranks a restart could not connect: said before
    the first attempt runs, naming the variable that fixes it."""
    from types import SimpleNamespace

    from rlhf_fusion.loop import LoopConfigError
    from rlhf_fusion.loop.run import _check_restartable

    group = SimpleNamespace(source="torchrun")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    _check_restartable(group)   # no restarts: the shared store is fine
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.raises(LoopConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _check_restartable(group)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    _check_restartable(group)
