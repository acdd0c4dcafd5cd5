"""The one error type of the placement planner."""

from __future__ import annotations

from ..errors import RLHFFusionError


class PlacementError(RLHFFusionError, ValueError):
    """A placement, plan or planner config that cannot work; the message names the fix."""
