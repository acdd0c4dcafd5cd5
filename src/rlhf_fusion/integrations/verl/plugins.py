"""Installing the verl plugins in this process: what the entry point, the trainer modes and the
tests call. Everything here imports verl only when a plugin is on."""

from __future__ import annotations

import logging
import os
from types import ModuleType

from .compat import check_gae_seam, check_overlap_seam, check_version
from .hooks import after_import
from .options import PLUGINS, VerlPluginError

__all__ = ["active_plugins", "activate", "install_gae", "uninstall_gae"]

LOG = logging.getLogger("rlhf_fusion.verl")
CORE_ALGOS = "verl.trainer.ppo.core_algos"
V1 = "verl.trainer.ppo.v1"
_ACTIVE: set[str] = set()  # plugins activated in this process (patched or waiting for import)
_PATCHED: set[str] = set()  # plugins whose seam is patched now


def active_plugins() -> frozenset[str]:
    """The plugins patched in this process (``"gae"`` once core_algos is imported and patched,
    ``"overlap"`` once the trainer modes are registered)."""
    return frozenset(_PATCHED)


def _patch_gae(core_algos: ModuleType) -> None:
    from . import gae_plugin

    if "gae" in _PATCHED:
        return
    check_gae_seam(core_algos, check_version())
    stock = core_algos.compute_gae_advantage_return
    gae_plugin._STOCK["compute_gae_advantage_return"] = stock
    core_algos.compute_gae_advantage_return = gae_plugin.fused_compute_gae_advantage_return
    # the registry's "gae" entry too, so get_adv_estimator_fn("gae") agrees with the attribute
    registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {})
    if registry.get("gae") is stock:
        registry["gae"] = gae_plugin.fused_compute_gae_advantage_return
    _PATCHED.add("gae")


def install_gae() -> None:
    """Patch ``core_algos.compute_gae_advantage_return`` now (importing core_algos)."""
    import importlib

    _ACTIVE.add("gae")
    _patch_gae(importlib.import_module(CORE_ALGOS))


def uninstall_gae() -> None:
    """Put verl's own GAE back (tests; a process that turned the plugin on and off)."""
    import sys

    from . import gae_plugin

    _ACTIVE.discard("gae")
    core_algos = sys.modules.get(CORE_ALGOS)
    stock = gae_plugin._STOCK.pop("compute_gae_advantage_return", None)
    if core_algos is not None and stock is not None:
        fused = core_algos.compute_gae_advantage_return
        core_algos.compute_gae_advantage_return = stock
        registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {})
        if registry.get("gae") is fused:
            registry["gae"] = stock
    _PATCHED.discard("gae")


def _register_overlap(v1: ModuleType) -> None:
    from verl.trainer.ppo.v1 import trainer_base

    check_overlap_seam(trainer_base, check_version())
    from . import overlap

    overlap.register_modes()
    _PATCHED.add("overlap")


def activate(plugins: frozenset[str] | set[str], *, where: str = "RLHF_FUSION_VERL") -> None:
    """Turn ``plugins`` on in this process: each patches its seam as soon as verl's module holding
    it is imported (now, if it already is). Logs one line. Raises VerlPluginError (naming verl's
    version) for an unsupported verl; a seam that moved fails the import of its module."""
    new = set(plugins) - _ACTIVE
    if not new:
        return
    unknown = sorted(new - set(PLUGINS))
    if unknown:
        raise VerlPluginError(f"unknown verl plugin(s) {unknown}; the plugins are {list(PLUGINS)}")
    version = check_version()
    _ACTIVE.update(new)
    if "gae" in new:
        after_import(CORE_ALGOS, _patch_gae)
    if "overlap" in new:
        after_import(V1, _register_overlap)
    # WARNING: verl sets the root logger to WARNING in every process; this line must show there
    LOG.warning(f"rlhf_fusion: verl plugins {','.join(sorted(_ACTIVE))} on in pid {os.getpid()} "
                f"(verl {version}, from {where})")
