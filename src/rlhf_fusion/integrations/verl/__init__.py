"""verl integration (extra ``[verl]``, verl 0.9.1 - 0.9.x).

Installing rlhf-fusion registers a ``verl.plugins`` entry point (``_entry``) that verl imports in
every process; it does nothing until a plugin is turned on:

* ``RLHF_FUSION_VERL=gae,overlap`` (or ``all``), which reaches every Ray worker through
  ``+ray_kwargs.ray_init.runtime_env.env_vars.RLHF_FUSION_VERL="'gae,overlap'"`` (quoted: Hydra
  reads a bare comma as a list);
* ``+rlhf_fusion.gae=true`` in verl's Hydra config, read by this package's trainer modes.

``gae``: the blocked GAE in place of ``core_algos.compute_gae_advantage_return``
(:mod:`.gae_plugin`). ``overlap``: trainer modes ``rlhf_fusion_sync`` / ``_colocate_async`` /
``_separate_async`` whose step updates the Critic and Actor concurrently (:mod:`.overlap`) and,
with ``+rlhf_fusion.tail.rt=N``, consolidates the rollout's long tail on fewer replicas
(:mod:`.tail`).
Guide: ``docs/verl.md``. Importing this package imports neither torch, Ray nor verl.
"""

from __future__ import annotations

from typing import Any

from .options import ENV_VAR, HYDRA_KEY, PLUGINS, VerlPluginError, parse_plugins

__all__ = [
    "ENV_VAR",
    "HYDRA_KEY",
    "PLUGINS",
    "VerlPluginError",
    "activate",
    "active_plugins",
    "install_gae",
    "parse_plugins",
    "uninstall_gae",
]

_LAZY = {"activate": "plugins", "active_plugins": "plugins", "install_gae": "plugins",
         "uninstall_gae": "plugins"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
