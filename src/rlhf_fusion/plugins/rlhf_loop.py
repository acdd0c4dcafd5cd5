"""``RLHFLoopStrategy``: run :class:`~rlhf_fusion.plugins.RLHFModule` on N processes.

It starts the processes (``Trainer(devices=N)``) and the process group, and otherwise stays out
of the way: the module's PPO worker does its own distribution (generation instances,
migration, the fused training pipeline, weight sync), so the model is not wrapped and every
rank reads the same prompts, in the order of the user's sampler.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override

from .process_group import ProcessGroupStrategy, StartMethod


class RLHFLoopStrategy(ProcessGroupStrategy):
    """One PPO worker per process; ``timeout_s`` bounds every wait on a peer."""

    strategy_name = "rlhf_loop"

    def __init__(self, *, timeout_s: float = 300.0, start_method: StartMethod = "spawn",
                 **kwargs: Any) -> None:
        super().__init__(timeout=timeout_s, start_method=start_method, **kwargs)

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
    (``PR_SET_PDEATHSIG`` + a watchdog), and SIGTERM, SIGINT or any error in the launching
    process stops every worker at once before Lightning's own handling runs (which exits
    with status 1 after a "graceful shutdown" message for an interrupt). Without this,
    Lightning's launcher joins workers that keep training after the launcher was told to stop.
    Workers ignore SIGINT: a Ctrl-C stops them through the launcher.
    """

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        self.procs = []
        previous = None
        if _in_main_thread():
            previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            # SIGKILL: Lightning's own SIGTERM handler in a worker only stops it at the next
            # step's end, which can be minutes away.
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5.0)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        from ..launch import die_with_parent

        die_with_parent(os.getppid())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        super()._wrapping_function(*args, **kwargs)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    # Lightning handles KeyboardInterrupt in the launching process (a clean exit, status 1);
    # SIGTERM gets the same path instead of killing the process outright.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt
