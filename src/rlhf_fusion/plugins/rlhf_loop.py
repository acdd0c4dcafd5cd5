"""``RLHFLoopStrategy``: run :class:`~rlhf_fusion.plugins.RLHFModule` on N processes.

It starts the processes (``Trainer(devices=N)``) and the process group, and otherwise stays out
of the way: the module's PPO worker does its own distribution (generation instances,
migration, the fused training pipeline, weight sync), so the model is not wrapped and every
rank reads the same prompts, in the order of the user's sampler.

Preemption: SIGTERM to the launching process is passed on to every worker; the workers finish
the iteration in progress, write a checkpoint and end ``fit`` normally (see
:class:`~rlhf_fusion.plugins.RLHFModule`); after ``stop_grace_s`` seconds without that, every
worker is stopped at once. Its checkpoints are written atomically (:class:`AtomicCheckpointIO`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override

from .process_group import ProcessGroupStrategy, StartMethod


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint file, written whole or not at all: into ``NAME.tmp`` next to it,
    flushed to disk, then renamed (Lightning's own writes a temporary file in the system's temp
    folder and moves it, a copy when that is another file system). Remote URLs keep
    Lightning's way."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class RLHFLoopStrategy(ProcessGroupStrategy):
    """One PPO worker per process; ``timeout_s`` bounds every wait on a peer, ``stop_grace_s``
    the stop after a SIGTERM (the iteration in progress and its checkpoint)."""

    strategy_name = "rlhf_loop"

    def __init__(self, *, timeout_s: float = 300.0, start_method: StartMethod = "spawn",
                 stop_grace_s: float = 25.0, **kwargs: Any) -> None:
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(timeout=timeout_s, start_method=start_method, **kwargs)
        self.stop_grace_s = stop_grace_s

    @property
    @override
    def is_distributed(self) -> bool:
        """False: Lightning would otherwise inject a shuffling DistributedSampler; one
        iteration is one batch of prompts that every rank takes part in."""
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        self._launcher = RLHFLoopLauncher(self, start_method=self._start_method)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("rlhf_loop", cls, description=cls.__doc__, override=True)


class RLHFLoopLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, made safe to stop: workers die with the launching process
    (``PR_SET_PDEATHSIG`` + a watchdog). SIGTERM to the launching process is passed on to the
    workers, which stop at their next iteration boundary with a checkpoint (preemption; a
    repeated SIGTERM is the same request: SLURM signals again when GraceTime ends); if
    ``fit`` has not returned ``stop_grace_s`` seconds later, or on SIGINT, or on any error,
    every worker is killed at once before Lightning's own handling runs (a "graceful
    shutdown" message and status 1 for an interrupt). Without this, Lightning's
    launcher joins workers that keep training after the launcher was told to stop. Workers
    ignore SIGINT: a Ctrl-C stops them through the launcher.
    """

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        self.procs = []
        self._stopping = False
        previous = None
        if _in_main_thread():
            previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGALRM)}
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            # SIGKILL: a worker told to stop finishes its iteration first, which can be
            # minutes away.
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5.0)
            raise
        finally:
            if previous is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                for s, handler in previous.items():
                    signal.signal(s, handler)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._stopping:
            return   # the same stop asked again (SLURM, torchrun): its deadline stands
        self._stopping = True
        self.kill(signal.SIGTERM)   # each worker's RLHFModule stops at its iteration's end
        signal.signal(signal.SIGALRM, _sigterm_as_interrupt)
        signal.setitimer(signal.ITIMER_REAL, getattr(self._strategy, "stop_grace_s", 25.0))

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        from ..launch import die_with_parent, stop_on_sigterm

        die_with_parent(os.getppid())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_on_sigterm()  # a SIGTERM during start-up is kept for RLHFModule's first step end
        super()._wrapping_function(*args, **kwargs)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    # Lightning handles KeyboardInterrupt in the launching process (a clean exit, status 1);
    # a stop that cannot wait gets the same path instead of killing the process outright.
    for s in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt
