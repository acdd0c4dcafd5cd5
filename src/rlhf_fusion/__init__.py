"""rlhf-fusion: stage fusion plugins for existing RLHF trainers."""

from .errors import RLHFFusionError

__version__ = "0.1.0"
__all__ = ["RLHFFusionError", "__version__"]


def _register_lightning_strategies() -> None:
    """Make ``Trainer(strategy="fused_pipeline")`` work once ``rlhf_fusion`` is imported.

    Importing Lightning costs seconds and the planner (``rlhf_fusion.schedule``, the CLI) must
    not pay for it, so registration is deferred: done now if ``lightning.pytorch`` is already
    imported, otherwise right after it finishes importing (an import hook that removes itself).
    """
    import importlib.abc
    import importlib.util
    import sys

    def register() -> None:
        try:
            import rlhf_fusion.plugins  # noqa: F401  (registers on import)
        except ImportError:  # lightning or torch not installed: the strategy is unavailable
            pass

    if "lightning.pytorch" in sys.modules:
        register()
        return

    class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
            if name != "lightning.pytorch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_register(module):  # noqa: ANN001, ANN202
                exec_module(module)
                register()

            loader.exec_module = exec_and_register  # type: ignore[method-assign]
            return spec

    if not any(type(f).__name__ == "_RegisterAfterLightning" for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


_register_lightning_strategies()
