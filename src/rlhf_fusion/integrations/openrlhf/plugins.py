"""Installing the plugins into OpenRLHF's classes, in the driver and in every Ray worker.

The trainers are ``@ray.remote`` classes, so a patch made in the driver alone does not reach
them: ``hook.setup_worker`` calls ``install_plugins`` in each worker at start (Ray's
``worker_process_setup_hook``). Installing is idempotent and recorded, so a worker can be asked
which plugins it runs (``installed_plugins``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .options import FusionOptions

__all__ = ["current_options", "install_plugins", "installed_plugins"]

_INSTALLED: dict[str, Any] = {}  # plugin name -> the stock object it replaced
_OPTIONS: FusionOptions | None = None


def current_options() -> FusionOptions | None:
    return _OPTIONS


def installed_plugins() -> list[str]:
    return sorted(_INSTALLED)


def install_plugins(options: FusionOptions, *, check: bool = True) -> list[str]:
    """Patch OpenRLHF for ``options``; returns the plugins now installed.

    ``check`` runs the version and seam checks first (``compat.check_seams``).
    """
    global _OPTIONS
    if options.pipeline:
        raise NotImplementedError(
            "--fusion.pipeline: the fused Actor/Critic pipeline is not wired into OpenRLHF's "
            "DeepSpeed actor and critic groups yet; drop the flag (the other --fusion plugins "
            "work without it)")
    if check:
        from .compat import check_seams

        check_seams(gae=options.gae, stream=options.stream, scoring=options.stream_scoring)
    _OPTIONS = options
    if options.gae and "gae" not in _INSTALLED:
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        from .gae_plugin import fused_get_advantages_and_returns

        _INSTALLED["gae"] = em.RemoteExperienceMaker.get_advantages_and_returns
        em.RemoteExperienceMaker.get_advantages_and_returns = fused_get_advantages_and_returns
    if options.stream and "stream" not in _INSTALLED:
        sg = importlib.import_module("openrlhf.trainer.ppo_utils.samples_generator")
        ve = importlib.import_module("openrlhf.trainer.ray.vllm_engine")
        from .engine import make_fusion_rollout_actor
        from .streaming import fusion_generate_vllm

        _INSTALLED["stream"] = (sg.SamplesGenerator._generate_vllm, ve.RolloutRayActor)
        sg.SamplesGenerator._generate_vllm = fusion_generate_vllm
        # create_vllm_engines looks the class up in its module when the driver builds engines
        ve.RolloutRayActor = make_fusion_rollout_actor(ve.RolloutRayActor)
    if options.stream_scoring and "stream_scoring" not in _INSTALLED:
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        pt = importlib.import_module("openrlhf.trainer.ppo_trainer")
        from . import scoring

        maker = em.RemoteExperienceMaker
        _INSTALLED["stream_scoring"] = {
            "make_experience_batch": maker.make_experience_batch,
            "split_rollout_samples": maker.split_rollout_samples,
            "_dispatch_forward": maker._dispatch_forward,
            "__init__": pt.BasePPOTrainer.__init__,
        }
        maker.make_experience_batch = scoring.fusion_make_experience_batch
        maker.split_rollout_samples = scoring.fusion_split_rollout_samples
        maker._dispatch_forward = scoring.fusion_dispatch_forward
        # PPOTrainer builds its generator, then BasePPOTrainer.__init__ its experience maker
        pt.BasePPOTrainer.__init__ = scoring.fusion_trainer_init
    if options.migrate:
        _INSTALLED.setdefault("migrate", None)
    return installed_plugins()


def uninstall_plugins() -> None:
    """Undo ``install_plugins`` (tests)."""
    global _OPTIONS
    if "gae" in _INSTALLED:
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        em.RemoteExperienceMaker.get_advantages_and_returns = _INSTALLED.pop("gae")
    if "stream" in _INSTALLED:
        sg = importlib.import_module("openrlhf.trainer.ppo_utils.samples_generator")
        ve = importlib.import_module("openrlhf.trainer.ray.vllm_engine")
        sg.SamplesGenerator._generate_vllm, ve.RolloutRayActor = _INSTALLED.pop("stream")
    if "stream_scoring" in _INSTALLED:
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        pt = importlib.import_module("openrlhf.trainer.ppo_trainer")
        stock = _INSTALLED.pop("stream_scoring")
        pt.BasePPOTrainer.__init__ = stock.pop("__init__")
        for name, fn in stock.items():
            setattr(em.RemoteExperienceMaker, name, fn)
    _INSTALLED.pop("migrate", None)
    _OPTIONS = None
