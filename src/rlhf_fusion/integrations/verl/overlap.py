"""Trainer modes whose step updates the Critic and the Actor at the same time.

verl's v1 ``PPOTrainer._step_once`` (verl/trainer/ppo/v1/trainer_base.py) calls
``_update_critic`` and then ``_update_actor``; ``_update_critic`` dispatches
``critic_wg.train_mini_batch`` (non-blocking) and waits on it before returning, so the Actor's
update starts only when the Critic's has finished, even when the two run on different GPUs.

The modes registered here (``rlhf_fusion_sync``, ``rlhf_fusion_colocate_async``,
``rlhf_fusion_separate_async``: verl's three modes with this mixin) run verl's own
``_update_critic`` on a thread, started where the stock step calls it, and verl's own
``_update_actor`` on the calling thread; the step joins the Critic's thread before it returns.
Nothing else of the step changes. The Critic's update gets its own copy of the batch's
``extra_info`` (both updates write their mini-batch sizes, epochs and seeds there), its metrics
are merged into the step's when it is joined, and the batch returned carries both updates'
``extra_info`` in verl's order.

They only overlap when the Critic has a resource pool of its own. verl puts the Critic in
``global_pool`` with the Actor (``_init_resource_pool_mgr``); there ``_setup`` fuses every role
of a pool into one Ray actor per GPU (``create_colocated_worker_cls``), whose method calls run
one at a time, so the two updates would serialize in the worker anyway while holding both
models' training state on the same GPUs. ``+rlhf_fusion.critic_pool.n_gpus_per_node=N`` (and
``nnodes``, default ``trainer.nnodes``) gives the Critic ``N`` GPUs per node of its own; without
it the mode logs why it runs the updates one after the other, and runs them as verl does.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any

from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from .options import HYDRA_KEY, plugins_from_config
from .tail import TailConsolidationMixin

__all__ = ["MODES", "OverlapUpdatesMixin", "register_modes"]
# the modes also consolidate the rollout's long tail with +rlhf_fusion.tail.rt=N (.tail)

LOG = logging.getLogger("rlhf_fusion.verl")
CRITIC_POOL = "critic_pool"
# deadline on the Critic's thread: a step's update that has not finished in this long is hung
JOIN_TIMEOUT_S = 24 * 3600.0


class _CriticUpdate:
    """verl's ``_update_critic`` running on a thread, with its own metrics and batch copy."""

    def __init__(self, trainer: Any, batch: Any) -> None:
        self.batch = copy.copy(batch)
        self.batch.extra_info = dict(batch.extra_info)
        self.metrics: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(trainer,), daemon=True,
                                       name="rlhf_fusion-critic-update")
        self.thread.start()

    def _run(self, trainer: Any) -> None:
        try:
            trainer._stock_update_critic(self.batch, self.metrics)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the step's thread by join()
            self.error = exc

    def join(self) -> None:
        self.thread.join(JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            raise TimeoutError(f"the Critic's update did not finish in {JOIN_TIMEOUT_S:.0f} s")
        if self.error is not None:
            raise self.error


class OverlapUpdatesMixin:
    """Runs the Critic's and the Actor's updates of a step concurrently (module doc)."""

    # set by verl's PPOTrainer; declared for readers of this mixin
    config: Any
    use_critic: bool

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]
        # +rlhf_fusion.gae=true: GAE is computed in this process (the TaskRunner), so installing
        # it here is installing it everywhere it runs
        if "gae" in plugins_from_config(config):
            from .gae_plugin import install_now

            install_now(where=f"+{HYDRA_KEY}.gae")
        self._critic_update: _CriticUpdate | None = None
        self._overlap_said = False

    # ---------------------------------------------------------------- placement

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()  # type: ignore[misc]
        section = self.config.get(HYDRA_KEY) or {}
        pool = section.get("critic_pool") if hasattr(section, "get") else None
        if pool is None or not self.use_critic_config():
            return
        from verl.single_controller.ray.base import ResourcePoolManager
        from verl.trainer.ppo.utils import Role

        per_node = int(pool.get("n_gpus_per_node", 0))
        nnodes = int(pool.get("nnodes", self.config.trainer.nnodes))
        if per_node <= 0 or nnodes <= 0:
            raise ValueError(f"{HYDRA_KEY}.critic_pool needs n_gpus_per_node > 0 and nnodes > 0, "
                             f"got {per_node} and {nnodes}")
        manager = self.resource_pool_manager  # type: ignore[has-type]
        spec = dict(manager.resource_pool_spec)
        spec[CRITIC_POOL] = [per_node] * nnodes
        self.mapping[Role.Critic] = CRITIC_POOL  # type: ignore[attr-defined]
        self.resource_pool_manager = ResourcePoolManager(resource_pool_spec=spec,
                                                         mapping=self.mapping)

    def use_critic_config(self) -> bool:
        from verl.trainer.ppo.utils import need_critic

        return bool(need_critic(self.config))

    def overlap_blocker(self) -> str | None:
        """Why this trainer runs the two updates one after the other; None when it overlaps."""
        if not self.use_critic:
            return "there is no Critic (the advantage estimator needs none)"
        mapping = self.resource_pool_manager.mapping  # type: ignore[attr-defined]
        from verl.trainer.ppo.utils import Role

        critic_pool = mapping.get(Role.Critic)
        actor_pools = {mapping[r] for r in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef)
                       if r in mapping}
        if critic_pool in actor_pools:
            return (f"the Critic and the Actor share resource pool {critic_pool!r}: verl fuses the "
                    f"roles of a pool into one Ray actor per GPU (create_colocated_worker_cls), "
                    f"whose calls run one at a time. Give the Critic its own GPUs with "
                    f"+{HYDRA_KEY}.critic_pool.n_gpus_per_node=N")
        return None

    # ---------------------------------------------------------------- the step

    def _stock_update_critic(self, batch: Any, metrics: dict) -> Any:
        return super()._update_critic(batch, metrics)  # type: ignore[misc]

    def _update_critic(self, batch: Any, metrics: dict) -> Any:
        blocker = self.overlap_blocker()
        if not self._overlap_said:
            self._overlap_said = True
            LOG.warning("rlhf_fusion: Critic and Actor updates "
                        + ("run concurrently (separate resource pools)" if blocker is None
                           else f"run one after the other: {blocker}"))
        if blocker is not None:
            return self._stock_update_critic(batch, metrics)
        self._finish_critic_update(metrics)  # one in flight at most
        self._critic_update = _CriticUpdate(self, batch)
        return batch

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        pending = self._critic_update
        if pending is None:
            return super()._update_actor(batch, metrics)  # type: ignore[misc]
        # verl's Actor update reads the batch after the Critic's wrote its extra_info; the
        # Critic's keys are all keys the Actor's sets too, so what the Actor sends is the same
        # (tests/test_verl_overlap.py compares it with verl's sequential step)
        try:
            return super()._update_actor(batch, metrics)  # type: ignore[misc]
        finally:
            self._finish_critic_update(metrics, batch)

    def _finish_critic_update(self, metrics: dict, batch: Any = None) -> None:
        pending, self._critic_update = self._critic_update, None
        if pending is None:
            return
        pending.join()
        metrics.update(pending.metrics)
        if batch is not None:
            # verl's order: the batch carries the Critic's extra_info, then what came after
            merged = dict(pending.batch.extra_info)
            merged.update(batch.extra_info)
            batch.extra_info.clear()
            batch.extra_info.update(merged)

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
        try:
            batch = super()._step_once(metrics, timing_raw, sample_batch_size)  # type: ignore[misc]
        except BaseException:
            # wait for the Critic's update, but fail with what failed first
            with contextlib.suppress(BaseException):
                self._finish_critic_update(metrics)
            raise
        # the Actor did not update (critic_warmup): wait for the Critic here
        self._finish_critic_update(metrics, batch)
        return batch


class PPOTrainerSyncOverlap(TailConsolidationMixin, OverlapUpdatesMixin, PPOTrainerSync):
    """verl's ``sync`` mode, Critic and Actor updates overlapped."""


class PPOTrainerColocateAsyncOverlap(TailConsolidationMixin, OverlapUpdatesMixin, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` mode, Critic and Actor updates overlapped."""


class PPOTrainerSeparateAsyncOverlap(TailConsolidationMixin, OverlapUpdatesMixin, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` mode, Critic and Actor updates overlapped."""


MODES = {
    "rlhf_fusion_sync": PPOTrainerSyncOverlap,
    "rlhf_fusion_colocate_async": PPOTrainerColocateAsyncOverlap,
    "rlhf_fusion_separate_async": PPOTrainerSeparateAsyncOverlap,
}


def register_modes() -> None:
    """Register :data:`MODES` with verl's ``register_trainer`` (idempotent)."""
    for name, cls in MODES.items():
        if trainer_base.TRAINER_REGISTRY.get(name) is not cls:
            trainer_base.register_trainer(name)(cls)
