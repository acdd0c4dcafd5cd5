"""A self-contained distributed rollout on tiny models, and the faults the tests inject into it.

Run it with ``rlhf_fusion.launch.run_ranks(tiny_job_worker, world_size, TinyJob(...))``; the
worker is module level so spawned ranks can unpickle it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from ..rollout.config import RolloutConfig
from ..rollout.distributed import FaultHook, run_rollout
from ..rollout.inference import InferenceModels
from ..rollout.reference import ReferenceBackend
from ..rollout.types import SampleSpec
from .models import build_causal_lm, build_value_model, tiny_config


def kill_destination_during_migration(point: str, n: int) -> None:
    """A destination exits (code 17) right after a source's ticket header arrived."""
    if point == "tickets_received":
        os._exit(17)


def kill_destination_while_streaming(point: str, n: int) -> None:
    """A destination exits (code 18) at its 5th decode step after the migration."""
    if point == "streaming_step" and n == 5:
        os._exit(18)


def late_progress_report_on_rank_0(point: str, n: int) -> None:
    """Rank 0 writes its progress report at the trigger half a second late (a slow rank): its
    peers decode on meanwhile, and their planned samples can finish before the export."""
    if point == "progress_report" and n == 0:
        time.sleep(0.5)


FAULTS: dict[str, FaultHook] = {
    "late_progress_report_on_rank_0": late_progress_report_on_rank_0,
    "kill_destination_during_migration": kill_destination_during_migration,
    "kill_destination_while_streaming": kill_destination_while_streaming,
}


@dataclass
class TinyJob:
    """Everything a rank needs to build its models and run one or more rollouts.

    Model entries are ``tiny_config`` keyword arguments plus ``"seed"``; every rank builds
    identical weights from them. ``fault`` names an entry of :data:`FAULTS`, injected into
    every rollout of the job.
    """

    specs: list[SampleSpec]
    configs: list[RolloutConfig]
    actor: dict = field(default_factory=dict)
    ref: dict | None = None
    reward: dict | None = None
    critic: dict | None = None
    bs_max: int = 32
    kv_capacity_tokens: int | None = None
    micro_batch: int = 8
    warmup: bool = True
    return_outputs: bool = True
    fault: str | None = None
    # Ranks that cannot open the one-host shared trigger board, as on another host: every
    # rank of the rollout then uses the c10d store.
    no_board_ranks: tuple[int, ...] = ()
    # Tickets above this many bytes go over gloo even on one host (as when /dev/shm is small).
    shm_ticket_max_bytes: int | None = None
    # Seconds each scoring micro-batch takes longer on these ranks (a slower core).
    slow_scoring: dict[int, float] = field(default_factory=dict)
    # Seconds each decode step takes longer on these ranks.
    slow_decoding: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r}; known: {sorted(FAULTS)}")


def model_config(entry: dict) -> tuple[Any, int]:
    """A :class:`TinyJob` model entry as (``tiny_config(...)``, seed)."""
    kw = dict(entry)
    seed = int(kw.pop("seed", 0))
    return tiny_config(**kw), seed


def tiny_job_worker(rank: int, world: int, job: TinyJob) -> list[dict[str, Any]]:
    """Build the backend and the inference models on this rank, run ``job.configs`` in order.

    Returns, per config, the rank's wall time (from a common barrier to the assembled batch),
    the stats, and, on rank 0 with ``return_outputs``, the output.
    """
    if rank in job.no_board_ranks:
        from ..rollout.board import SharedBoard

        SharedBoard.create = SharedBoard.attach = classmethod(  # type: ignore[method-assign]
            lambda cls, *a, **k: None)
    if job.shm_ticket_max_bytes is not None:
        from ..rollout import distributed

        distributed.SHM_TICKET_MAX_BYTES = job.shm_ticket_max_bytes
    acfg, aseed = model_config(job.actor)
    backend = ReferenceBackend(build_causal_lm(acfg, aseed), instance_id=rank,
                               max_batch_size=job.bs_max,
                               kv_capacity_tokens=job.kv_capacity_tokens)
    inference = None
    if job.ref is not None and job.reward is not None and job.critic is not None:
        rc, rs = model_config(job.ref)
        wc, ws = model_config(job.reward)
        cc, cs = model_config(job.critic)
        inference = InferenceModels(build_causal_lm(rc, rs), build_value_model(wc, ws),
                                    build_value_model(cc, cs), micro_batch=job.micro_batch)
    if job.warmup:  # first-call overheads (allocator, kernels) stay out of the measurements
        warm = [replace(s, sample_id=i, max_new_tokens=min(s.max_new_tokens, 4))
                for i, s in enumerate(job.specs[:2])]
        backend.submit(warm)
        wres = list(backend.results())
        if inference is not None:
            inference.score(wres)
    if inference is not None and job.slow_scoring.get(rank):
        inference.score = _slowed(inference.score, job.slow_scoring[rank], job.micro_batch)
    if job.slow_decoding.get(rank):
        backend.step = _slowed_step(backend.step, job.slow_decoding[rank])  # type: ignore[method-assign]
    fault: Callable[[str, int], None] | None = FAULTS[job.fault] if job.fault else None
    out = []
    for cfg in job.configs:
        dist.barrier()
        t = time.perf_counter()
        res = run_rollout(backend, inference, job.specs, cfg, bs_max=job.bs_max, faults=fault)
        wall = time.perf_counter() - t
        out.append({"wall_s": wall, "stats": res.stats,
                    "output": res if (rank == 0 and job.return_outputs) else None})
    return out


def _slowed(score: Callable[[Any], Any], seconds: float, micro: int) -> Callable[[Any], Any]:
    """``score`` that takes ``seconds`` longer per micro-batch of ``micro`` samples."""
    def run(samples: Any) -> Any:
        time.sleep(seconds * -(-len(samples) // micro))
        return score(samples)

    return run


def _slowed_step(step: Callable[[], Any], seconds: float) -> Callable[[], Any]:
    """A backend's ``step`` that takes ``seconds`` longer."""
    def run() -> Any:
        time.sleep(seconds)
        return step()

    return run
