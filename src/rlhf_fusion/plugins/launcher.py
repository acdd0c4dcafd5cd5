"""Process launcher for :class:`FusedPipelineStrategy`.

Lightning's spawn launcher, with two changes, both given to its constructor: a pre-flight
check runs in the launching process before any worker exists (a schedule that does not fit the
models fails in seconds, not after N processes imported torch), and the weights handed back to
the launching process come from a callable (the strategy's *gathered* unpartitioned state dict
rather than rank 0's shard), so the user's module in the main process is fully trained after
``fit`` returns.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

if TYPE_CHECKING:
    from .fused_pipeline import FusedPipelineStrategy


class FusedPipelineLauncher(_MultiProcessingLauncher):
    """Spawns one worker per device for ``strategy``.

    Args:
        strategy: the strategy whose workers are launched (Lightning's launcher contract).
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: seconds a worker waits for its peers before destroying the process group.
        preflight: called with the LightningModule in the launching process before any
            worker starts when fitting; raises to stop the launch.
        trained_weights: called in every worker after ``fit``; rank 0's result (a full state
            dict, or ``None`` for nothing) is loaded into the launching process's module.
    """

    def __init__(
        self,
        strategy: FusedPipelineStrategy,
        *,
        start_method: str = "spawn",
        timeout: float = 300.0,
        preflight: Callable[[pl.LightningModule], None] | None = None,
        trained_weights: Callable[[], Mapping[str, Tensor] | None] | None = None,
    ) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self._timeout = float(timeout)
        self._preflight = preflight
        self._trained_weights = trained_weights

    @override
    def launch(
        self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
    ) -> Any:
        module = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if self._preflight is not None and module is not None and fitting:
            self._preflight(module)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        # A worker that dies in C++ (an abort in a communication thread) otherwise leaves only
        # "terminate called ..." behind; this prints every thread's Python stack first.
        faulthandler.enable(all_threads=True)
        ok = False
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
            ok = True
        finally:
            _shutdown_process_group(self._timeout, wait_for_peers=ok)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        state_dict = None
        if trainer.state.fn == TrainerFn.FITTING and self._trained_weights is not None:
            state_dict = self._trained_weights()
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)


def _shutdown_process_group(timeout_s: float, *, wait_for_peers: bool) -> None:
    """Tear the default process group down on every worker before the interpreter exits.

    Left to interpreter finalization, the gloo groups are destroyed in arbitrary order while a
    peer may still be talking to them, and a worker can abort after a successful ``fit``. The
    barrier makes sure no rank closes its connections while another still uses them (skipped
    when this worker failed: its peers are failing too, and the error must surface now).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_peers:
        try:
            dist.barrier(async_op=True).wait(timedelta(seconds=max(timeout_s, 10.0)))
        except RuntimeError:
            pass  # a peer already failed; its error is the one the user needs
    dist.destroy_process_group()
