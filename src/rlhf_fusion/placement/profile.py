"""Measured per-layer times for the cost model (ReaLHF's profiler output, interpolated).

A profile is one decoder layer's forward and backward seconds at power-of-two token counts on
one device, as ``rlhf-fusion profile-layers`` measures them (``rlhf_fusion.runtime.
layer_profile``). The cost model uses it in place of its FLOP-based compute time for every
call of that model; communication, the pipeline bubble and the optimizer stay analytic.

A profile may also hold ``layouts``: the same tables measured in a parallel training layout
on its ranks (``rlhf-fusion profile-layers --layout``, ``rlhf_fusion.runtime.layout_profile``),
each keyed by :func:`layout_key`, with the layout's communication inside the layer times and
``step``, the seconds a mini-batch step adds to its passes (gradient sync, clipping, the
optimizer) at two or more parameter counts. A training call in a profiled layout is costed from
those alone; the analytic tp all-reduces, ZeRO gathers, gradient all-reduce and optimizer
terms are what the measurement replaces.
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
    # Seconds a mini-batch step adds to its passes, by the model's parameter count (measured
    # in a layout; linear in between and beyond). Empty: not measured.
    step: dict[int, float] = field(default_factory=dict)
    # Seconds to gather whole weights on every rank of a sharded layout (its weight sync's
    # first part), by parameter count; empty: not measured.
    gather: dict[int, float] = field(default_factory=dict)
    # The tables measured in parallel training layouts, by layout_key(dp, tp, zero).
    layouts: dict[str, Profile] = field(default_factory=dict)

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
        if y0 <= 0 or y1 <= 0:   # a rest measured as nothing: no logarithm, a straight line
            return y0 + w * (y1 - y0)
        return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))

    def layer_forward(self, tokens: float) -> float:
        return self._interp(self.forward, tokens)

    def layer_backward(self, tokens: float) -> float:
        return self._interp(self.backward, tokens)

    def rest(self, tokens: float, backward: bool) -> float:
        """Seconds outside the layers for one pass of ``tokens`` (forward, or backward)."""
        table = self.rest_backward if backward else self.rest_forward
        return self._interp(table, tokens) if table else 0.0

    def train_pass(self, tokens: float, layers: float, recompute: bool = False) -> float:
        """Seconds of one training pass of ``tokens`` through ``layers`` layers and the rest:
        forward and backward (and the forward again per layer when ``recompute``)."""
        f = self.layer_forward(tokens)
        return (layers * (f + self.layer_backward(tokens) + (f if recompute else 0.0))
                + self.rest(tokens, backward=False) + self.rest(tokens, backward=True))

    @staticmethod
    def _linear(table: dict[int, float], x: float) -> float:
        """The measured points joined linearly (the two end ones extended); 0 if none."""
        if not table:
            return 0.0
        xs = sorted(table)
        if len(xs) == 1:
            return table[xs[0]] * x / xs[0]
        i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = table[x0], table[x1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def step_seconds(self, params: float) -> float:
        """Seconds a mini-batch step adds for a model of ``params`` parameters."""
        return self._linear(self.step, params)

    def gather_seconds(self, params: float) -> float:
        """Seconds to gather a model of ``params`` parameters whole on every rank."""
        return self._linear(self.gather, params)

    def layout(self, dp: int, tp: int, zero: int) -> Profile | None:
        """The tables measured in this layout, if any (``zero`` 3 or not: ZeRO-1/2 run as
        data parallel)."""
        return self.layouts.get(layout_key(dp, tp, zero))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> Profile:
        """The JSON ``profile-layers`` writes, or an inline ``{forward: {tokens: s}, backward:
        {tokens: s}}``; either may carry ``layouts: {layout_key: tables}``."""
        layouts = d.get("layouts", {}) if isinstance(d, dict) else {}
        if not isinstance(layouts, dict):
            raise PlacementError(f"{where}.layouts: a mapping of layouts ('dp=2 tp=1 zero=0') "
                                 f"to tables, got {layouts!r}")
        parsed = {}
        for key, sub in layouts.items():
            dp, tp, zero = parse_layout_key(key, f"{where}.layouts")
            parsed[layout_key(dp, tp, zero)] = cls.from_dict(sub, f"{where}.layouts[{key!r}]")
        if isinstance(d, dict) and "forward" not in d and "backward" not in d and parsed:
            return cls(layouts=parsed)
        if not isinstance(d, dict) or "forward" not in d or "backward" not in d:
            raise PlacementError(f"{where}: give forward and backward tables ({{tokens: "
                                 "seconds}}) or the file `rlhf-fusion profile-layers` writes")
        tables = []
        for key in ("forward", "backward", "rest_forward", "rest_backward", "step", "gather"):
            if key not in d and key not in ("forward", "backward"):
                tables.append({})
                continue
            t = d[key]
            try:
                table = {int(k): float(v) for k, v in t.items()}
            except (AttributeError, TypeError, ValueError):
                raise PlacementError(f"{where}.{key}: a mapping of token counts to seconds, got "
                                     f"{t!r}") from None
            if not table or min(table) < 1 or min(table.values()) < 0 or (
                    min(table.values()) == 0 and key in ("forward", "backward")):
                raise PlacementError(f"{where}.{key}: needs positive token counts and seconds")
            tables.append(table)
        return cls(*tables, layouts=parsed)


def layout_key(dp: int, tp: int, zero: int) -> str:
    """How a profile names a training layout: ``"dp=2 tp=1 zero=3"`` (ZeRO-1/2 are 0: they
    run as data parallel)."""
    return f"dp={dp} tp={tp} zero={3 if zero == 3 else 0}"


def parse_layout_key(key: str, where: str) -> tuple[int, int, int]:
    """``"dp=2 tp=1 zero=3"`` (any order, a missing one 1, or 0 for zero) -> (dp, tp, zero)."""
    vals = {"dp": 1, "tp": 1, "zero": 0}
    for part in str(key).replace(",", " ").split():
        name, _, v = part.partition("=")
        if name not in vals or not v.isdigit():
            raise PlacementError(f"{where}: layout {key!r}: write it as 'dp=2 tp=1 zero=3'")
        vals[name] = int(v)
    if vals["dp"] < 1 or vals["tp"] < 1 or vals["zero"] not in (0, 1, 2, 3):
        raise PlacementError(f"{where}: layout {key!r}: dp and tp >= 1, zero one of 0-3")
    return vals["dp"], vals["tp"], vals["zero"]


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
