"""Installing the plugins into OpenRLHF's classes, in the driver and in every Ray worker.

The trainers are ``@ray.remote`` classes, so a patch made in the driver alone does not reach
them: ``hook.setup_worker`` calls ``install_plugins(lazy=True)`` in each worker at start (Ray's
``worker_process_setup_hook``). Lazily, each OpenRLHF module is patched when the worker itself
imports it, and never imported by us: a vLLM engine worker then loads neither DeepSpeed nor
``openrlhf.models``. Installing is idempotent and recorded (``installed_plugins``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

from .options import FusionOptions
from .plugin_state import STOCK, current_options, set_options

__all__ = ["current_options", "install_plugins", "installed_plugins", "uninstall_plugins"]

EM = "openrlhf.trainer.ppo_utils.experience_maker"
SG = "openrlhf.trainer.ppo_utils.samples_generator"
VE = "openrlhf.trainer.ray.vllm_engine"
PT = "openrlhf.trainer.ppo_trainer"

# the modules each plugin patches
PLUGIN_MODULES: dict[str, tuple[str, ...]] = {
    "gae": (EM,),
    "stream": (SG, VE, PT),
    "stream_scoring": (EM, PT),
}

_APPLIED: set[tuple[str, str]] = set()  # (plugin, module) patched
_REQUESTED: set[str] = set()


def installed_plugins() -> list[str]:
    """The plugins requested whose every module is patched (plus ``migrate``, which rides on
    ``stream``)."""
    done = [p for p in sorted(_REQUESTED)
            if p in PLUGIN_MODULES and all((p, m) in _APPLIED for m in PLUGIN_MODULES[p])]
    if "migrate" in _REQUESTED and "stream" in done:
        done.append("migrate")
    return sorted(done)


def _requested(options: FusionOptions) -> set[str]:
    names = {name for name, on in (("gae", options.gae), ("stream", options.stream),
                                   ("stream_scoring", options.stream_scoring),
                                   ("migrate", options.migrate)) if on}
    return names


def _patch(module_name: str, module: Any) -> None:
    """Apply every requested plugin's patch of this (just imported) module."""
    for plugin in sorted(_REQUESTED):
        if module_name not in PLUGIN_MODULES.get(plugin, ()) or (plugin, module_name) in _APPLIED:
            continue
        stock = STOCK.setdefault(plugin, {})
        if plugin == "gae":
            from .gae_plugin import fused_get_advantages_and_returns

            maker = module.RemoteExperienceMaker
            stock["get_advantages_and_returns"] = maker.get_advantages_and_returns
            maker.get_advantages_and_returns = fused_get_advantages_and_returns
        elif plugin == "stream" and module_name == SG:
            from .streaming import fusion_generate_vllm

            stock["_generate_vllm"] = module.SamplesGenerator._generate_vllm
            module.SamplesGenerator._generate_vllm = fusion_generate_vllm
        elif plugin == "stream" and module_name == VE:
            from .engine import make_fusion_rollout_actor

            # create_vllm_engines looks the class up in its module when the driver builds engines
            stock["RolloutRayActor"] = module.RolloutRayActor
            module.RolloutRayActor = make_fusion_rollout_actor(module.RolloutRayActor)
        elif plugin == "stream" and module_name == PT:
            from .streaming import fusion_train_step

            stock["train_step"] = module.BasePPOTrainer.train_step
            module.BasePPOTrainer.train_step = fusion_train_step
        elif plugin == "stream_scoring" and module_name == EM:
            from . import scoring

            maker = module.RemoteExperienceMaker
            for name in ("make_experience_batch", "split_rollout_samples", "_dispatch_forward"):
                stock[name] = getattr(maker, name)
            maker.make_experience_batch = scoring.fusion_make_experience_batch
            maker.split_rollout_samples = scoring.fusion_split_rollout_samples
            maker._dispatch_forward = scoring.fusion_dispatch_forward
        elif plugin == "stream_scoring" and module_name == PT:
            from . import scoring

            # PPOTrainer builds its generator, then BasePPOTrainer.__init__ its experience maker
            stock["__init__"] = module.BasePPOTrainer.__init__
            module.BasePPOTrainer.__init__ = scoring.fusion_trainer_init
        _APPLIED.add((plugin, module_name))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module right after its first import, without importing it ourselves."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _wanted_modules():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any, _run: Callable[[Any], None] = run) -> None:
            _run(module)
            _patch(name, module)

        loader.exec_module = exec_module  # this spec's own loader instance
        return spec


_FINDER = _PatchOnImport()


def _wanted_modules() -> set[str]:
    return {m for p in _REQUESTED for m in PLUGIN_MODULES.get(p, ())
            if (p, m) not in _APPLIED}


def install_plugins(options: FusionOptions, *, check: bool = True,
                    lazy: bool = False) -> list[str]:
    """Patch OpenRLHF for ``options``; returns the plugins now installed.

    ``check`` runs the version and seam checks first (``compat.check_seams``). ``lazy`` patches
    only the modules already imported and the rest when they are (Ray workers: nothing is
    imported that the worker would not import itself).
    """
    if options.pipeline:
        raise NotImplementedError(
            "--fusion.pipeline: the fused Actor/Critic pipeline is not wired into OpenRLHF's "
            "DeepSpeed actor and critic groups yet; drop the flag (the other --fusion plugins "
            "work without it)")
    if check:
        from .compat import check_seams

        check_seams(gae=options.gae, stream=options.stream, scoring=options.stream_scoring)
    set_options(options)
    _REQUESTED.update(_requested(options))
    for module_name in sorted(_wanted_modules()):
        module = sys.modules.get(module_name)
        if module is None and not lazy:
            module = importlib.import_module(module_name)  # patched by the finder on import
        if module is not None:
            _patch(module_name, module)
    if _wanted_modules() and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return installed_plugins()


def uninstall_plugins() -> None:
    """Undo ``install_plugins`` (tests)."""
    where = {"get_advantages_and_returns": (EM, "RemoteExperienceMaker"),
             "make_experience_batch": (EM, "RemoteExperienceMaker"),
             "split_rollout_samples": (EM, "RemoteExperienceMaker"),
             "_dispatch_forward": (EM, "RemoteExperienceMaker"),
             "_generate_vllm": (SG, "SamplesGenerator"),
             "train_step": (PT, "BasePPOTrainer"),
             "__init__": (PT, "BasePPOTrainer"),
             "RolloutRayActor": (VE, None)}
    for stock in STOCK.values():
        for name, obj in stock.items():
            module_name, owner = where[name]
            module = sys.modules[module_name]
            setattr(module if owner is None else getattr(module, owner), name, obj)
    STOCK.clear()
    _APPLIED.clear()
    _REQUESTED.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    set_options(None)
