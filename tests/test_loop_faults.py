"""Faults from the outside in: a rank SIGKILLed at each stage, the launcher SIGKILLed,
SIGTERM/SIGINT to ``rlhf-fusion train``, corrupt checkpoints, re-used output folders.

Real signals to real processes; each test bounds every wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("transformers")

from rlhf_fusion.launch import DistributedRunError, run_ranks  # noqa: E402
from rlhf_fusion.loop import (  # noqa: E402
    FusionLoopConfig,
    GenerationConfig,
    LoopConfigError,
    ModelsConfig,
    PPOLoopConfig,
    RLHFConfig,
    train,
)
from rlhf_fusion.loop.checkpoint import complete_checkpoints, resume_point  # noqa: E402
from rlhf_fusion.loop.demo import demo_prompts  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny(world: int = 2, *, inter: bool = True, iterations: int = 3,
         timeout_s: float = 120.0) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 32}, seed=3),
        generation=GenerationConfig(prompts_per_iteration=8, max_new_tokens=24, seed=5),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=1, micro_batches=2,
                          learning_rate=3e-3, kl_coef=0.05),
        fusion=FusionLoopConfig(inter=inter, intra=True, rt=0.5, solver="greedy",
                            timeout_s=timeout_s),
        world_size=world, iterations=iterations)


TINY_YAML = """world_size: 2
iterations: {iterations}
models: {{actor: {{family: llama, layers: 2, hidden: 32}}, seed: 3}}
generation: {{prompts_per_iteration: 8, max_new_tokens: 24, seed: 5}}
ppo: {{micro_batches: 2, num_mini_batches: 1, num_ppo_epochs: 1, learning_rate: 3.0e-3}}
fusion: {{solver: greedy, rt: 0.5, inter: {inter}}}
"""


# -- a rank SIGKILLed at a stage ------------------------------------------------------------------

def _kill_at(kill_rank: int, rank: int, target: str, stamp: str):
    def hook(stage: str) -> None:
        if rank == kill_rank and target in stage:
            Path(stamp).write_text(f"{time.time()}\n{stage}")
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def killing_rank_main(rank, world, kill_rank, target, stamp, *args):
    """rank_main, except that ``kill_rank`` SIGKILLs itself on entering a stage that contains
    ``target``."""
    import dataclasses

    from rlhf_fusion.loop.resolve import RunHooks, resolve_run
    from rlhf_fusion.loop.run import rank_main

    run, *rest = args
    run = dataclasses.replace(resolve_run(run, sources=False),
                              hooks=RunHooks(on_note=_kill_at(kill_rank, rank, target, stamp)))
    return rank_main(rank, world, run, *rest)


def descendants() -> list[psutil.Process]:
    """This process's children, except multiprocessing's resource tracker (it belongs to this
    pytest process, not to the run)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


# Each case starts 2 ranks (~1 min on a loaded 2-core machine): the default suite kills in
# generation, training and checkpointing, the slow one everywhere else.
STAGES = [
    # (rank killed, stage text it dies entering, fused)
    pytest.param(1, "of iteration 1: generation until the migration trigger", True,
                 id="generation"),
    pytest.param(0, "of iteration 1: generation until the migration trigger", True,
                 id="generation-rank0", marks=pytest.mark.slow),
    pytest.param(1, "of iteration 1: migration", True, id="migration", marks=pytest.mark.slow),
    pytest.param(1, "of iteration 1: streaming and scoring", True, id="scoring", marks=pytest.mark.slow),
    pytest.param(1, "training of iteration 1", True, id="training"),
    pytest.param(0, "weight sync of iteration 1", False, id="weight-sync", marks=pytest.mark.slow),
    pytest.param(1, "checkpoint of iteration 2", False, id="checkpoint"),
]


