"""Installing the verl plugins in this process: what the entry point, the trainer modes and the
tests call. Everything here imports verl only when a plugin is on."""

from __future__ import annotations

import logging
import os
from types import ModuleType

from .compat import check_overlap_seam, check_version
from .hooks import after_import
from .options import PLUGINS, VerlPluginError
from .state import PATCHED

__all__ = ["active_plugins", "activate", "install_gae", "uninstall_gae"]

LOG = logging.getLogger("rlhf_fusion.verl")
CORE_ALGOS = "verl.trainer.ppo.core_algos"
V1 = "verl.trainer.ppo.v1"
_ACTIVE: set[str] = set()  # plugins activated in this process (patched or waiting for import)


def active_plugins() -> frozenset[str]:
    """The plugins patched in this process (``"gae"`` once core_algos is imported and patched,
    ``"overlap"`` once the trainer modes are registered)."""
    return frozenset(PATCHED)


def _patch_gae(core_algos: ModuleType) -> None:
    from . import gae_plugin

    gae_plugin.install(core_algos)


def install_gae() -> None:
    """Patch ``core_algos.compute_gae_advantage_return`` now (importing core_algos)."""
    import importlib

    _ACTIVE.add("gae")
    _patch_gae(importlib.import_module(CORE_ALGOS))


def uninstall_gae() -> None:
    """Put verl's own GAE back (tests; a process that turned the plugin on and off)."""
    from . import gae_plugin

    _ACTIVE.discard("gae")
    gae_plugin.uninstall()


def _register_overlap(v1: ModuleType) -> None:
    from verl.trainer.ppo.v1 import trainer_base

    check_overlap_seam(trainer_base, check_version())
    from . import overlap

    overlap.register_modes()
    PATCHED.add("overlap")


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
