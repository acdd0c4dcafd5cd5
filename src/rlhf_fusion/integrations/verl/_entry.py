"""verl's ``verl.plugins`` entry point: imported by ``import verl`` in every process verl runs
(the driver, the task runner, every worker group and rollout server; verl/__init__.py).

With ``RLHF_FUSION_VERL`` unset or empty this does nothing at all. Otherwise it turns the named
plugins on (:func:`rlhf_fusion.integrations.verl.plugins.activate`), which logs one line.

verl loads entry points under ``except Exception`` and logs a failure at DEBUG, which nobody
sees; a plugin that was asked for and cannot install must stop the run instead, so the failure
is logged at ERROR and raised as :class:`VerlPluginLoadError`, a BaseException that verl's
``except Exception`` lets through.
"""

from __future__ import annotations

import logging

from .options import VerlPluginError, plugins_from_env

__all__ = ["VerlPluginLoadError"]


class VerlPluginLoadError(BaseException):
    """RLHF_FUSION_VERL asked for a plugin this process cannot install (the message says why
    and names verl's version).

    A :class:`BaseException`, outside ``RLHFFusionError`` on purpose: verl imports its plugins
    under ``except Exception``, which would swallow the failure and run stock verl."""


def _load() -> None:
    try:
        plugins = plugins_from_env()
        if plugins:
            from .plugins import activate

            activate(plugins)
    except VerlPluginError as exc:
        logging.getLogger("rlhf_fusion.verl").error(f"rlhf_fusion: {exc}")
        raise VerlPluginLoadError(str(exc)) from exc


_load()