@pytest.mark.parametrize(("kill_rank", "target", "fused"), STAGES)
def test_a_rank_killed_at_any_stage_ends_the_run_within_60s_naming_it(
        tmp_path, kill_rank, target, fused):
    # The loop's default timeout (120 s): the bound must not come from a short test timeout.
    cfg = tiny(inter=fused)
    stamp = tmp_path / "killed"
    out = tmp_path / "run"
    prompt_ids = [list(range(2, 6 + i % 5)) for i in range(8)]
    with pytest.raises(DistributedRunError) as info:
        run_ranks(killing_rank_main, 2, kill_rank, target, str(stamp), cfg, prompt_ids,
                  str(out), 1, None, False, None, False, False, 0,
                  collective_timeout=cfg.fusion.timeout_s, timeout=600)
    ended = time.time()
    killed_at, stage = stamp.read_text().split("\n", 1)
    took = ended - float(killed_at)
    print(f"[fault] rank {kill_rank} killed entering {stage!r}: run ended {took:.1f} s later")
    assert took < 60, took
    by_rank = {r.rank: r for r in info.value.results}
    dead = by_rank[kill_rank]
    assert dead.error_type == "Died" and dead.exitcode == -signal.SIGKILL, dead
    assert "killed by SIGKILL" in dead.error and stage in dead.error, dead.error
    # The message of the run names the dead rank and its stage.
    assert f"rank {kill_rank}: Died: killed by SIGKILL without reporting, while {stage}" \
        in str(info.value)
    survivor = by_rank[1 - kill_rank]
    assert not survivor.ok and survivor.error, survivor
    assert not descendants(), descendants()
    if "checkpoint" in target:
        # The half-written checkpoint is never resumed from.
        assert resume_point(out, 2, say=lambda _: None) == 1


def dying_rollout_worker(rank, world, stamp, job):
    from rlhf_fusion import launch
    from rlhf_fusion.testing.rollout import tiny_job_worker

    launch.listen_to_stages(_kill_at(1, rank, "generation until the migration trigger", stamp))
    return tiny_job_worker(rank, world, job)


def test_the_trigger_wait_notices_a_dead_peer_by_its_heartbeat(tmp_path):
    """Without the launcher's stop (grace longer than the rollout's timeout), the wait for
    the migration trigger itself ends: the dead rank's heartbeat stops."""
    from rlhf_fusion.rollout import RolloutConfig, SampleSpec
    from rlhf_fusion.testing import TinyJob

    small = dict(vocab_size=64, hidden_size=32, layers=2, heads=4, kv_heads=2)
    specs = [SampleSpec(i, [(7 * i) % 64, 1, 2], max_new_tokens=4 + i, seed=21)
             for i in range(8)]
    cfg = RolloutConfig(rt=2, mechanism="tokens", timeout_s=4, heartbeat_s=0.2)
    job = TinyJob(specs=specs, configs=[cfg], actor=dict(small, seed=1), bs_max=8,
                  warmup=False)
    with pytest.raises(DistributedRunError) as info:
        run_ranks(dying_rollout_worker, 2, str(tmp_path / "killed"), job, collective_timeout=4,
                  timeout=120, grace=60)
    res = info.value.failed[0]
    assert res.error_type == "CoordinatorTimeout", res
    assert "generation rank 1 sent no heartbeat" in res.error, res.error
    assert "migration trigger" in res.error and "died or hung" in res.error


# -- the CLI under real signals ---------------------------------------------------------------------

