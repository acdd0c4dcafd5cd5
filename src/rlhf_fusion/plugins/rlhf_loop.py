"""``RLHFLoopStrategy``: run :class:`~rlhf_fusion.plugins.RLHFModule` on N processes.

It starts the processes (``Trainer(devices=N)``) and the process group, and otherwise stays out
of the way: the module's PPO worker does its own distribution (generation instances,
migration, the fused training pipeline, weight sync), so the model is not wrapped and every
rank reads the same prompts, in the order of the user's sampler.
"""

from __future__ import annotations

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
        self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

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
