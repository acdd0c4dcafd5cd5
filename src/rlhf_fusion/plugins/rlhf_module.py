"""The RLHF loop as a LightningModule: each ``training_step`` is one PPO iteration.

The algorithm lives here (``rlhf_fusion.loop.PPOWorker``); the distribution in the strategy
(:class:`~rlhf_fusion.plugins.RLHFLoopStrategy`). Without that strategy the same module runs the
same iteration on one device, unfused: that run is what the fused one must reproduce.

    module = RLHFModule(RLHFConfig(...))
    L.Trainer(strategy=RLHFLoopStrategy(), devices=2, max_epochs=1).fit(module, prompt_loader)

``prompt_loader`` yields batches of prompt strings (``generation.prompts_per_iteration`` each);
:class:`~rlhf_fusion.plugins.PromptLoader` also resumes in the middle of an epoch. Every
iteration is one Lightning step (``global_step``, ``every_n_train_steps``, ``max_steps`` and
``log_every_n_steps`` count iterations) and logs TRL's PPO metric names
(``objective/scores``, ``loss/policy_avg``, ...). Checkpoints hold every rank's share and
resume exactly, at an epoch's end or, with a stateful loader, within an epoch.

Preemption: on SIGTERM (to any rank, or to the launching process of
:class:`~rlhf_fusion.plugins.RLHFLoopStrategy`, which passes it on) the ranks finish the
iteration in progress, agree at its end that one of them was told to stop, write a checkpoint
where Lightning's SLURM requeue writes its own (``default_root_dir/hpc_ckpt_N.ckpt``) and end
``fit`` normally, so the script exits 0. ``fit(ckpt_path="hpc")`` resumes it (under SLURM
Lightning picks it up by itself). Lightning's own SIGTERM handler is replaced while training:
it broadcasts from inside the signal handler, which a rank between two of the loop's
collectives pairs with the wrong one, and it stops with ``SIGTERMException`` at the next step
without a checkpoint.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ..loop.checkpoint import load_worker_state, worker_state
from ..loop.config import RLHFConfig

_CKPT_KEY = "rlhf_loop_ranks"


class RLHFModule(pl.LightningModule):
    """The loop's algorithm (``config.algorithm``: PPO on the four models, or GRPO, RLOO,
    REINFORCE++ without a Critic); ``training_step`` runs one whole iteration."""

    def __init__(self, config: RLHFConfig) -> None:
        super().__init__()
        config.validate()   # in the constructing process, before any rank starts
        self.config = config
        self.automatic_optimization = False
        self.worker: Any = None  # built in setup(), in the process that runs it
        self.history: list[dict[str, float]] = []
        self._pending: list[Any] | None = None
        self.stopped_checkpoint: str | None = None  # set when a SIGTERM stopped the run

    # -- building ------------------------------------------------------------------------------
    def run_config(self) -> RLHFConfig:
        """The config as this process runs it: one device without a process group."""
        cfg = copy.deepcopy(self.config)
        if not (dist.is_available() and dist.is_initialized()):
            cfg.world_size = 1
            cfg.fusion.inter = False
        else:
            cfg.world_size = dist.get_world_size()
        return cfg

    def setup(self, stage: str) -> None:
        if self.worker is None:
            from ..loop.iteration import PPOWorker

            self.worker = PPOWorker(self.run_config())

    def configure_optimizers(self) -> Any:
        # The worker owns one optimizer per resident training stage (see PPOWorker).
        return None

    # -- one iteration -------------------------------------------------------------------------
    def training_step(self, batch: Sequence[str], batch_idx: int) -> None:
        tok = self.worker.tokenizer
        prompts = [tok.encode(p) for p in batch]
        want = self.config.generation.prompts_per_iteration
        if len(prompts) != want:
            raise ValueError(f"the dataloader gave {len(prompts)} prompts; the config's "
                             f"generation.prompts_per_iteration is {want}: set batch_size={want}"
                             " and drop_last=True")
        # Generation and scoring run in their own precision (float64 by default), whatever
        # the Trainer's precision plugin set for the step; training runs under it.
        res = self.worker.iteration(prompts)
        self._count_iteration()
        self.history.append({"iteration": self.worker.iteration_index - 1, **res.metrics})
        self.log_dict(res.metrics, on_step=True, on_epoch=False, batch_size=want,
                      rank_zero_only=True)
        return None

    def _count_iteration(self) -> None:
        # Lightning counts optimizer steps (global_step, every_n_train_steps, max_steps); the
        # worker steps its own optimizers, so the iteration is counted here, as
        # LightningOptimizer.step counts a step in manual optimization.
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    # -- checkpoints: every rank's share, gathered into the one file rank 0 writes ----------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        share = worker_state(self.worker, self.history)
        if dist.is_available() and dist.is_initialized():
            shares: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(shares, share)
        else:
            shares = [share]
        checkpoint[_CKPT_KEY] = shares

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        shares = checkpoint.get(_CKPT_KEY)
        if shares is None:
            raise KeyError("checkpoint: no RLHF loop state; it was not written by RLHFModule")
        if self.worker is None:
            self._pending = shares
            return
        self._restore(shares)

    def _restore(self, shares: list[Any]) -> None:
        rank = self.worker.rank
        if len(shares) != self.worker.world:
            raise ValueError(f"checkpoint: written by {len(shares)} ranks, this run has "
                             f"{self.worker.world}; resume with the same number of devices")
        self.history = load_worker_state(self.worker, shares[rank])

    def on_train_start(self) -> None:
        from ..launch import stop_on_sigterm

        if threading.current_thread() is threading.main_thread():
            stop_on_sigterm()   # instead of Lightning's notifier (see the module docstring)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        # A checkpoint written at a batch end counts that batch processed, not yet completed.
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        loader = self.trainer.train_dataloader
        mid_epoch = 0 < done < self.trainer.num_training_batches
        if mid_epoch and not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise ValueError(
                f"resuming in the middle of an epoch ({done} batches done) with a dataloader "
                "that restarts from its first batch: the run would repeat those prompts. Use "
                "rlhf_fusion.plugins.PromptLoader (or any loader with state_dict / "
                "load_state_dict), or resume from a checkpoint written at an epoch's end")

    # -- preemption ------------------------------------------------------------------------------
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        from ..launch import agree_to_stop

        trainer = self.trainer
        # Lightning's flag too: its handler runs if the signal came before training started.
        if not agree_to_stop(also=trainer.received_sigterm):
            return
        trainer._signal_connector.received_sigterm = False   # stopping here, not at its check
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        path = trainer.strategy.broadcast(path, src=0)
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.stopped_checkpoint = path
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"SIGTERM: stopped after iteration {trainer.global_step}; checkpoint "
                       f"{path}; resume with trainer.fit(..., ckpt_path=\"hpc\")")

    def teardown(self, stage: str) -> None:
        from ..launch import clear_stop_request

        clear_stop_request()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """This rank's canonical Actor/Critic parameters (``actor.*``, ``critic.*``)."""
        return self.worker.canonical_state()
