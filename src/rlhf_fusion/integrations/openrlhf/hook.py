"""Ray's ``worker_process_setup_hook``: the plugins in every worker of the job."""

from __future__ import annotations

from .options import FusionOptions

__all__ = ["HOOK", "setup_worker"]

HOOK = f"{__name__}.setup_worker"


def setup_worker() -> None:
    """Install the plugins the driver's options (``RLHF_FUSION_OPENRLHF``) ask for.

    A failure is raised, not logged: a worker without the plugins would train on silently
    different code than the driver announced.
    """
    options = FusionOptions.from_env()
    if options is None or not options.any:
        return
    from .plugins import install_plugins

    # The driver checked the seams; a worker re-checks only cheaply (same install).
    install_plugins(options, check=False)
