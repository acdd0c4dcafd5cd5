"""The verl versions and seams the plugins use, checked before anything is patched.

verl 0.9.1 is the version read and tested. Each plugin checks the exact seam it replaces (the
function's signature, the call site that reads it as a module attribute, the trainer methods it
reorders), so a verl that moved one fails here with its version, not with a wrong result.
"""

from __future__ import annotations

import inspect
from typing import Any

from .._versions import check_supported, installed, supported_text
from .options import VerlPluginError

__all__ = ["SUPPORTED_TEXT", "check_gae_call_site", "check_gae_seam", "check_overlap_seam", "check_tail_seam",
           "check_version", "installed_version"]

SUPPORTED = (">=0.9.1", "<0.10")
SUPPORTED_TEXT = supported_text("verl", SUPPORTED)
GAE_PARAMS = ["token_level_rewards", "values", "response_mask", "gamma", "lam"]


def installed_version() -> str:
    return installed("verl", SUPPORTED, VerlPluginError)


def check_version(version: str | None = None) -> str:
    """The installed (or given) verl version if supported, else a VerlPluginError."""
    return check_supported(
        "verl", installed_version() if version is None else version, SUPPORTED,
        VerlPluginError, "install verl==0.9.1 or unset RLHF_FUSION_VERL to run verl stock")


def _moved(version: str, what: str) -> VerlPluginError:
    return VerlPluginError(
        f"verl {version}: {what}; rlhf_fusion's verl plugins were written against verl 0.9.1 "
        f"({SUPPORTED_TEXT}). Unset RLHF_FUSION_VERL (and drop +rlhf_fusion.*) to run verl stock")


def check_gae_seam(core_algos: Any, version: str) -> None:
    """``core_algos.compute_gae_advantage_return(token_level_rewards, values, response_mask,
    gamma, lam)`` exists. Where it is called is :func:`check_gae_call_site`'s, run when
    ``ray_trainer`` is imported: importing it from here, inside core_algos' own import, is
    circular in a real job (the v1 trainer reaches core_algos through
    ``verl.trainer.distillation.losses``, which ``ray_trainer`` imports back)."""
    fn = getattr(core_algos, "compute_gae_advantage_return", None)
    if fn is None:
        raise _moved(version, "verl.trainer.ppo.core_algos has no compute_gae_advantage_return")
    params = list(inspect.signature(fn).parameters)
    if params != GAE_PARAMS:
        raise _moved(version, f"compute_gae_advantage_return{tuple(params)} is not "
                              f"compute_gae_advantage_return{tuple(GAE_PARAMS)}")


def check_gae_call_site(ray_trainer: Any, version: str) -> None:
    """Both trainers reach GAE through the module attribute: the legacy
    ``ray_trainer.compute_advantage`` calls ``core_algos.compute_gae_advantage_return(...)`` and
    the v1 trainer's ``compute_advantage_for_multi_trajectories`` delegates GAE to it."""
    src = inspect.getsource(ray_trainer.compute_advantage)
    if "core_algos.compute_gae_advantage_return(" not in src:
        raise _moved(version, "ray_trainer.compute_advantage no longer calls "
                              "core_algos.compute_gae_advantage_return (the patched attribute)")
    if getattr(ray_trainer, "compute_gae_advantage_return", None) is not None:
        raise _moved(version, "ray_trainer imports compute_gae_advantage_return by name, so "
                              "patching core_algos would not reach it")


def check_overlap_seam(trainer_base: Any, version: str) -> None:
    """v1 ``PPOTrainer._step_once`` updates the Critic (``_update_critic``, which dispatches
    ``critic_wg.train_mini_batch`` without blocking and then waits) before the Actor
    (``_update_actor``), and ``register_trainer`` exists."""
    for name in ("PPOTrainer", "register_trainer", "TRAINER_REGISTRY"):
        if not hasattr(trainer_base, name):
            raise _moved(version, f"verl.trainer.ppo.v1.trainer_base has no {name}")
    cls = trainer_base.PPOTrainer
    step = inspect.getsource(cls._step_once)
    i_critic, i_actor = step.find("self._update_critic("), step.find("self._update_actor(")
    if i_critic < 0 or i_actor < 0 or i_critic > i_actor:
        raise _moved(version, "PPOTrainer._step_once no longer calls _update_critic and then "
                              "_update_actor")
    update = inspect.getsource(cls._update_critic)
    if "self.critic_wg.train_mini_batch(" not in update or ".get()" not in update:
        raise _moved(version, "PPOTrainer._update_critic no longer dispatches "
                              "critic_wg.train_mini_batch and waits on its future")


def check_tail_seam(version: str) -> None:
    """What tail consolidation relies on in verl's rollout routing: the balancer factory builds
    a ``load_balancer_cls`` with ``servers`` and ``max_cache_size``; the client asks the
    balancer which fields to forward, draws the vLLM id with ``_vllm_request_id`` after acquiring
    a replica; the resuming client sends an aborted request again as prompt + generated tokens
    with the remaining budget."""
    import verl.workers.rollout.llm_server as llm_server
    import verl.workers.rollout.router as router

    checks = [
        (router._create_global_sticky_inflight,
         "kwargs = dict(servers=servers, max_cache_size=DEFAULT_ROUTING_CACHE_SIZE)",
         "router._create_global_sticky_inflight no longer builds the balancer from servers and "
         "max_cache_size"),
        (llm_server.LLMServerClient._acquire_server, "self._lb_require_acquire_fields",
         "LLMServerClient._acquire_server no longer forwards the balancer's acquire fields"),
        (llm_server.LLMServerClient.generate, "request_id=self._vllm_request_id(request_id)",
         "LLMServerClient.generate no longer draws the vLLM id with _vllm_request_id"),
        (llm_server.FullyAsyncLLMServerClient.generate,
         "prompt_ids=prompt_ids + final_output.token_ids",
         "FullyAsyncLLMServerClient.generate no longer resubmits prompt + generated tokens"),
        (llm_server.FullyAsyncLLMServerClient.generate,
         "original_max_tokens - len(final_output.token_ids)",
         "FullyAsyncLLMServerClient.generate no longer passes the remaining budget"),
    ]
    for fn, needle, what in checks:
        if needle not in inspect.getsource(fn):
            raise _moved(version, what)
    src = inspect.getsource(llm_server.LLMServerClient.generate)
    if src.find("self._acquire_server(") > src.find("self._vllm_request_id(request_id)"):
        raise _moved(version, "LLMServerClient.generate draws the vLLM id before acquiring")