def _cli(tmp_path: Path, out: Path, *args: str, iterations: int,
         inter: bool = True) -> subprocess.Popen:
    config = tmp_path / f"run{iterations}.yaml"
    config.write_text(TINY_YAML.format(iterations=iterations, inter=str(inter).lower()))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "rlhf_fusion.cli", "train", str(config),
                             "--out", str(out), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_rows(proc: subprocess.Popen, out: Path, n: int, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while len(_rows(out)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.1)


def _gone_within(procs: list[psutil.Process], limit: float) -> float:
    t0 = time.monotonic()
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        if time.monotonic() - t0 > limit:
            alive = [p for p in procs if p.is_running()]
            for p in alive:
                p.kill()
            pytest.fail(f"still alive after {limit} s: {alive}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _final_state(out: Path, iteration: int) -> dict:
    """Every rank's trained weights and optimizer state (the R_t planner's share holds
    measured times, which differ between any two runs)."""
    d = out / "checkpoints" / f"iter_{iteration:05d}"
    cks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {r: (ck["iteration"], ck["models"], ck["optimizers"]) for r, ck in enumerate(cks)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


LEARNING = ("reward_mean", "kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg",
            "val/value_avg", "policy/grad_norm", "val/grad_norm")
N = 10


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    proc = _cli(tmp, tmp / "out", iterations=N, inter=False)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "leaked semaphore" not in err and "Traceback" not in err, err[-3000:]
    # --keep-checkpoints defaults to 2.
    assert [it for it, _ in complete_checkpoints(tmp / "out")] == [N - 1, N]
    return tmp / "out"


def _resumes_exactly(tmp_path: Path, out: Path, reference_run: Path) -> None:
    resumed = _cli(tmp_path, out, "--resume", iterations=N, inter=False)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    rows, ref = _rows(out), _rows(reference_run)
    assert [r["iteration"] for r in rows] == list(range(N))
    for a, b in zip(rows, ref, strict=True):
        assert {k: a[k] for k in LEARNING} == {k: b[k] for k in LEARNING}, a["iteration"]
    assert _same(_final_state(out, N), _final_state(reference_run, N))


# CI runs none-due, the case with a checkpoint that only the stop writes; every-iteration (the
# stop's iteration checkpointed as it would be anyway) is in the slow selection.
@pytest.mark.parametrize("checkpoint_every", [pytest.param(1, marks=pytest.mark.slow), 100],
                         ids=["every-iteration", "none-due"])
def test_sigterm_ends_the_iteration_checkpoints_it_exits_0_and_resume_is_exact(
        tmp_path, reference_run, checkpoint_every):
    """Preemption: the launcher passes SIGTERM on, the ranks finish the iteration in
    progress, write its checkpoint (also when none was due) and the run exits 0."""
    out = tmp_path / "out"
    # Inter-stage fusion off: its R_t follows measured times, so two fused runs may differ in
    # the last bit of a metric, interrupted or not; resume itself is what is checked here.
    proc = _cli(tmp_path, out, "--checkpoint-every", str(checkpoint_every), iterations=N,
                inter=False)
    _wait_rows(proc, out, 2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    os.kill(proc.pid, signal.SIGTERM)     # a scheduler or supervisor: the launcher
    took = _gone_within(tree, 60)
    _, err = proc.communicate(timeout=10)
    print(f"[signal] SIGTERM: every process gone {took:.2f} s later")
    assert proc.returncode == 0, err[-3000:]
    for bad in ("Traceback", "leaked semaphore"):
        assert bad not in err, err[-3000:]
    done = complete_checkpoints(out)
    stopped = done[-1][0]
    assert stopped < N, "the signal came after the run ended: raise N"
    assert f"stopped by SIGTERM after {stopped} of {N} iterations; its checkpoint is " \
           f"{out / 'checkpoints' / f'iter_{stopped:05d}'}; continue with --resume" in err
    assert [r["iteration"] for r in _rows(out)] == list(range(stopped))
    assert not list(out.glob("checkpoints/*.partial"))
    if checkpoint_every > 1:
        assert [it for it, _ in done] == [stopped]
    _resumes_exactly(tmp_path, out, reference_run)


def test_sigint_stops_every_rank_within_10s_and_resume_is_exact(tmp_path, reference_run):
    out = tmp_path / "out"
    proc = _cli(tmp_path, out, iterations=N, inter=False)
    _wait_rows(proc, out, 2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert any("resource_tracker" in " ".join(p.cmdline()) for p in tree[1:])
    os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C: the whole foreground process group
    took = _gone_within(tree, 10)
    _, err = proc.communicate(timeout=10)
    print(f"[signal] SIGINT: every process gone {took:.2f} s later")
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "stopped by SIGINT" in err
    for bad in ("Traceback", "KeyboardInterrupt", "leaked semaphore"):
        assert bad not in err, err[-3000:]
    done = complete_checkpoints(out)
    assert done and done[-1][0] < N, "the signal came after the run ended: raise N"
    assert not list(out.glob("checkpoints/*.partial/COMPLETE"))
    _resumes_exactly(tmp_path, out, reference_run)


def test_sigterm_past_the_grace_drops_the_iteration_and_stops_every_rank(tmp_path):
    """A run whose iteration does not end within --stop-grace is stopped at once (the
    iteration in progress is dropped), with the last complete checkpoint kept."""
    out = tmp_path / "out"
    proc = _cli(tmp_path, out, "--stop-grace", "0.01", iterations=200)
    _wait_rows(proc, out, 2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    os.kill(proc.pid, signal.SIGTERM)
    took = _gone_within(tree, 15)
    _, err = proc.communicate(timeout=10)
    print(f"[signal] SIGTERM, grace 0.01 s: every process gone {took:.2f} s later")
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "did not reach an iteration boundary within 0.01 s" in err, err[-3000:]
    assert "continue with --resume" in err and "Traceback" not in err, err[-3000:]


def test_repeats_are_one_request_and_only_sigint_or_the_deadline_stop_at_once():
    """The CLI's handlers, in this process: SIGUSR1 then SIGTERMs record one request (the
    first signal's) and raise nothing; the deadline, counted from the first, raises
    RunInterrupted naming it; SIGINT raises at once."""
    from rlhf_fusion import launch

    saved = {s: signal.getsignal(s) for s in (*launch.STOP_SIGNALS, signal.SIGINT,
                                              signal.SIGALRM)}
    try:
        launch.stop_gracefully_on_signals(0.5)
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(3):
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        assert launch.stop_requested() == signal.SIGUSR1
        with pytest.raises(launch.RunInterrupted) as late:
            while time.monotonic() - t0 < 10:
                time.sleep(0.01)
        assert late.value.signum == signal.SIGUSR1 and 0.4 < time.monotonic() - t0 < 5
        assert "did not reach an iteration boundary within 0.5 s" in str(late.value)
        launch.clear_stop_request()
        launch.stop_gracefully_on_signals(60)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(launch.RunInterrupted) as now:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert now.value.signum == signal.SIGINT
    finally:
        launch.cancel_stop_deadline()
        launch.clear_stop_request()
        for s, h in saved.items():
            signal.signal(s, h)


def _ranks_of(proc: subprocess.Popen) -> list[psutil.Process]:
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
             if "spawn_main" in " ".join(p.cmdline())]
    assert len(ranks) == 2, ranks
    return ranks


def _signal_as_clusters_do(proc: subprocess.Popen, how: str) -> None:
    """``ranks-then-launcher``: SLURM signals every process of the step, the ranks first and
    the launcher (which passes it on again) 50 ms later, as torchrun's agent follows SLURM's
    signal to its worker. ``again-at-grace-end``: SIGTERM to the launcher, then every process
    again 0.3 s later, while the iteration is still running (SLURM's preemption signals again
    when GraceTime ends), and again every 0.1 s until it has exited (a repeat while a process
    exits must not kill it). ``usr1``: SLURM's ``--signal=USR1@90`` warning to every process."""
    ranks = _ranks_of(proc)
    if how == "ranks-then-launcher":
        for r in ranks:
            r.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
    elif how == "again-at-grace-end":
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None, "the run ended before the second signal: nothing tested"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            for p in (psutil.Process(proc.pid), *ranks):
                try:
                    p.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
    else:
        for p in (psutil.Process(proc.pid), *ranks):
            p.send_signal(signal.SIGUSR1)


# again-at-grace-end is in the slow selection here: CI runs it under torchrun
# (tests/test_loop_torchrun.py), the launcher SLURM users start.
@pytest.mark.parametrize("how", ["ranks-then-launcher",
                                 pytest.param("again-at-grace-end", marks=pytest.mark.slow),
                                 pytest.param("usr1", marks=pytest.mark.slow)])
def test_repeated_and_early_warning_signals_are_one_graceful_stop(tmp_path, reference_run, how):
    """The signals as SLURM and torchrun deliver them: every repeat within the grace is the same
    request, SIGUSR1 is one too. The run ends at the next boundary with that iteration
    checkpointed, exits 0, and --resume equals the uninterrupted run."""
    out = tmp_path / "out"
    proc = _cli(tmp_path, out, "--checkpoint-every", "100", "--stop-grace", "60",
                iterations=N, inter=False)
    _wait_rows(proc, out, 2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    t0 = time.monotonic()
    _signal_as_clusters_do(proc, how)
    _gone_within(tree, 60)
    _, err = proc.communicate(timeout=10)
    print(f"[signal] {how}: every process gone {time.monotonic() - t0:.2f} s after the first")
    assert proc.returncode == 0, err[-3000:]
    for bad in ("Traceback", "train: error", "leaked semaphore"):
        assert bad not in err, err[-3000:]
    done = complete_checkpoints(out)
    stopped = done[-1][0]
    assert [it for it, _ in done] == [stopped] and stopped < N, "the run ended before the signal"
    name = "SIGUSR1" if how == "usr1" else "SIGTERM"
    assert f"stopped by {name} after {stopped} of {N} iterations; its checkpoint is " in err, \
        err[-3000:]
    assert [r["iteration"] for r in _rows(out)] == list(range(stopped))
    _resumes_exactly(tmp_path, out, reference_run)


def test_a_sigterm_while_the_ranks_start_is_held_until_they_record_it(tmp_path):
    """A rank signalled before it has set up its handler (SLURM signals every process, the
    launcher passes it on) must not die of SIGTERM's default action: the launcher blocks the
    stop signals while it starts the ranks, each rank unblocks them once they are recorded."""
    out = tmp_path / "out"
    proc = _cli(tmp_path, out, "--stop-grace", "60", iterations=N, inter=False)
    deadline = time.monotonic() + 60
    while True:   # the ranks exist, still importing torch: no handler of ours yet
        kids = [p for p in psutil.Process(proc.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())]
        if len(kids) == 2:
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.01)
    for p in kids:
        p.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM after 0 of" in err and "Died" not in err, err[-3000:]


def test_killing_the_launcher_leaves_no_rank_and_no_new_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc = _cli(tmp_path, out, "--keep-checkpoints", "0", iterations=200)
    _wait_rows(proc, out, 2)
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len([p for p in ranks if "spawn_main" in " ".join(p.cmdline())]) == 2
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)   # the launcher is gone (a checkpoint finished before counts)
    before = complete_checkpoints(out)
    _gone_within(ranks, 10)
    took = time.monotonic() - t0
    assert took < 10, took
    print(f"[launcher] SIGKILL: every rank gone {took:.2f} s later")
    time.sleep(1.0)
    after = complete_checkpoints(out)
    assert after == before, (before, after)


# -- checkpoints and output folders -----------------------------------------------------------------

def test_resume_skips_a_truncated_checkpoint_and_continues_exactly(tmp_path, capsys):
    cfg = tiny(inter=False)
    full = train(cfg, demo_prompts(), out_dir=tmp_path, checkpoint_every=1, progress=False,
                 keep_checkpoints=0)
    newest = tmp_path / "checkpoints" / "iter_00003" / "rank1.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    resumed = train(cfg, demo_prompts(), out_dir=tmp_path, checkpoint_every=1, progress=False,
                    resume=True, keep_checkpoints=0)
    err = capsys.readouterr().err
    assert f"resume: skipping {newest.parent}: rank1.pt is {len(data) // 2} bytes" in err
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2]
    assert [r["iteration"] for r in _rows(tmp_path)] == [0, 1, 2]
    assert _same(resumed["states"], full["states"])
    assert resumed["history"] == full["history"] or all(
        {k: a[k] for k in a if not k.startswith(("time/", "samples"))}
        == {k: b[k] for k in b if not k.startswith(("time/", "samples"))}
        for a, b in zip(resumed["history"], full["history"], strict=True))


def test_metrics_are_truncated_to_the_resumed_checkpoint(tmp_path):
    cfg = tiny(1, inter=False, iterations=4)
    train(cfg, demo_prompts(), out_dir=tmp_path, checkpoint_every=2, stop_after=3,
          progress=False)
    assert [r["iteration"] for r in _rows(tmp_path)] == [0, 1, 2]   # checkpoint at 2
    train(cfg, demo_prompts(), out_dir=tmp_path, checkpoint_every=2, resume=True,
          progress=False)
    assert [r["iteration"] for r in _rows(tmp_path)] == [0, 1, 2, 3]
    assert [it for it, _ in complete_checkpoints(tmp_path)] == [2, 4]


def test_a_non_empty_out_needs_resume_or_overwrite(tmp_path, monkeypatch, capsys):
    import rlhf_fusion.launch as launch
    from rlhf_fusion.cli import build_parser, main
    from rlhf_fusion.loop.run import prepare_out_dir

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("a process started"))
    (tmp_path / "checkpoints" / "iter_00005").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LoopConfigError, match="--resume .* --overwrite"):
        train(tiny(), demo_prompts(), out_dir=tmp_path, progress=False)
    config = tmp_path.parent / f"{tmp_path.name}.yaml"
    config.write_text(TINY_YAML.format(iterations=2, inter="true"))
    assert main(["train", str(config), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and str(tmp_path) in err
    with pytest.raises(LoopConfigError, match="choose one"):
        prepare_out_dir(tmp_path, 2, resume=True, overwrite=True)
    # A folder without a marker is not a checkpoint: --resume starts afresh.
    assert prepare_out_dir(tmp_path, 2, resume=True, overwrite=False) is None
    # --overwrite deletes the earlier run's outputs, and only those.
    assert prepare_out_dir(tmp_path, 2, resume=False, overwrite=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--keep-checkpoints K" in help_text and "(default: 2)" in help_text
    assert "(default: 1)" in help_text  # --checkpoint-every


LIGHTNING_RUN = """
import sys
import lightning as L
from rlhf_fusion.loop import RLHFConfig
from rlhf_fusion.loop.demo import demo_prompts
from rlhf_fusion.plugins import PromptLoader, RLHFLoopStrategy, RLHFModule

if __name__ == "__main__":
    out, config, ckpt_path = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
    cfg = RLHFConfig.from_file(config)
    data = PromptLoader(demo_prompts()[:64], 8, shuffle=True, seed=7)   # 8 iterations
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out + "/steps", every_n_train_steps=1,
                                               save_top_k=-1, filename="{step}", save_last=True)
    L.Trainer(accelerator="cpu", devices=2, max_epochs=1, default_root_dir=out,
              strategy=RLHFLoopStrategy(timeout_s=60), logger=False, callbacks=[ckpt],
              enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0).fit(RLHFModule(cfg), data, ckpt_path=ckpt_path)
"""


def _lightning(tmp_path: Path, out: Path, *args: str) -> subprocess.Popen:
    config = tmp_path / "run.yaml"
    # inter-stage fusion off: the uninterrupted run is deterministic bit for bit
    config.write_text(TINY_YAML.format(iterations=1, inter="false"))
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_RUN)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(script), str(out), str(config), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lightning_params(path: Path) -> dict:
    shares = torch.load(path, map_location="cpu", weights_only=False)["rlhf_loop_ranks"]
    return {r: (s["models"], s["optimizers"]) for r, s in enumerate(shares)}


def test_sigterm_to_a_lightning_run_checkpoints_exits_0_and_resume_is_exact(tmp_path):
    whole = _lightning(tmp_path, tmp_path / "whole")
    proc = _lightning(tmp_path, tmp_path / "run")
    steps = tmp_path / "run" / "steps"
    deadline = time.monotonic() + 300
    while not (steps / "step=2.ckpt").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len([p for p in tree if "spawn_main" in " ".join(p.cmdline())]) == 2
    os.kill(proc.pid, signal.SIGTERM)   # the launching process: it passes it on
    took = _gone_within(tree, 60)
    _, err = proc.communicate(timeout=10)
    print(f"[lightning] SIGTERM: every process gone {took:.2f} s later")
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "leaked semaphore" not in err, err[-3000:]
    hpc = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    assert hpc.exists() and not list((tmp_path / "run").glob("*.tmp")), err[-3000:]
    stopped = torch.load(hpc, map_location="cpu", weights_only=False)["global_step"]
    assert 2 <= stopped < 8, "the signal came after the run ended"
    resumed = _lightning(tmp_path, tmp_path / "run", "hpc")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    _, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-3000:]
    a = torch.load(tmp_path / "run" / "steps" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "whole" / "steps" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 8
    assert _same(_lightning_params(tmp_path / "run" / "steps" / "last.ckpt"),
                 _lightning_params(tmp_path / "whole" / "steps" / "last.ckpt"))
