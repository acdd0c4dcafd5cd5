"""The ``rlhf_fusion_*`` trainer modes: verl's own step with the Critic's and Actor's updates run
concurrently on separate pools, one after the other on a shared one.

verl's ``PPOTrainer._step_once`` runs unchanged over stub worker groups (what needs a GPU: the
Critic's ``train_mini_batch`` future, the Actor's ``update_actor``) and stub stages before them,
as tests/test_openrlhf_*.py stub OpenRLHF's Ray actors. Each test compares with verl's own
``sync`` mode on the same stubs: same stages in the same order, same payloads, same metrics.
"""

from __future__ import annotations

import importlib
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.verl

WAIT_S = 20.0  # deadline on every wait between the two stub updates


def _v1():
    try:
        importlib.import_module("verl.trainer.ppo.v1")
        return importlib.import_module("rlhf_fusion.integrations.verl.overlap")
    except Exception as exc:  # noqa: BLE001 - verl or its v1 trainer's packages missing
        pytest.skip(f"verl's v1 trainer is not importable here: {type(exc).__name__}: {exc}")


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self.lock:
            self.events.append(event)


class CriticFuture:
    """``DataProtoFuture``: ``get`` waits for the update (the stub's ``release`` event)."""

    def __init__(self, wg: StubCriticWG) -> None:
        self.wg = wg

    def get(self) -> dict:
        if self.wg.hold is not None:
            assert self.wg.hold.wait(WAIT_S), "the Actor's update never started alongside"
        self.wg.rec("critic.end")
        return {"metrics": {"vf_loss": [0.5, 0.25], "mfu": [0.1]}}


class StubCriticWG:
    def __init__(self, rec: Recorder, hold: threading.Event | None) -> None:
        self.rec, self.hold, self.sent = rec, hold, None
        self.started = threading.Event()

    def train_mini_batch(self, batch):  # noqa: ANN001
        self.sent = dict(batch.extra_info)  # what Ray would serialize now
        self.rec("critic.start")
        self.started.set()
        return CriticFuture(self)


class StubActorWG:
    def __init__(self, rec: Recorder, critic: StubCriticWG, overlap: bool) -> None:
        self.rec, self.critic, self.overlap, self.sent = rec, critic, overlap, None

    def update_actor(self, batch):  # noqa: ANN001
        self.sent = dict(batch.extra_info)
        self.rec("actor.start")
        if self.overlap:
            # the Critic's update is in flight: let it finish only now
            assert self.critic.started.wait(WAIT_S)
            time.sleep(0.05)
            self.critic.hold.set()
        self.rec("actor.end")
        return {"metrics": {"pg_loss": [1.0], "mfu": [0.2]}}


CONFIG = {
    "actor_rollout_ref": {
        "rollout": {"temperature": 0.7, "n": 2},
        "actor": {"ppo_mini_batch_size": 4, "calculate_entropy": False, "entropy_coeff": 0.0,
                  "ppo_epochs": 1, "data_loader_seed": 1, "shuffle": False},
    },
    "critic": {"ppo_mini_batch_size": 2, "ppo_epochs": 3, "data_loader_seed": 2,
               "shuffle": True},
    "trainer": {"critic_warmup": 0},
}


def make_trainer(cls, pools: dict, overlap: bool, critic_warmup: int = 0):  # noqa: ANN001
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.utils import Role

    rec = Recorder()
    trainer = cls.__new__(cls)  # no Ray, no GPUs: the stages are stubbed below
    trainer.config = OmegaConf.create(CONFIG)
    trainer.config.trainer.critic_warmup = critic_warmup
    trainer.global_steps, trainer.use_reference_policy, trainer.use_critic = 1, True, True
    trainer.curr_step_profile = False
    trainer._critic_update, trainer._overlap_said = None, False
    trainer.resource_pool_manager = SimpleNamespace(
        mapping={Role.ActorRolloutRef: pools["actor"], Role.Critic: pools["critic"]})
    trainer.critic_wg = StubCriticWG(rec, threading.Event() if overlap else None)
    trainer.actor_rollout_wg = StubActorWG(rec, trainer.critic_wg, overlap)
    batch = KVBatchMeta(partition_id="train", keys=["a", "b"], tags=[{}, {}])
    trainer.replay_buffer = SimpleNamespace(
        sample=lambda **kw: (rec("sample") or batch, {"off_policy": 0.0}))
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=[])
    trainer.checkpoint_manager = SimpleNamespace(sleep_replicas=lambda: rec("sleep_replicas"))

    def stage(name):  # noqa: ANN001, ANN202
        return lambda batch, metrics: rec(name) or batch

    for name in ("_balance_batch", "_compute_old_log_prob", "_compute_ref_log_prob",
                 "_compute_values", "_compute_advantage"):
        setattr(trainer, name, stage(name))
    return trainer, rec, batch


