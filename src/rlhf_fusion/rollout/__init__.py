"""Inter-stage fusion, rollout side: the GenerationBackend contract, the reference and vLLM
backends, the migration planner (``rollout.planning``, torch-free) and the streaming coordinator
(``rollout.distributed``, configured by ``rollout.config``).

Importing this package imports no torch; the torch-based parts load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import types
from .backend import GenerationBackend
from .types import *  # noqa: F403 (the types that cross the backend boundary: types.__all__)

_LAZY = {
    "ReferenceBackend": ".reference",
    "VLLMBackend": ".vllm_backend",
    "Experience": ".inference",
    "InferenceModels": ".inference",
    "RolloutConfig": ".config",
    "check_rollout": ".config",
    "run_rollout": ".distributed",
    "LocalFusedRollout": ".local",
}

__all__ = ["GenerationBackend", *types.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
