"""Running the loop: N local processes, a row per iteration, metrics.jsonl, checkpoints.

``train(cfg, prompts, out_dir=...)`` validates everything in the calling process, then spawns
``cfg.world_size`` gloo ranks (one process, no group, when ``world_size == 1``). Started by
``torchrun`` or ``srun`` (their variables in the environment:
:func:`rlhf_fusion.launch.group_from_env`), every process is one rank instead: it joins their
group and rank 0 prepares the run for all. Rank 0 prints a progress bar and a row per
iteration and writes ``metrics.jsonl``. With ``checkpoint_every`` every rank's share is saved
at iteration boundaries (by rank 0, atomically, the newest ``keep_checkpoints`` kept:
:mod:`.checkpoint`); ``resume=True`` continues from the newest complete one, skipping a
corrupt one, drops the metrics rows written after it, and gives the same results as a run
that was never interrupted. A stop request (SIGTERM to any rank) ends the run at the next
iteration boundary with that iteration's checkpoint. An output folder that is not empty needs
``resume`` or ``overwrite``: two runs never mix in one folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import LoopConfigError, RLHFConfig
from .resolve import ResolvedRun, resolve_run

ROW_KEYS = (("objective/scores", "reward", "{:.3f}"), ("objective/kl", "kl", "{:.3f}"),
            ("loss/policy_avg", "pg", "{:+.3f}"), ("loss/value_avg", "vf", "{:.3f}"),
            ("response_length/p50", "len50", "{:.0f}"), ("response_length/p99", "len99", "{:.0f}"),
            ("fusion/rt", "R_t", "{:.0f}"), ("fusion/migrated", "moved", "{:.0f}"),
            ("samples_per_s", "samples/s", "{:.1f}"))


def load_prompts(path: str | Path) -> list[str]:
    """One prompt a line (``.txt``) or JSON lines with a ``"prompt"`` field (``.jsonl``)."""
    p = Path(path)
    if p.is_dir():
        raise LoopConfigError(f"prompts: {p} is a directory; give a prompt file")
    if not p.exists():
        raise LoopConfigError(f"prompts: {p} does not exist")
    lines = [(n, x) for n, x in enumerate(p.read_text().splitlines(), 1) if x.strip()]
    if p.suffix != ".jsonl":
        return [x for _, x in lines]
    out = []
    for n, x in lines:
        try:
            row = json.loads(x)
        except json.JSONDecodeError as exc:
            raise LoopConfigError(f"prompts: {p} line {n}: not JSON ({exc.msg}); each line of a "
                                  '.jsonl prompt file is an object like {"prompt": "..."}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise LoopConfigError(f'prompts: {p} line {n}: no "prompt" text field (has {keys}); '
                                  'each line of a .jsonl prompt file is an object like '
                                  '{"prompt": "..."}')
        out.append(row["prompt"])
    return out


def prompts_for(prompt_ids: Sequence[Sequence[int]], iteration: int, batch: int
                ) -> list[list[int]]:
    """The prompts of one iteration: the next ``batch`` of the dataset, cycling."""
    n = len(prompt_ids)
    return [list(prompt_ids[(iteration * batch + i) % n]) for i in range(batch)]


def summary_row(it: int, m: dict[str, float]) -> str:
    return f"{it:>4}  " + "  ".join(f"{label}={fmt.format(m[k])}" for k, label, fmt in ROW_KEYS
                                    if k in m)


def train(cfg: RLHFConfig | ResolvedRun, prompts: Sequence[str], *, out_dir: str | Path | None = None,
          checkpoint_every: int = 0, resume: bool = False, progress: bool = True,
          stop_after: int | None = None, timeline_serial: bool = False,
          keep_experiences: bool = False, threads: int = 1, overwrite: bool = False,
          keep_checkpoints: int = 2) -> dict[str, Any]:
    """Run ``cfg.iterations`` PPO iterations (``stop_after`` ends earlier, as a kill between
    iterations would). Returns rank 0's ``history`` (metrics per iteration), ``timelines``,
    ``seconds``, ``states`` (every rank's canonical parameters) and, with
    ``keep_experiences``, every iteration's experience batch. ``keep_checkpoints``: the
    newest K checkpoints stay, older ones are deleted (0 keeps all). ``cfg``: a config, or
    the run :func:`~rlhf_fusion.loop.resolve.resolve_run` resolved (checked once, here or
    by the caller, and handed to every rank)."""
    run = resolve_run(cfg)
    cfg = run.config
    if keep_checkpoints < 0:
        raise LoopConfigError("keep_checkpoints: must be >= 0 (0 keeps every checkpoint)")
    if checkpoint_every < 0:
        raise LoopConfigError("checkpoint_every: must be >= 0 (0 writes no checkpoints)")
    from ..launch import LaunchEnvError, group_from_env

    try:
        group = group_from_env()
    except LaunchEnvError as exc:
        raise LoopConfigError(str(exc)) from None
    rest = (checkpoint_every, progress, stop_after, timeline_serial, keep_experiences,
            keep_checkpoints)
    if group is not None:
        return _train_joined(group, run, prompts, out_dir, resume, overwrite, rest)
    run, prompt_ids, start, _ = _prepare(run, prompts, out_dir, resume, overwrite)
    cfg = run.config
    args = (run, prompt_ids, str(out_dir) if out_dir else None, checkpoint_every, start,
            progress, stop_after, timeline_serial, keep_experiences, keep_checkpoints)
    if cfg.world_size == 1:
        # One process (also torchrun --nproc-per-node 1, which joins no group): the GPU when
        # there is one, as a joined rank uses its cuda:LOCAL_RANK.
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        if progress and device != "cpu":
            print(f"rlhf-fusion: one process, on {device} ({torch.cuda.get_device_name()})",
                  file=sys.stderr)
        out = rank_main(0, 1, *args, device=device)
        out["states"] = [out["state"]]
        return out
    from ..launch import run_ranks

    results = run_ranks(rank_main, cfg.world_size, *args, threads=threads,
                        collective_timeout=cfg.fusion.timeout_s,
                        timeout=cfg.fusion.timeout_s * max(cfg.iterations, 1) * 4 + 300)
    out = results[0].value
    out["states"] = [r.value["state"] for r in results]
    _merge_train_events(out, [r.value for r in results])
    return out


def _prepare(run: ResolvedRun, prompts: Sequence[str], out_dir: str | Path | None, resume: bool,
             overwrite: bool) -> tuple[ResolvedRun, list[list[int]], int | None, str | None]:
    """Everything checked once, before any rank trains: the output folder (and the checkpoint
    to resume from), the prompts' token ids, the searched plan. Returns the config to run,
    the token ids, the iteration to resume from and the searched plan's JSON (None: none)."""
    cfg = run.config
    start = prepare_out_dir(out_dir, cfg.world_size, resume=resume, overwrite=overwrite)
    if not prompts:
        raise LoopConfigError("prompts: the prompt set is empty")
    from .models import load_tokenizer

    tok = load_tokenizer(cfg.models)
    prompt_ids = [tok.encode(p) for p in prompts]
    empty = [i for i, p in enumerate(prompt_ids) if not p]
    if empty:
        raise LoopConfigError(f"prompts: {len(empty)} prompts encode to no tokens (first: line "
                              f"{empty[0] + 1}); remove them")
    plan = None
    if cfg.placement.search is not None:
        run = _with_searched_plan(cfg, prompt_ids, out_dir)
        plan = Path(run.config.placement.plan).read_text()
    return run, prompt_ids, start, plan


def _train_joined(group: Any, run: ResolvedRun, prompts: Sequence[str],
                  out_dir: str | Path | None, resume: bool, overwrite: bool,
                  rest: tuple) -> dict[str, Any]:
    """This process's rank of a run whose processes torchrun or srun started: join their
    group, let rank 0 check the output folder and prepare the run for every rank, train.
    Only rank 0 writes into ``out_dir`` (metrics, checkpoints, the searched plan)."""
    import tempfile

    import torch.distributed as dist

    from ..launch import join_group

    cfg = run.config
    _check_restartable(group)
    if group.world_size != cfg.world_size:
        var = "WORLD_SIZE" if group.source == "torchrun" else "SLURM_NTASKS"
        how = (f"torchrun --nnodes N --nproc-per-node M with N x M = {cfg.world_size}"
               if group.source == "torchrun" else f"srun --ntasks {cfg.world_size}")
        raise LoopConfigError(
            f"{group.source} started {group.world_size} processes ({var}={group.world_size}) "
            f"but the config's world_size is {cfg.world_size}: set world_size: "
            f"{group.world_size} (and a placement for that many devices), or start "
            f"{cfg.world_size} processes ({how})")
    device = join_group(group, timeout=cfg.fusion.timeout_s)
    plan_copy = None
    try:
        setup: list[Any] = [None]
        if group.lead:
            try:
                setup[0] = _prepare(run, prompts, out_dir, resume, overwrite)
            except Exception as exc:  # noqa: BLE001 - every rank stops with it
                setup[0] = exc
        dist.broadcast_object_list(setup, src=0)
        got = setup[0]
        if isinstance(got, BaseException):
            if group.lead:
                raise got
            if isinstance(got, LoopConfigError):
                raise LoopConfigError(str(got))
            raise RuntimeError(f"rank 0 failed preparing the run: {type(got).__name__}: {got}")
        run, prompt_ids, start, plan = got
        if resume and out_dir is not None:
            _check_resume_agrees(out_dir)
        if plan is not None and not group.lead:
            # rank 0's folder may be on another node: this rank reads its own copy
            plan_copy = Path(tempfile.mkdtemp(prefix="rlhf-fusion-plan-"))
            where = plan_copy / "plan.json"
            where.write_text(plan)
            cfg = copy.deepcopy(run.config)
            cfg.placement.plan = str(where)
            run = dataclasses.replace(run, config=cfg)
        checkpoint_every, progress, stop_after, timeline_serial, keep_experiences, keep = rest
        out = rank_main(group.rank, group.world_size, run, prompt_ids,
                        str(out_dir) if out_dir else None, checkpoint_every, start,
                        progress, stop_after, timeline_serial, keep_experiences, keep,
                        device=str(device))
    finally:
        if plan_copy is not None:
            shutil.rmtree(plan_copy, ignore_errors=True)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - after a failure the group may be half gone
            pass
    out["states"] = [out["state"]]
    out["rank"] = group.rank
    return out


def _check_restartable(group: Any) -> None:
    """Under ``torchrun --max-restarts N`` the ranks must not join through torchrun's own
    store: since torch 2.5 it is shared with them and outlives an attempt, so a restart's
    ranks read the dead ones' addresses and fail to connect (pytorch/pytorch#135712). Said
    at the start, not after the first failure."""
    env = os.environ
    if (group.source != "torchrun" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or env.get("TORCHELASTIC_MAX_RESTARTS", "0") in ("", "0")):
        return
    raise LoopConfigError(
        f"torchrun --max-restarts {env['TORCHELASTIC_MAX_RESTARTS']}: torchrun shares its "
        "rendezvous store with the ranks, and a restart would hand them the previous "
        "attempt's addresses (pytorch/pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "in torchrun's environment and use its c10d rendezvous (--standalone or --rdzv-backend "
        "c10d) (docs/loop.md, Restarts)")


def _check_resume_agrees(out_dir: str | Path) -> None:
    """Resuming a joined run: no rank may see a newer checkpoint in its ``out_dir`` than
    rank 0 resumes from. Rank 0 alone writes checkpoints, into its node's ``--out``; after an
    elastic restart another node may be rank 0, and unless ``--out`` is shared it would start
    the run over while the checkpoints sit on the old node. Collective; every rank raises."""
    import socket

    import torch.distributed as dist

    from .checkpoint import complete_checkpoints

    done = complete_checkpoints(out_dir)
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), done[-1][0] if done else None))
    host0, it0 = seen[0]
    newer = [(r, h, it) for r, (h, it) in enumerate(seen)
             if it is not None and (it0 is None or it > it0)]
    if newer:
        r, host, it = newer[0]
        mine = f"iteration {it0}" if it0 is not None else "none"
        raise LoopConfigError(
            f"--resume: rank {r} (on {host}) finds a checkpoint of iteration {it} in its "
            f"--out {out_dir}, rank 0 (on {host0}) {mine}: rank 0 writes the checkpoints "
            "into its own node's --out, and after a restart another node may be rank 0. Give "
            "--out a folder every node shares (or copy the newest checkpoint to rank 0's "
            "node) and start again; rank 0 would otherwise start the run over")


