"""What the installed OpenRLHF plugins share at run time: the options they were installed with
and the stock objects they replaced, which each plugin calls through to and
``uninstall_plugins`` restores. Process-global, as the patches are.

A module of its own so that the plugins (``gae_plugin``, ``streaming``, ``scoring``) and the
checks (``compat``) read it without importing ``plugins``, which imports them to install them.
"""

from __future__ import annotations

from typing import Any

from .options import FusionOptions

__all__ = ["STOCK", "current_options", "set_options", "stock"]

STOCK: dict[str, dict[str, Any]] = {}  # plugin name -> the stock objects it replaced, by name
_options: FusionOptions | None = None


def current_options() -> FusionOptions | None:
    """The options of this process's ``install_plugins``; None when nothing is installed."""
    return _options


def set_options(options: FusionOptions | None) -> None:
    global _options
    _options = options


def stock(plugin: str, name: str) -> Any:
    """The stock object ``plugin`` replaced under ``name``."""
    return STOCK[plugin][name]
