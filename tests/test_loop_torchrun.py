"""``rlhf-fusion train`` under torchrun (two "nodes" on this machine) and srun's environment.

The two torchrun processes are started separately, one per node rank, as on two machines:
``torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-endpoint 127.0.0.1:PORT``. Every
wait has a deadline; a failing test kills what it started.
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

from rlhf_fusion.launch import (  # noqa: E402
    JoinedGroup,
    LaunchEnvError,
    RunInterrupted,
    expand_hostlist,
    free_port,
    group_from_env,
    slurm_port,
)
from rlhf_fusion.loop import LoopConfigError, train  # noqa: E402
from rlhf_fusion.loop.checkpoint import complete_checkpoints  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
N = 10
# Inter-stage fusion off: its R_t follows measured times, so two fused runs may differ in the
# last bit of kl; with it off every run of this config is deterministic, bit for bit.
TINY_YAML = f"""world_size: 2
iterations: {N}
models: {{actor: {{family: llama, layers: 2, hidden: 32}}, seed: 3}}
generation: {{prompts_per_iteration: 8, max_new_tokens: 24, seed: 5}}
ppo: {{micro_batches: 2, num_mini_batches: 1, num_ppo_epochs: 1, learning_rate: 3.0e-3}}
fusion: {{solver: greedy, rt: 0.5, inter: false}}
"""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    # One thread per process: two ranks on two loaded cores (torchrun sets it only for
    # several processes per node).
    return {**env, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _config(tmp: Path) -> Path:
    path = tmp / "run.yaml"
    path.write_text(TINY_YAML)
    return path


def _spawned(tmp: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlhf_fusion.cli", "train", str(_config(tmp)),
                             "--out", str(out), *args], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _torchrun(tmp: Path, outs: tuple[Path, Path], *args: str) -> list[subprocess.Popen]:
    """Node ranks 0 and 1, each its own torchrun; node 1 gets its own --out (as a folder on
    another machine would be): rank 1 must write nothing there."""
    port = free_port()
    config = _config(tmp)
    return [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "rlhf_fusion.cli", "train", str(config),
         "--out", str(outs[r]), *args],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for r in range(2)]


def _srun_tasks(config: Path, outs: tuple[Path, Path]) -> list[subprocess.Popen]:
    """What srun gives each of 2 tasks (no SLURM here: the variables set by hand), one
    ``rlhf-fusion train`` process per task started separately."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, "-m", "rlhf_fusion.cli", "train", str(config), "--out", str(outs[r])],
        env={**_env(), "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for r in range(2)]


def _finish(procs: list[subprocess.Popen], limit: float) -> list[str]:
    """Every process's stderr once all have exited (within ``limit`` s, else kill them all
    and fail)."""
    deadline = time.monotonic() + limit
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            errs.append(err)
    except subprocess.TimeoutExpired:
        _kill(procs)
        pytest.fail(f"still running after {limit} s")
    return errs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.communicate(timeout=10)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_rows(procs: list[subprocess.Popen], out: Path, n: int, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while len(_rows(out)) < n:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _kill(procs)
            pytest.fail(f"no {n} iterations within {limit} s, or a process ended")
        time.sleep(0.05)


def _params(out: Path, iteration: int) -> dict[str, torch.Tensor]:
    """Every rank's trained parameters and optimizer state in the checkpoint of ``iteration``."""
    d = out / "checkpoints" / f"iter_{iteration:05d}"
    flat: dict[str, torch.Tensor] = {}
    for r in range(2):
        ck = torch.load(d / f"rank{r}.pt", weights_only=False)
        assert ck["iteration"] == iteration
        for role, sd in ck["models"].items():
            flat.update({f"rank{r}.{role}.{k}": v for k, v in sd.items()})
        for role, opt in ck["optimizers"].items():
            for i, st in opt["state"].items():
                flat.update({f"rank{r}.opt.{role}.{i}.{k}": v for k, v in st.items()
                             if isinstance(v, torch.Tensor)})
    return flat


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


LEARNING = ("reward_mean", "kl", "loss/policy_avg", "loss/value_avg", "policy/grad_norm",
            "val/grad_norm")


@pytest.fixture(scope="module")
def spawned_run(tmp_path_factory) -> Path:
    """The reference: the same config, its two ranks spawned by `rlhf-fusion train`."""
    tmp = tmp_path_factory.mktemp("spawned")
    (err,) = _finish([_spawned(tmp, tmp / "out")], 600)
    assert [it for it, _ in complete_checkpoints(tmp / "out")] == [N - 1, N], err[-3000:]
    return tmp / "out"


def test_two_torchrun_nodes_equal_the_spawned_run_and_only_rank_0_writes(tmp_path, spawned_run):
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _torchrun(tmp_path, outs)
    errs = _finish(procs, 600)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    diff = _max_diff(_params(outs[0], N), _params(spawned_run, N))
    print(f"[torchrun] 2 nodes vs spawned: max |parameter/optimizer-state difference| = {diff}")
    assert diff <= 1e-6
    assert [r["iteration"] for r in _rows(outs[0])] == list(range(N))
    assert not outs[1].exists(), sorted(outs[1].rglob("*"))   # rank 1 wrote nothing
    assert "PPO iterations" in errs[0] and "PPO iterations" not in errs[1]


def _worker_of(agent: subprocess.Popen) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = [p for p in psutil.Process(agent.pid).children(recursive=True)
                if "rlhf_fusion.cli" in " ".join(p.cmdline())]
        if kids:
            return kids[0]
        time.sleep(0.1)
    pytest.fail("torchrun started no worker")


def test_sigterm_to_one_rank_stops_both_nodes_at_one_boundary_and_resume_is_exact(
        tmp_path, spawned_run):
    """SLURM signals every process, Kubernetes one container, torchrun its own node's ranks:
    here only rank 1 is told; the ranks agree at the next boundary and both exit 0."""
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _torchrun(tmp_path, outs)
    worker1 = _worker_of(procs[1])
    _wait_rows(procs, outs[0], 2)
    t0 = time.monotonic()
    worker1.send_signal(signal.SIGTERM)
    errs = _finish(procs, 60)
    took = time.monotonic() - t0
    print(f"[torchrun] SIGTERM to rank 1: both nodes exited {took:.1f} s later")
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    done = complete_checkpoints(outs[0])
    stopped = done[-1][0]
    assert stopped < N, "the signal came after the run ended: raise N"
    assert f"stopped by SIGTERM after {stopped} of {N} iterations" in errs[0], errs[0][-3000:]
    assert [r["iteration"] for r in _rows(outs[0])] == list(range(stopped))
    assert not list(outs[0].glob("checkpoints/*.partial"))
    assert not outs[1].exists()
    _resumes_to_the_spawned_run(tmp_path, outs, spawned_run)


def test_sigterm_to_the_torchrun_agents_is_passed_on_and_the_ranks_checkpoint(tmp_path):
    """torchrun passes SIGTERM on to its ranks and gives them --shutdown-timeout (30 s) before
    SIGKILL; the ranks finish their iteration and checkpoint it. torchrun itself then exits
    1 with its SignalException, whatever its ranks did (torch's design)."""
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _torchrun(tmp_path, outs)
    _wait_rows(procs, outs[0], 2)
    t0 = time.monotonic()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    errs = _finish(procs, 60)
    print(f"[torchrun] SIGTERM to both agents: exited {time.monotonic() - t0:.1f} s later")
    done = complete_checkpoints(outs[0])
    assert done and done[-1][0] < N
    assert f"stopped by SIGTERM after {done[-1][0]} of {N} iterations" in errs[0], errs[0][-3000:]
    assert not list(outs[0].glob("checkpoints/*.partial"))


def _resumes_to_the_spawned_run(tmp_path: Path, outs: tuple[Path, Path],
                                spawned_run: Path) -> None:
    resumed = _torchrun(tmp_path, outs, "--resume")
    errs = _finish(resumed, 600)
    assert [p.returncode for p in resumed] == [0, 0], [e[-3000:] for e in errs]
    a, b = _params(outs[0], N), _params(spawned_run, N)
    assert all(torch.equal(a[k], b[k]) for k in b), _max_diff(a, b)
    rows, ref = _rows(outs[0]), _rows(spawned_run)
    assert [r["iteration"] for r in rows] == list(range(N))
    for x, y in zip(rows, ref, strict=True):
        assert {k: x[k] for k in LEARNING} == {k: y[k] for k in LEARNING}, x["iteration"]


@pytest.mark.parametrize("how", ["worker-then-agent", "again-at-grace-end",
                                 pytest.param("usr1", marks=pytest.mark.slow)])
def test_signals_as_slurm_sends_them_to_torchrun_end_both_nodes_gracefully(
        tmp_path, spawned_run, monkeypatch, how):
    """``srun torchrun``: SLURM signals every process of the step, the worker and torchrun's
    agent, which passes another SIGTERM on 50 ms later (``worker-then-agent``); preemption
    signals again when GraceTime ends (``again-at-grace-end``: the workers 0.3 s later, and
    every 0.1 s until they have exited: a repeat while a process exits must not kill it);
    ``--signal=USR1@90`` sends SIGUSR1 to both, and the agent passes it on when it handles it
    (TORCHELASTIC_SIGNALS_TO_HANDLE). Each is one stop: both nodes end at one boundary with
    that iteration checkpointed, no stage reports an error, and --resume equals the spawned
    run. torchrun itself exits 1 once its agent was signalled (its SignalException)."""
    if how == "usr1":
        monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _torchrun(tmp_path, outs, "--stop-grace", "60")
    workers = [_worker_of(p) for p in procs]
    _wait_rows(procs, outs[0], 2)
    sig = signal.SIGUSR1 if how == "usr1" else signal.SIGTERM
    t0 = time.monotonic()
    for w in workers:
        w.send_signal(sig)
    time.sleep(0.05 if how != "again-at-grace-end" else 0.3)
    if how == "again-at-grace-end":
        assert all(p.poll() is None for p in procs), "the run ended before the second signal"
        deadline = time.monotonic() + 90
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for w in workers:
                try:
                    w.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
    else:
        for p in procs:
            p.send_signal(sig)
    errs = _finish(procs, 90)
    print(f"[torchrun] {how}: both nodes exited {time.monotonic() - t0:.1f} s later")
    if how == "again-at-grace-end":
        assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    for err in errs:
        for bad in ("LoopStageError", "RunInterrupted", "train: error", "ChildFailedError"):
            assert bad not in err, err[-3000:]
    done = complete_checkpoints(outs[0])
    stopped = done[-1][0]
    assert stopped < N, "the signal came after the run ended: raise N"
    name = signal.Signals(sig).name
    assert f"stopped by {name} after {stopped} of {N} iterations" in errs[0], errs[0][-3000:]
    assert [r["iteration"] for r in _rows(outs[0])] == list(range(stopped))
    assert not outs[1].exists()
    _resumes_to_the_spawned_run(tmp_path, outs, spawned_run)


def test_a_joined_run_past_its_grace_exits_143_not_as_a_stage_error(tmp_path):
    """Grace expiry in a joined run: the stop interrupts a stage, and passes through its
    wrapper unchanged (before, it became a LoopStageError and exit 1)."""
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _torchrun(tmp_path, outs, "--stop-grace", "0.02")
    workers = [_worker_of(p) for p in procs]
    _wait_rows(procs, outs[0], 2)
    for w in workers:
        w.send_signal(signal.SIGTERM)
    errs = _finish(procs, 60)
    for err in errs:
        assert "LoopStageError" not in err and "train: error" not in err, err[-3000:]
    assert "stopped by SIGTERM: the run did not reach an iteration boundary within 0.02 s" \
        in errs[0], errs[0][-3000:]
    # torchrun reports its worker's exit code: 143, not 1
    assert "exitcode  : 143" in errs[0] or "exit code 143" in errs[0], errs[0][-3000:]


def test_processes_started_with_srun_variables_join_and_equal_the_spawned_run(
        tmp_path, spawned_run):
    """What srun gives each task (no SLURM here: the variables set by hand, one process per
    task started separately) is enough to join: the same result as the spawned run."""
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _srun_tasks(_config(tmp_path), outs)
    errs = _finish(procs, 600)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    assert _max_diff(_params(outs[0], N), _params(spawned_run, N)) <= 1e-6
    assert not outs[1].exists()


GRPO_FUSED_YAML = """world_size: 2
iterations: 6
models: {actor: {family: llama, layers: 2, hidden: 64}, tokenizer: arithmetic, seed: 0,
         reward: {functions: [{function: "rlhf_fusion.loop.arithmetic:correctness_reward"}]}}
generation: {prompts_per_iteration: 16, max_new_tokens: 32, seed: 0}
ppo: {micro_batches: 2, num_mini_batches: 2, num_ppo_epochs: 1, learning_rate: 1.0e-3}
fusion: {inter: true, intra: false, rt: 0.25, mechanism: kv}
algorithm: {name: grpo, n: 8}
"""


@pytest.mark.slow   # about 25 s: a spawned run and an srun-style run of 6 GRPO iterations
def test_srun_tasks_migrate_through_the_one_host_board_and_equal_the_spawned_run(tmp_path):
    """GRPO with inter-stage fusion, its 2 ranks started as srun starts tasks (one process
    each, SLURM's variables): the rollout's one-host transport (the shared board in /dev/shm)
    serves them as it serves spawned ranks. Every iteration migrates, the rewards are those
    of the spawned run and the trained parameters equal it."""
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(GRPO_FUSED_YAML)
    ref = tmp_path / "spawned"
    (err,) = _finish([subprocess.Popen(
        [sys.executable, "-m", "rlhf_fusion.cli", "train", str(cfg), "--out", str(ref)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)], 600)
    assert [it for it, _ in complete_checkpoints(ref)][-1] == 6, err[-3000:]
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = _srun_tasks(cfg, outs)
    errs = _finish(procs, 600)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    rows = [[json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (outs[0], ref)]
    assert all(r["fusion/migrated"] > 0 for r in rows[0]), rows[0]
    assert [r["objective/scores"] for r in rows[0]] == [r["objective/scores"] for r in rows[1]]
    assert _max_diff(_params(outs[0], 6), _params(ref, 6)) <= 1e-6


# -- the environment: torchrun's and SLURM's variables -------------------------------------------

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODELIST": "gpu[07-08],login1", "SLURM_JOB_ID": "123456789"}


def test_slurm_variables_give_the_group_and_the_first_host_as_master():
    assert group_from_env(SLURM) == JoinedGroup(
        rank=3, world_size=4, local_rank=1, master_addr="gpu07",
        master_port=15000 + 789 * 16, source="SLURM")
    # the step's own values win over the job's; MASTER_ADDR / MASTER_PORT over the defaults
    step = {**SLURM, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
            "SLURM_STEP_NODELIST": "node[3-4]", "MASTER_PORT": "29511"}
    g = group_from_env(step)
    assert (g.world_size, g.rank, g.master_addr, g.master_port) == (2, 1, "node3", 29511)
    assert group_from_env({**step, "MASTER_ADDR": "10.0.0.1"}).master_addr == "10.0.0.1"
    # one task: nothing to join, `train` spawns its ranks on this node
    assert group_from_env({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert group_from_env({}) is None


def test_torchrun_variables_win_over_slurm_and_a_partial_set_is_refused():
    tr = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h0",
          "MASTER_PORT": "29500"}
    assert group_from_env({**SLURM, **tr}) == JoinedGroup(1, 2, 0, "h0", 29500, "torchrun")
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR, MASTER_PORT not: start the command "
                                              "with torchrun"):
        group_from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(LaunchEnvError, match="RANK=2 with WORLD_SIZE=2"):
        group_from_env({**tr, "RANK": "2"})
    with pytest.raises(LaunchEnvError, match="SLURM_PROCID=4 with SLURM_NTASKS=4"):
        group_from_env({**SLURM, "SLURM_PROCID": "4"})
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE='two' is not an integer"):
        group_from_env({**tr, "WORLD_SIZE": "two"})
    with pytest.raises(LaunchEnvError, match="set MASTER_PORT"):
        group_from_env({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"})
    with pytest.raises(LaunchEnvError, match="no SLURM_NODELIST"):
        group_from_env({k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"})


def test_slurm_host_lists_expand_as_scontrol_does():
    assert expand_hostlist("node[01-03,7],gpu-a,rack[1-2]-n[9-10]") == [
        "node01", "node02", "node03", "node7", "gpu-a", "rack1-n9", "rack1-n10", "rack2-n9",
        "rack2-n10"]
    with pytest.raises(LaunchEnvError, match="unbalanced"):
        expand_hostlist("node[1-2")
    with pytest.raises(LaunchEnvError, match=r"the range '03-1' runs backwards \(write 01-03\)"):
        expand_hostlist("node[03-1]")
    with pytest.raises(LaunchEnvError, match="names no host"):
        expand_hostlist(" , ")


def test_two_steps_of_one_job_get_different_ports_and_master_port_wins():
    """Two `srun` steps of one job running at once (step ids 0 and 1) rendezvous on different
    ports; every task of one step computes the same; MASTER_PORT set by the user wins."""
    step0 = {**SLURM, "SLURM_STEP_ID": "0"}
    step1 = {**SLURM, "SLURM_STEP_ID": "1"}
    ports = {group_from_env(e).master_port for e in (step0, step1)}
    assert len(ports) == 2, ports
    assert all(15000 <= p < 31000 for p in ports)   # below Linux's ephemeral ports
    tasks = {group_from_env({**step1, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2)}
                            ).master_port for r in range(4)}
    assert tasks == {group_from_env(step1).master_port}
    # SLURM's older name of the step id is read too; no step id at all is step 0
    assert group_from_env({**SLURM, "SLURM_STEPID": "1"}).master_port in tasks
    assert group_from_env(SLURM).master_port == group_from_env(step0).master_port
    for env in (step0, step1):
        assert group_from_env({**env, "MASTER_PORT": "29511"}).master_port == 29511
    # 16 steps of one job at once all differ; jobs differing in their last 3 digits differ
    assert len({slurm_port(123456789, s) for s in range(16)}) == 16
    assert len({slurm_port(j, 0) for j in range(1000, 2000)}) == 1000


def test_a_process_that_sees_one_gpu_uses_it_whatever_its_local_rank(monkeypatch):
    """srun --gpus-per-task=1 (or --gpu-bind): each task sees one device, its cuda:0, while
    SLURM_LOCALID counts the node's tasks. Several devices: cuda:LOCAL_RANK; fewer than
    LOCAL_RANK + 1: refused, naming the variables to fix. (No GPU here: the count is
    monkeypatched; the join itself is stubbed where it would need NCCL.)"""
    import rlhf_fusion.launch as launch

    joined = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: joined.setdefault("device", d))
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, **k: joined.setdefault("backend", backend))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")   # join_group sets them: restored (unset) after the test
        monkeypatch.delenv(k)
    group = group_from_env({**SLURM, "SLURM_LOCALID": "3", "MASTER_PORT": "29511"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.join_group(group, timeout=5) == torch.device("cuda", 0)
    assert joined == {"device": torch.device("cuda", 0), "backend": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.device_for(3) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LaunchEnvError, match=r"LOCAL_RANK=3 but this process sees 2 GPUs "
                                              r"\(cuda:0 to cuda:1\).*--nproc-per-node.*"
                                              r"--gpus-per-task=1.*CUDA_VISIBLE_DEVICES.*"
                                              r"fix LOCAL_RANK \(SLURM_LOCALID under srun\)"):
        launch.join_group(group, timeout=5)


def test_a_stop_passes_through_the_stage_wrapper_unchanged():
    """RunInterrupted (SIGINT, or a stop whose --stop-grace ran out) is not a stage's failure:
    the wrapper that names the rank and stage of an error lets it through as it is, so the
    command exits 128 + signum, not 1."""
    from types import SimpleNamespace

    from rlhf_fusion.loop.iteration import LoopStageError, PPOWorker

    where = SimpleNamespace(iteration_index=2, rank=1, world=2)
    stop = RunInterrupted(signal.SIGTERM, "the run did not reach an iteration boundary")
    with pytest.raises(RunInterrupted) as got:
        with PPOWorker._stage(where, "training"):
            raise stop
    assert got.value is stop
    assert not isinstance(stop, Exception)   # every `except Exception` on the way lets it by
    with pytest.raises(LoopStageError, match="rank 1 of 2: training of iteration 2 failed: "
                                             "ValueError: x"):
        with PPOWorker._stage(where, "training"):
            raise ValueError("x")


def test_a_group_of_another_size_than_the_config_is_refused_before_joining(tmp_path,
                                                                        monkeypatch):
    import rlhf_fusion.launch as launch
    from rlhf_fusion.loop import RLHFConfig
    from rlhf_fusion.loop.demo import demo_prompts

    monkeypatch.setattr(launch, "join_group", lambda *a, **k: pytest.fail("joined"))
    for k, v in {**SLURM, "SLURM_NTASKS": "4"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = RLHFConfig.from_file(_config(tmp_path))
    with pytest.raises(LoopConfigError, match=r"SLURM started 4 processes \(SLURM_NTASKS=4\) "
                                              r"but the config's world_size is 2: set "
                                              r"world_size: 4 .*\(srun --ntasks 2\)"):
        train(cfg, demo_prompts(), out_dir=tmp_path / "out", progress=False)
    monkeypatch.setenv("SLURM_PROCID", "x")
    with pytest.raises(LoopConfigError, match="SLURM_PROCID='x' is not an integer; start one "
                                              "process per task with srun"):
        train(cfg, demo_prompts(), out_dir=tmp_path / "out", progress=False)


GRPO_YAML = """world_size: 2
iterations: 2
algorithm: {name: grpo, n: 4, use_kl_loss: true, kl_ctrl: adaptive, target_kl: 0.01}
models: {actor: {family: llama, layers: 2, hidden: 32}, tokenizer: arithmetic,
         reward: arithmetic, seed: 3}
generation: {prompts_per_iteration: 4, max_new_tokens: 12, seed: 5}
ppo: {micro_batches: 2, num_mini_batches: 2, num_ppo_epochs: 1, learning_rate: 3.0e-3}
fusion: {inter: true, intra: false, rt: 0.25}
"""


@pytest.mark.slow   # about 95 s on 2 loaded cores: three processes start and train twice
def test_grpo_on_two_torchrun_nodes_equals_the_spawned_run(tmp_path):
    """A critic-free run joins torchrun's group like PPO: the same Actor (no Critic) and
    optimizer state as the ranks `rlhf-fusion train` spawns, bit for bit."""
    config = tmp_path / "grpo.yaml"
    config.write_text(GRPO_YAML)
    spawned = subprocess.Popen([sys.executable, "-m", "rlhf_fusion.cli", "train", str(config),
                                "--out", str(tmp_path / "spawned"), "--checkpoint-every", "2"],
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    (err,) = _finish([spawned], 300)
    assert spawned.returncode == 0, err[-3000:]
    port = free_port()
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "rlhf_fusion.cli", "train", str(config),
         "--out", str(outs[r]), "--checkpoint-every", "2"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for r in range(2)]
    errs = _finish(procs, 300)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    got, want = _params(outs[0], 2), _params(tmp_path / "spawned", 2)
    assert not any(".critic." in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    assert "GRPO iterations" in errs[0]