def _predicted_speedup(worker: Any) -> float | None:
    """The planner's fused-over-serial-1F1B training speedup on the profiled stage times."""
    sched = getattr(worker, "schedule", None)
    try:
        return float(sched.speedup()) if sched is not None else None
    except (KeyError, ZeroDivisionError):
        return None


def _merge_train_events(out: dict[str, Any], per_rank: Sequence[dict[str, Any]]) -> None:
    """Every rank's pipeline instructions into rank 0's timelines (``train_ranks``), on rank
    0's clock: ``perf_counter`` is the machine's monotonic clock, shared by the processes."""
    for key in ("timelines", "serial_timeline"):
        mine = out.get(key)
        if mine is None:
            continue
        lists = [mine] if isinstance(mine, dict) else mine
        for i, tl in enumerate(lists):
            ranks = []
            for v in per_rank:
                other = v.get(key)
                o = other if isinstance(other, dict) else (other[i] if other else None)
                if o is None:
                    ranks.append([])
                    continue
                shift = o["t0"] - tl["t0"]
                ranks.append([(n, a + shift, b + shift) for n, a, b in o["train_events"]])
            tl["train_ranks"] = ranks


def _with_searched_plan(cfg: RLHFConfig, prompt_ids: Sequence[Sequence[int]],
                        out_dir: str | Path | None) -> ResolvedRun:
    """Search the plan once, here, and hand every rank the same file."""
    import tempfile

    from .placement import PlacementConfigError, search_plan

    where = (Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="rlhf-fusion-"))) \
        / "plan.json"
    try:
        path = search_plan(cfg, sum(map(len, prompt_ids)) / len(prompt_ids), where)
    except PlacementConfigError as exc:
        raise LoopConfigError(str(exc)) from exc
    cfg = copy.deepcopy(cfg)
    cfg.placement.search = None
    cfg.placement.plan = path
    run = resolve_run(cfg)
    assert run.placement is not None
    print(f"placement: searched plan written to {path}\n{run.placement.describe()}",
          file=sys.stderr)
    return run


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "plan.json", "profiles", "error.log")
"""What a run writes into its output folder (what ``overwrite`` deletes)."""


