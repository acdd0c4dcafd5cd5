"""Measured per-layer times for the cost model (ReaLHF's profiler output, interpolated).

A profile is one decoder layer's forward and backward seconds at power-of-two token counts on
one device, as ``rlhf-fusion profile-layers`` measures them (``rlhf_fusion.runtime.
layer_profile``). The cost model uses it in place of its FLOP-based compute time for every
call of that model; communication, the pipeline bubble and the optimizer stay analytic.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlacementError

FORMAT = "rlhf-fusion-layer-profile"


@dataclass
class Profile:
    """Measured per-layer forward and backward seconds at power-of-two token counts."""

    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    # Seconds per pass outside the layers (embeddings, final norm, head, loss): charged once
    # per pass, on the stage that holds them. Empty: not measured (0).
    rest_forward: dict[int, float] = field(default_factory=dict)
    rest_backward: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _interp(table: dict[int, float], tokens: float) -> float:
        xs = sorted(table)
        if not xs:
            raise ValueError("empty profile table")
        if tokens <= xs[0]:
            return table[xs[0]] * tokens / xs[0]
        if tokens >= xs[-1]:
            return table[xs[-1]] * tokens / xs[-1]
        i = bisect.bisect_right(xs, tokens)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = table[x0], table[x1]
        w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))

    def layer_forward(self, tokens: float) -> float:
        return self._interp(self.forward, tokens)

    def layer_backward(self, tokens: float) -> float:
        return self._interp(self.backward, tokens)

    def rest(self, tokens: float, backward: bool) -> float:
        """Seconds outside the layers for one pass of ``tokens`` (forward, or backward)."""
        table = self.rest_backward if backward else self.rest_forward
        return self._interp(table, tokens) if table else 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> Profile:
        """The JSON ``profile-layers`` writes, or an inline ``{forward: {tokens: s}, backward:
        {tokens: s}}``."""
        if not isinstance(d, dict) or "forward" not in d or "backward" not in d:
            raise PlacementError(f"{where}: give forward and backward tables ({{tokens: "
                                 "seconds}}) or the file `rlhf-fusion profile-layers` writes")
        tables = []
        for key in ("forward", "backward", "rest_forward", "rest_backward"):
            if key not in d and key.startswith("rest_"):
                tables.append({})
                continue
            t = d[key]
            try:
                table = {int(k): float(v) for k, v in t.items()}
            except (AttributeError, TypeError, ValueError):
                raise PlacementError(f"{where}.{key}: a mapping of token counts to seconds, got "
                                     f"{t!r}") from None
            if not table or min(table) < 1 or min(table.values()) < 0 or (
                    min(table.values()) == 0 and not key.startswith("rest_")):
                raise PlacementError(f"{where}.{key}: needs positive token counts and seconds")
            tables.append(table)
        return cls(*tables)


def load_profile(spec: str | Path | dict[str, Any], where: str) -> Profile:
    """A profile from a JSON file path or an inline mapping."""
    if isinstance(spec, dict):
        return Profile.from_dict(spec, where)
    path = Path(spec)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlacementError(f"{where}: no file {path}; write one with `rlhf-fusion "
                             "profile-layers MODEL --out FILE`") from None
    except json.JSONDecodeError as exc:
        raise PlacementError(f"{where}: {path} is not JSON ({exc})") from None
    if data.get("format") not in (None, FORMAT):
        raise PlacementError(f"{where}: {path} is a {data.get('format')!r} file, not a layer "
                             "profile")
    return Profile.from_dict(data, where)
