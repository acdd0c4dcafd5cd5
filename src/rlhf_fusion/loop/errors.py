"""The loop's configuration error, below every module that raises it (config, models,
placement), so none of them imports another for it."""


class LoopConfigError(ValueError):
    """A run configuration that cannot work; the message names the field and the fix."""
