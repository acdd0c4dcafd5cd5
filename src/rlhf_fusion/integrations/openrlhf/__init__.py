"""OpenRLHF integration (extra ``[openrlhf]``, openrlhf 0.11.2 - 0.11.x).

``rlhf-fusion openrlhf [train_ppo_ray flags] [--fusion.* flags]`` runs OpenRLHF's stock Ray PPO
with rlhf-fusion's plugins installed in every Ray worker. Guide: ``docs/openrlhf.md``. Importing
this package imports neither torch, Ray nor OpenRLHF.
"""

from __future__ import annotations

from typing import Any

from .options import ENV_VAR, FUSION_FLAGS, FusionFlagError, FusionOptions, split_argv

__all__ = [
    "ENV_VAR",
    "FUSION_FLAGS",
    "FusionFlagError",
    "FusionOptions",
    "OpenRLHFVersionError",
    "check_seams",
    "check_version",
    "install_plugins",
    "installed_plugins",
    "main",
    "ray_runtime_env",
    "run",
    "split_argv",
]

_LAZY = {
    "OpenRLHFVersionError": "compat", "check_seams": "compat", "check_version": "compat",
    "install_plugins": "plugins", "installed_plugins": "plugins",
    "main": "launch", "ray_runtime_env": "launch", "run": "launch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
