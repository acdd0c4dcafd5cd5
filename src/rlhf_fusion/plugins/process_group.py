"""What every strategy of ours shares with Lightning's ``DDPStrategy``: N processes on one or
more nodes, a process group (gloo on CPU, NCCL on GPU) with a timeout, and the collectives
Lightning calls for logging and callbacks. No model wrapping and no sampler injection: each
subclass decides how its models are distributed and which data each rank reads.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, TypedDict

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

StartMethod = Literal["spawn", "fork", "forkserver"]


class ProcessGroupOptions(TypedDict, total=False):
    """The keyword arguments of :class:`ProcessGroupStrategy` (see its ``__init__`` for the
    defaults), for subclasses that pass them through."""

    timeout: float
    process_group_backend: str | None
    start_method: StartMethod
    accelerator: pl.accelerators.Accelerator | None
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    precision_plugin: Precision | None


class ProcessGroupStrategy(ParallelStrategy):
    """Base of ``FusedPipelineStrategy`` and ``RLHFLoopStrategy``; not used on its own."""

    def __init__(
        self,
        *,
        timeout: float = 300.0,
        process_group_backend: str | None = None,
        start_method: StartMethod = "spawn",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self._num_nodes = 1
        self._timeout = float(timeout)
        self._process_group_backend = process_group_backend
        self._start_method = start_method

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()

    def _setup_distributed(self) -> None:
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend
            or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=timedelta(seconds=max(self._timeout, 60.0)),
        )

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # -- collectives used by Lightning (logging, callbacks) ----------------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
