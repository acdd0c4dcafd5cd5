"""Run a function right after a module has been imported (or now, if it already has been).

The entry point runs inside ``import verl`` in every process verl starts; importing verl's
trainer modules from there would make every rollout server and worker pay for them (and import
them while ``verl/__init__.py`` is still running). The plugins instead wait for the module they
patch: a meta-path finder wraps that module's loader so the patch is applied as its import ends,
before any caller can read the attribute.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["after_import"]

Callback = Callable[[ModuleType], None]
_LOCK = threading.Lock()


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        with _LOCK:
            callbacks = self.pending.pop(fullname, [])
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            for callback in callbacks:
                callback(module)

        # the loader instance belongs to this spec alone (one file, one loader)
        loader.exec_module = exec_then_patch
        return spec


_FINDER = _AfterImportFinder()


def after_import(module_name: str, callback: Callback) -> None:
    """``callback(module)`` once ``module_name`` is imported: now if it is already, else as its
    import finishes. An exception from ``callback`` fails that import, loudly."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        _FINDER.pending.setdefault(module_name, []).append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
