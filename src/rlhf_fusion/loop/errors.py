"""The loop's configuration and launch errors, below every module that raises them (config,
models, placement, iteration), so none of them imports another for them."""

from ..errors import RLHFFusionError


class LoopConfigError(RLHFFusionError, ValueError):
    """A run configuration that cannot work; the message names the field and the fix."""


class LoopLaunchError(RLHFFusionError, RuntimeError):
    """The loop's processes were started in a way the run cannot work in (a multi-rank
    placement without a process group); the message names how to start them."""
