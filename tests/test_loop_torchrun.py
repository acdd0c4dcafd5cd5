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
    expand_hostlist,
    free_port,
    group_from_env,
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
    resumed = _torchrun(tmp_path, outs, "--resume")
    errs = _finish(resumed, 600)
    assert [p.returncode for p in resumed] == [0, 0], [e[-3000:] for e in errs]
    a, b = _params(outs[0], N), _params(spawned_run, N)
    assert all(torch.equal(a[k], b[k]) for k in b), _max_diff(a, b)
    rows, ref = _rows(outs[0]), _rows(spawned_run)
    assert [r["iteration"] for r in rows] == list(range(N))
    for x, y in zip(rows, ref, strict=True):
        assert {k: x[k] for k in LEARNING} == {k: y[k] for k in LEARNING}, x["iteration"]


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


def test_processes_started_with_srun_variables_join_and_equal_the_spawned_run(
        tmp_path, spawned_run):
    """What srun gives each task (no SLURM here: the variables set by hand, one process per
    task started separately) is enough to join: the same result as the spawned run."""
    port = free_port()
    config = _config(tmp_path)
    outs = (tmp_path / "out", tmp_path / "node1" / "out")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "rlhf_fusion.cli", "train", str(config), "--out", str(outs[r])],
        env={**_env(), "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for r in range(2)]
    errs = _finish(procs, 600)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    assert _max_diff(_params(outs[0], N), _params(spawned_run, N)) <= 1e-6
    assert not outs[1].exists()


# -- the environment: torchrun's and SLURM's variables -------------------------------------------

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODELIST": "gpu[07-08],login1", "SLURM_JOB_ID": "123456789"}


def test_slurm_variables_give_the_group_and_the_first_host_as_master():
    assert group_from_env(SLURM) == JoinedGroup(
        rank=3, world_size=4, local_rank=1, master_addr="gpu07", master_port=15000 + 6789,
        source="SLURM")
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
