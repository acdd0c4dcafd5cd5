"""The version check every framework integration runs before it patches anything.

verl and OpenRLHF pin a release range (``SUPPORTED``, e.g. ``(">=0.9.1", "<0.10")``): the one
read and tested, since their plugins replace private seams that a later release may move.
Each integration keeps its own error class and names its own fix; the range test and the
messages' shape are here, once. No torch import: the checks run before any framework loads.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["check_supported", "installed", "supported_text"]


def supported_text(dist: str, supported: tuple[str, ...]) -> str:
    """``"verl>=0.9.1,<0.10"``: the pip requirement for ``supported``."""
    return dist + ",".join(supported)


def installed(dist: str, supported: tuple[str, ...], error_cls: type[Exception]) -> str:
    """The installed version of distribution ``dist``, else ``error_cls`` naming the extra
    that installs it (``rlhf-fusion[<dist>]``, pinned to ``supported`` in pyproject)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise error_cls(f"{dist} is not installed; pip install 'rlhf-fusion[{dist}]' "
                        f"({supported_text(dist, supported)})") from None


def check_supported(dist: str, version: str, supported: tuple[str, ...],
                    error_cls: type[Exception], fix: str) -> str:
    """``version`` if it is in ``supported``, else ``error_cls`` with the range and ``fix``."""
    # packaging is no declared dependency of ours (verl, OpenRLHF and transformers bring it):
    # imported where a version is checked, not when the module is
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(version) not in SpecifierSet(",".join(supported)):
        raise error_cls(
            f"{dist} {version} is not supported by rlhf_fusion.integrations.{dist} (verified "
            f"with {supported_text(dist, supported)}); {fix}")
    return version
