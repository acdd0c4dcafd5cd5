"""Shared plumbing for the Triton kernels: optional import and interpreter detection.

Triton is an optional dependency (the ``triton`` / ``dev`` extras). Kernel modules import it
through here so that ``import rlhf_fusion.triton_kernels`` works on a machine without it; the
kernels are then plain functions that nobody launches and the torch implementations serve.

Whether kernels run under the Triton interpreter is decided per *process*, when ``triton`` is
first imported: ``TRITON_INTERPRET=1`` turns ``triton.jit`` -- including Triton's own standard
library (``tl.sum``, ``tl.cdiv``, ...) -- into interpreted functions. The CPU tests therefore run
the kernels in a child process started with that variable (see ``tests/test_gae.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

try:  # pragma: no cover - exercised implicitly by every kernel test
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is in the dev extra
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "triton", "tl", "jit", "is_interpreted", "check_launchable"]

F = TypeVar("F", bound=Callable[..., Any])


def jit(fn: F) -> F:
    """``triton.jit`` when Triton is installed, the identity otherwise."""
    if HAS_TRITON:
        return triton.jit(fn)  # type: ignore[return-value]
    return fn


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise ImportError(
            f"{what} needs Triton, which is not installed; install the extra "
            "`pip install rlhf-fusion[triton]`, or use the torch implementation"
        )


def is_interpreted(kernel: Any) -> bool:
    """True when ``kernel`` was wrapped by the Triton interpreter (TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: Any, what: str, *tensors: Any) -> bool:
    """Raise a clear error unless ``kernel`` can run on ``tensors``; return ``is_interpreted``."""
    require_triton(what)
    interpreted = is_interpreted(kernel)
    if not interpreted:
        for t in tensors:
            if t is not None and not t.is_cuda:
                raise RuntimeError(
                    f"{what} got a tensor on {t.device}: the compiled kernel needs CUDA tensors. "
                    "To run it on CPU, start the process with TRITON_INTERPRET=1 (set before "
                    "triton is imported), or call the torch implementation."
                )
    return interpreted
