"""What is patched in this process, shared by the plugins without importing each other."""

from __future__ import annotations

__all__ = ["PATCHED"]

PATCHED: set[str] = set()  # plugin names whose seam is patched now ("gae", "overlap")