def run_step(trainer):  # noqa: ANN001
    metrics, timing = {}, {}
    out = trainer._step_once(metrics, timing, sample_batch_size=2)
    return out, metrics, timing


STAGES = ["sample", "sleep_replicas", "_balance_batch", "_compute_old_log_prob",
          "_compute_ref_log_prob", "_compute_values", "_compute_advantage"]


def stock_step(overlap_mod, critic_warmup: int = 0):  # noqa: ANN001
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer, rec, _ = make_trainer(PPOTrainerSync, {"actor": "global_pool", "critic": "global_pool"},
                                   overlap=False, critic_warmup=critic_warmup)
    out, metrics, _ = run_step(trainer)
    return trainer, rec, out, metrics


def test_modes_registered():
    overlap = _v1()
    from verl.trainer.ppo.v1 import get_trainer_cls

    from rlhf_fusion.integrations.verl.plugins import activate

    activate({"overlap"})
    for name, cls in overlap.MODES.items():
        assert get_trainer_cls(name) is cls
    assert issubclass(get_trainer_cls("rlhf_fusion_separate_async"),
                      importlib.import_module("verl.trainer.ppo.v1").PPOTrainerSeparateAsync)


def test_separate_pools_overlap_with_stock_payloads():
    overlap = _v1()
    trainer, rec, batch = make_trainer(overlap.PPOTrainerSyncOverlap,
                                       {"actor": "global_pool", "critic": "critic_pool"},
                                       overlap=True)
    assert trainer.overlap_blocker() is None
    out, metrics, timing = run_step(trainer)
    ev = rec.events
    assert ev[:len(STAGES)] == STAGES
    # the Actor's update started before the Critic's finished, and the step waited for both
    assert set(ev[len(STAGES):]) == {"critic.start", "critic.end", "actor.start", "actor.end"}
    assert ev.index("actor.start") < ev.index("critic.end")
    assert ev.index("critic.start") < ev.index("actor.end")
    assert trainer._critic_update is None
    stock, stock_rec, stock_out, stock_metrics = stock_step(overlap)
    assert stock_rec.events[len(STAGES):] == ["critic.start", "critic.end", "actor.start",
                                              "actor.end"]
    # what each update was sent, the metrics and the batch's extra_info are verl's
    assert trainer.critic_wg.sent == stock.critic_wg.sent
    assert trainer.actor_rollout_wg.sent == stock.actor_rollout_wg.sent
    assert metrics == stock_metrics and "critic/vf_loss" in metrics and "actor/pg_loss" in metrics
    assert out.extra_info == stock_out.extra_info
    assert {"update_critic", "update_actor"} <= set(timing)


def test_shared_pool_runs_one_after_the_other(caplog):
    overlap = _v1()
    trainer, rec, _ = make_trainer(overlap.PPOTrainerSyncOverlap,
                                   {"actor": "global_pool", "critic": "global_pool"},
                                   overlap=False)
    assert "share resource pool 'global_pool'" in trainer.overlap_blocker()
    with caplog.at_level("WARNING", logger="rlhf_fusion.verl"):
        out, metrics, _ = run_step(trainer)
        run_step(trainer)
    said = [r.getMessage() for r in caplog.records if "one after the other" in r.getMessage()]
    assert len(said) == 1 and "critic_pool.n_gpus_per_node" in said[0]
    assert rec.events[len(STAGES):len(STAGES) + 4] == ["critic.start", "critic.end",
                                                       "actor.start", "actor.end"]
    _, _, stock_out, stock_metrics = stock_step(overlap)
    assert metrics == stock_metrics and out.extra_info == stock_out.extra_info