def prepare_out_dir(out_dir: str | Path | None, world: int, *, resume: bool,
                    overwrite: bool) -> int | None:
    """Check the output folder before any rank starts; returns the iteration to resume from
    (None: start afresh). A folder with anything in it needs ``resume`` (continue the run in
    it) or ``overwrite`` (delete that run's outputs first)."""
    if out_dir is None:
        return None
    from .checkpoint import resume_point

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LoopConfigError(f"--out {out}: exists and is not a folder; choose another --out")
    if resume and overwrite:
        raise LoopConfigError("--resume and --overwrite: choose one (continue the run in --out, "
                              "or start over)")
    if resume:
        start = resume_point(out, world)
        if start is None:
            print(f"resume: no complete checkpoint in {out}; starting the run at iteration 0",
                  file=sys.stderr)
        return start
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LoopConfigError(
                f"--out {out}: the folder is not empty (an earlier run's output?); pass "
                "--resume to continue that run or --overwrite to start over in it "
                "(API: resume=True / overwrite=True)")
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    return None


def _keep_metrics_before(path: Path, start: int) -> None:
    """Drop the rows of iterations >= ``start``: they were written after the checkpoint the
    run resumes from, and the resumed run writes them again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line)["iteration"] < start]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def rank_main(rank: int, world: int, cfg: RLHFConfig | ResolvedRun, prompt_ids: list[list[int]],
              out_dir: str | None, checkpoint_every: int, resume_from: int | None,
              progress: bool, stop_after: int | None, timeline_serial: bool,
              keep_experiences: bool = False, keep_checkpoints: int = 2, *,
              device: str = "cpu") -> dict[str, Any]:
    """One rank of :func:`train`; ``resume_from`` is the checkpoint's iteration (chosen and
    verified by the launching process, so every rank loads the same one).

    A stop request (:func:`rlhf_fusion.launch.agree_to_stop`: SIGTERM to any rank) ends the
    run at the next iteration boundary, every rank at the same one, after writing that
    iteration's checkpoint; ``stopped`` in the result is that iteration (None: the run
    ended)."""
    from ..launch import agree_to_stop, listen_to_stages, note_stage, stop_requested
    from .checkpoint import (
        load_checkpoint,
        load_worker_state,
        save_checkpoint,
        worker_state,
    )
    from .iteration import PPOWorker

    run = resolve_run(cfg, sources=False)   # resolved by train: handed over as it is
    cfg = run.config
    if run.hooks.on_note is not None:
        listen_to_stages(run.hooks.on_note)
    note_stage("building the models")
    torch.manual_seed(cfg.models.seed)
    worker = PPOWorker(run) if device == "cpu" else PPOWorker(run, device=device)
    start = 0
    history: list[dict[str, float]] = []
    if resume_from is not None and out_dir is not None:
        note_stage(f"loading the checkpoint of iteration {resume_from}")
        history = load_checkpoint(worker, out_dir, resume_from)
        start = resume_from
    lead = rank == 0
    log = None
    if lead and out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        metrics = Path(out_dir) / "metrics.jsonl"
        if start:
            _keep_metrics_before(metrics, start)
        log = open(metrics, "a" if start else "w")  # noqa: SIM115
    bar = None
    if lead and progress:
        import threading

        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore; a thread lock leaves nothing
        # for the resource tracker to warn about when the rank exits.
        tqdm.set_lock(threading.RLock())

        bar = tqdm(total=cfg.iterations, initial=start, desc=f"{cfg.algorithm.name.upper()} iterations", unit="it",
                   file=sys.stderr, dynamic_ncols=True)
    timelines = []
    kept = []
    end = cfg.iterations if stop_after is None else min(cfg.iterations, stop_after)
    # One-time work before the clock starts: the training pipeline's profile and schedule.
    planning_s = worker.plan_training(sum(map(len, prompt_ids)) / max(len(prompt_ids), 1))
    t_run = time.perf_counter()
    snapshot = None
    res = None
    stopped = None
    saved = start   # the newest iteration a checkpoint holds (start: the one resumed from)
    for it in range(start, end):
        if agree_to_stop():
            # Between two iterations: the last one finished on every rank, nothing of the
            # next has started. Its checkpoint (unless written just now) is what resumes.
            if out_dir is not None and saved != it:
                note_stage(f"checkpoint of iteration {it} (stopping)")
                save_checkpoint(worker, out_dir, it, history, keep=keep_checkpoints)
            stopped = it
            break
        if timeline_serial and it == end - 1:
            # Replayed serially after the run: the same weights and prompts give the same
            # samples, so the two timelines of this iteration compare like with like.
            snapshot = copy.deepcopy(worker_state(worker, history))
        res = worker.iteration(prompts_for(prompt_ids, it, cfg.generation.prompts_per_iteration))
        row = {"iteration": it, **res.metrics}
        history.append(row)
        timelines.append(res.timeline)
        if keep_experiences and lead:
            kept.append(res.experiences)
        if lead:
            if log is not None:
                log.write(json.dumps(_jsonl(row, cfg)) + "\n")
                log.flush()
            if bar is not None:
                bar.update(1)
                bar.write(summary_row(it, res.metrics))
        if out_dir is not None and checkpoint_every and (it + 1) % checkpoint_every == 0:
            note_stage(f"checkpoint of iteration {it + 1}")
            save_checkpoint(worker, out_dir, it + 1, history, keep=keep_checkpoints)
            saved = it + 1
    run_s = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()
    serial_timeline = None
    state = worker.canonical_state()
    if snapshot is not None:
        load_worker_state(worker, snapshot)
        worker.set_fusion(inter=False, intra=False)
        again = worker.iteration(prompts_for(prompt_ids, end - 1,
                                             cfg.generation.prompts_per_iteration))
        serial_timeline = again.timeline
    experiences = res.experiences if res is not None else []
    worker.close()
    return {"history": history, "state": state, "timelines": timelines, "seconds": run_s,
            "planning_s": planning_s, "schedule_speedup": _predicted_speedup(worker),
            "serial_timeline": serial_timeline, "rt_history": worker.rt_planner.history,
            "experiences": experiences if rank == 0 else None, "stopped": stopped,
            "stop_signal": stop_requested() if stopped is not None else None,
            "experience_log": kept if rank == 0 else None}


def _jsonl(row: dict[str, float], cfg: RLHFConfig) -> dict[str, Any]:
    """The documented metrics.jsonl fields first, then every metric under its TRL name."""
    return {
        "iteration": row["iteration"],
        "reward_mean": row["objective/scores"],
        "kl": row["objective/kl"],
        "samples": cfg.generation.prompts_per_iteration * cfg.algorithm.n,
        "seconds": row["time/iteration"],
        "gen_s": row["time/generation"],
        "inf_s": row["time/inference"],
        "train_s": row["time/training"],
        "sync_s": row["time/weight_sync"],
        "fused": {"inter": cfg.fusion.inter, "intra": cfg.fusion.intra},
        **{k: v for k, v in row.items() if k != "iteration"},
    }

