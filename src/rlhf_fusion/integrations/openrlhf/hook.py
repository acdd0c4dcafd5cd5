"""Ray's ``worker_process_setup_hook``: the plugins in every worker of the job."""

from __future__ import annotations

import logging
import os
import sys

from .options import FusionOptions

__all__ = ["HOOK", "setup_worker"]

HOOK = f"{__name__}.setup_worker"

_ANNOUNCED: list[str] = []  # the line this worker logged (once)


def _logger() -> logging.Logger:
    log = logging.getLogger("rlhf_fusion.openrlhf")
    if not log.handlers:  # Ray forwards a worker's stderr to the driver
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def setup_worker() -> None:
    """Install the plugins the driver's options (``RLHF_FUSION_OPENRLHF``) ask for, lazily:
    each OpenRLHF module is patched when this worker imports it (a vLLM engine worker never
    imports the trainer's, so it loads neither DeepSpeed nor ``openrlhf.models``). Announces them
    in one log line per worker.

    A failure is raised, not logged: a worker without the plugins would train on silently
    different code than the driver announced.
    """
    options = FusionOptions.from_env()
    if options is None or not options.any:
        return
    from .plugins import _requested, install_plugins

    # The driver checked the seams; a worker re-checks only cheaply (same install).
    install_plugins(options, check=False, lazy=True)
    if not _ANNOUNCED:
        line = (f"rlhf_fusion: OpenRLHF plugins {', '.join(sorted(_requested(options)))} in "
                f"worker pid {os.getpid()} (applied as OpenRLHF's modules are imported)")
        _ANNOUNCED.append(line)
        _logger().info(line)
