"""Which verl plugins are on: the environment variable and the Hydra key, parsed without torch,
Ray or verl (the entry point runs inside ``import verl`` in every process)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import RLHFFusionError

__all__ = ["ENV_VAR", "PLUGINS", "HYDRA_KEY", "VerlPluginError", "parse_plugins", "plugins_from_env",
           "plugins_from_config", "SETTINGS"]

ENV_VAR = "RLHF_FUSION_VERL"
HYDRA_KEY = "rlhf_fusion"  # +rlhf_fusion.gae=true on main_ppo's command line
PLUGINS = ("gae", "overlap")
# keys under rlhf_fusion that configure a trainer mode rather than turn a plugin on
SETTINGS = ("critic_pool", "tail")
_OFF = ("", "0", "none", "off", "false")


class VerlPluginError(RLHFFusionError, RuntimeError):
    """A plugin asked for that this verl cannot take: an unknown name, an unsupported version, or
    a seam (function, signature, call site) that moved. The message names verl's version."""


def parse_plugins(text: str) -> frozenset[str]:
    """``"gae,overlap"`` -> ``{"gae", "overlap"}``; ``""``/``"0"``/``"none"`` -> nothing;
    ``"all"``/``"1"`` -> every plugin. Unknown names raise (a typo must not run stock silently)."""
    text = text.strip().lower()
    if text in _OFF:
        return frozenset()
    if text in ("1", "all", "true", "on"):
        return frozenset(PLUGINS)
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(PLUGINS))
    if unknown:
        raise VerlPluginError(
            f"{ENV_VAR}={text!r}: unknown plugin(s) {unknown}; the plugins are {list(PLUGINS)} "
            f"(comma separated), 'all', or '' for none")
    return names


def plugins_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The plugins ``RLHF_FUSION_VERL`` turns on in this process."""
    return parse_plugins((os.environ if environ is None else environ).get(ENV_VAR, ""))


def plugins_from_config(config: Any) -> frozenset[str]:
    """The plugins a verl (OmegaConf) config turns on under ``rlhf_fusion``: ``gae: true`` and
    ``overlap: true`` (``+rlhf_fusion.gae=true`` on the command line). Missing key: none."""
    section = config.get(HYDRA_KEY) if hasattr(config, "get") else None
    if section is None:
        return frozenset()
    keys: Iterable[str] = section.keys() if hasattr(section, "keys") else ()
    unknown = sorted(set(keys) - set(PLUGINS) - set(SETTINGS))
    if unknown:
        raise VerlPluginError(
            f"{HYDRA_KEY}.{unknown[0]} is not a plugin or setting; the keys under {HYDRA_KEY} "
            f"are {list(PLUGINS)} (true/false) and {list(SETTINGS)}")
    return frozenset(name for name in PLUGINS if bool(section.get(name, False)))
