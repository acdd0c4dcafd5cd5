"""An execution plan as verl 0.9.1 configuration: resource pools, the role mapping they imply,
and the Hydra overrides for ``python -m verl.trainer.main_ppo`` (``rlhf-fusion place --verl``).

verl places roles by pool, and a pool is a GPU count per node, not a set of GPUs
(``ResourcePoolManager(resource_pool_spec, mapping)``, verl/single_controller/ray/base.py:185).
Its v1 trainer has these pools (``PPOTrainer._init_resource_pool_mgr``): ``global_pool`` for the
Actor, its rollout and the Ref (and the Critic), ``reward_pool`` for a reward model with
``reward.reward_model.enable_resource_pool``, and, with rlhf-fusion's trainer modes,
``critic_pool`` (``+rlhf_fusion.critic_pool``; docs/verl.md). What of a plan verl cannot express
(a Ref or a generation away from the Actor's training GPUs, meshes that share only part of their
GPUs, tp/pp for training) is returned as a note, not silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .mesh import DeviceMesh
from .plan import ExecutionPlan

__all__ = ["VerlConfig", "verl_config"]


@dataclass
class VerlConfig:
    """``overrides`` for main_ppo's command line, ``pools`` as ``resource_pool_spec`` would read
    them, ``mapping`` role -> pool, and ``notes`` on what verl cannot express."""

    overrides: list[str] = field(default_factory=list)
    pools: dict[str, list[int]] = field(default_factory=dict)
    mapping: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = ["# python -m verl.trainer.main_ppo <your model, data and algorithm keys> \\"]
        lines += [f"    {o} \\" for o in self.overrides]
        lines[-1] = lines[-1].removesuffix(" \\")
        lines += [f"# pools: {self.pools}", f"# roles: {self.mapping}"]
        lines += [f"# note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _pool(mesh: DeviceMesh) -> list[int]:
    return [mesh.n_gpus] * mesh.n_nodes


def _relation(a: DeviceMesh, b: DeviceMesh) -> str:
    if a.rank_set == b.rank_set:
        return "same"
    if a.rank_set.isdisjoint(b.rank_set):
        return "disjoint"
    return "partial"


def verl_config(plan: ExecutionPlan) -> VerlConfig:
    """The verl 0.9.1 (v1 trainer) configuration closest to ``plan``; see the module doc."""
    c = plan.calls
    cfg = VerlConfig()
    actor = c["actor_train"].mesh
    cfg.pools["global_pool"] = _pool(actor)
    cfg.mapping.update(actor="global_pool", rollout="global_pool", ref="global_pool")
    cfg.overrides += [f"trainer.nnodes={actor.n_nodes}", f"trainer.n_gpus_per_node={actor.n_gpus}"]
    gen = c["actor_gen"]
    cfg.overrides.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={gen.strategy.tp}")
    if _relation(gen.mesh, actor) != "same":
        cfg.notes.append(
            f"actor_gen on {gen.mesh} is not the Actor's training GPUs ({actor}): verl's sync and "
            f"colocate_async modes generate on the training GPUs (hybrid engine); a separate "
            f"rollout is trainer.v1.trainer_mode=separate_async with "
            f"actor_rollout_ref.hybrid_engine=false and its own rollout replicas, sized by hand")
    train = c["actor_train"].strategy
    if train.tp > 1 or train.pp > 1:
        cfg.notes.append(f"actor_train {train}: verl's FSDP engine shards over data parallel "
                         f"ranks only; tp/pp need its Megatron engine (set by hand)")
    if _relation(c["ref_inf"].mesh, actor) != "same":
        cfg.notes.append(f"ref_inf on {c['ref_inf'].mesh}: verl 0.9.1 runs the Ref in "
                         f"global_pool with the Actor (trainer_base.py:803-809), so it stays there")
    critic = c["critic_train"].mesh if "critic_train" in c else None
    if critic is not None:   # a critic-free plan (GRPO, RLOO, REINFORCE++) maps no critic
        rel = _relation(critic, actor)
        if rel == "same":
            cfg.mapping["critic"] = "global_pool"
        elif rel == "disjoint":
            cfg.pools["critic_pool"] = _pool(critic)
            cfg.mapping["critic"] = "critic_pool"
            cfg.overrides += [
                "trainer.v1.trainer_mode=rlhf_fusion_sync",
                "+ray_kwargs.ray_init.runtime_env.env_vars.RLHF_FUSION_VERL=overlap",
                f"+rlhf_fusion.critic_pool.n_gpus_per_node={critic.n_gpus}",
                f"+rlhf_fusion.critic_pool.nnodes={critic.n_nodes}"]
        else:
            cfg.mapping["critic"] = "global_pool"
            cfg.notes.append(f"critic_train on {critic} shares only part of the Actor's GPUs: "
                             f"verl pools are disjoint, so the Critic stays in global_pool")
        if _relation(c["critic_inf"].mesh, critic) != "same":
            cfg.notes.append(f"critic_inf on {c['critic_inf'].mesh}: verl computes values on "
                             f"the Critic's training workers, so it runs on {critic}")
    reward = c["reward_inf"].mesh if "reward_inf" in c else None
    if reward is not None:   # without a reward model (a rule reward) verl maps none
        rel = _relation(reward, actor)
        own_critic = critic is not None and cfg.mapping["critic"] == "critic_pool"
        if rel == "disjoint" and (not own_critic or _relation(reward, critic) == "disjoint"):
            cfg.pools["reward_pool"] = _pool(reward)
            cfg.mapping["reward"] = "reward_pool"
            cfg.overrides += ["reward.reward_model.enable_resource_pool=true",
                              f"reward.reward_model.n_gpus_per_node={reward.n_gpus}",
                              f"reward.reward_model.nnodes={reward.n_nodes}"]
        else:
            cfg.mapping["reward"] = "global_pool"
            if rel != "same":
                cfg.notes.append(f"reward_inf on {reward}: verl 0.9.1 puts a reward model in "
                                 f"global_pool or a reward_pool of its own GPUs, so with this "
                                 f"plan it stays in global_pool")
    groups = {m.group for m in (actor, critic, reward) if m is not None}
    if len(groups) > 1:
        cfg.notes.append(f"the plan uses device groups {sorted(groups)}: a verl pool is a GPU "
                         f"count, so Ray must be told which nodes hold which GPUs (node labels)")
    if plan.offload:
        cfg.notes.append(f"offload {list(plan.offload)}: set the roles' param_offload by hand")
    return cfg