def test_critic_warmup_waits_for_the_critic_in_the_step():
    """critic_warmup > global_steps: no Actor update, the step still returns after the
    Critic's update, with its metrics and extra_info as verl's."""
    overlap = _v1()
    trainer, rec, _ = make_trainer(overlap.PPOTrainerSyncOverlap,
                                   {"actor": "global_pool", "critic": "critic_pool"},
                                   overlap=False, critic_warmup=5)
    out, metrics, _ = run_step(trainer)
    assert rec.events[len(STAGES):] == ["critic.start", "critic.end"]
    _, _, stock_out, stock_metrics = stock_step(overlap, critic_warmup=5)
    assert metrics == stock_metrics and out.extra_info == stock_out.extra_info


def test_critic_error_surfaces_on_the_step():
    overlap = _v1()
    trainer, _, _ = make_trainer(overlap.PPOTrainerSyncOverlap,
                                 {"actor": "global_pool", "critic": "critic_pool"},
                                 overlap=False)

    def broken(batch):  # noqa: ANN001
        raise RuntimeError("critic worker died")

    trainer.critic_wg.train_mini_batch = broken
    with pytest.raises(RuntimeError, match="critic worker died"):
        run_step(trainer)
    assert trainer._critic_update is None


def _verl_config(*overrides: str):
    """verl's own ppo_trainer.yaml, composed as main_ppo composes it."""
    import os

    import verl.trainer.config
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(os.path.dirname(verl.trainer.config.__file__)),
                              "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def test_critic_pool_from_hydra():
    """+rlhf_fusion.critic_pool.n_gpus_per_node gives the Critic a pool of its own (and the
    mode overlaps); without it verl's placement is unchanged (and the mode says why not)."""
    overlap = _v1()
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    def placed(cls, *overrides):  # noqa: ANN001, ANN202
        trainer = cls.__new__(cls)
        trainer.config = _verl_config("algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=4",
                                      *overrides)
        trainer._init_resource_pool_mgr()
        trainer.use_critic = True
        return trainer, trainer.resource_pool_manager

    trainer, manager = placed(overlap.PPOTrainerSyncOverlap,
                              "+rlhf_fusion.critic_pool.n_gpus_per_node=2")
    assert manager.resource_pool_spec == {"global_pool": [4], "critic_pool": [2]}
    assert manager.mapping[Role.Critic] == "critic_pool"
    assert manager.mapping[Role.ActorRollout] == "global_pool"
    assert trainer.overlap_blocker() is None
    trainer, manager = placed(overlap.PPOTrainerSyncOverlap)
    _, stock = placed(PPOTrainerSync)
    assert (manager.resource_pool_spec, manager.mapping) == (stock.resource_pool_spec,
                                                             stock.mapping)
    assert "share resource pool 'global_pool'" in trainer.overlap_blocker()


def test_hydra_key_installs_gae_in_the_trainer_process():
    """+rlhf_fusion.gae=true: the mode installs the GAE plugin where verl computes advantages."""
    overlap = _v1()
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos

    from rlhf_fusion.integrations.verl import gae_plugin, plugins

    class Base:
        def __init__(self, config):  # noqa: ANN001
            self.config = config

    class Mode(overlap.OverlapUpdatesMixin, Base):
        pass

    stock = core_algos.compute_gae_advantage_return
    try:
        Mode(OmegaConf.create({"rlhf_fusion": {"gae": False}}))
        assert core_algos.compute_gae_advantage_return is stock
        Mode(OmegaConf.create({"rlhf_fusion": {"gae": True}}))
        assert core_algos.compute_gae_advantage_return is \
            gae_plugin.fused_compute_gae_advantage_return
        assert "gae" in plugins.active_plugins()
    finally:
        plugins.uninstall_gae()
    assert core_algos.compute_gae_advantage_return is stock
