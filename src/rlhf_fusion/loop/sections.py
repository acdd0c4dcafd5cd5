"""A config section read from a mapping: unknown keys refused by name, YAML 1.1's numbers-as-text
read as numbers. Shared by ``config.py`` and ``algorithm_config.py`` (which config.py imports)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .errors import LoopConfigError


def section(cls: type, name: str, value: Any) -> Any:
    """The dataclass ``cls`` from the mapping ``value`` of the config's ``name`` section."""
    if not isinstance(value, Mapping):
        raise LoopConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise LoopConfigError(f"{name}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**coerce_numbers(cls, value))


def coerce_numbers(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """YAML 1.1 reads ``1e-3`` (no dot) as the string ``"1e-3"``: a string that parses as a
    number, in a field that holds floats, is that float."""
    floats = {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}
    out = dict(values)
    for key, value in values.items():
        if key in floats and isinstance(value, str) and value != "auto":
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


# -- field checks: each names the field and what it must be --
def _text_hint(value: Any) -> str:
    """The fix for a number that YAML 1.1 read as text (``1e-3``: no dot, so not a float)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (a string: write the number without quotes, e.g. 1.0e-3 or 0.001)"
    return ""


def check_integer(name: str, value: Any, least: int, *, unset: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        tail = " (or leave it unset)" if unset else ""
        raise LoopConfigError(f"{name}: must be an integer >= {least}{tail}, got {value!r}"
                              f"{_text_hint(value)}")


def check_number(name: str, value: Any, *, above: float | None = None, least: float | None = None,
            most: float | None = None, below: float | None = None, unset: bool = False,
            why: str = "") -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value)
          and (above is None or value > above) and (least is None or value >= least)
          and (most is None or value <= most) and (below is None or value < below))
    if ok:
        return
    if least is not None and most is not None:
        want = f"a number in [{least:g}, {most:g}]"
    elif above is not None and below is not None:
        want = f"a number in ({above:g}, {below:g})"
    elif above is not None:
        want = f"a number > {above:g}"
    else:
        want = f"a number >= {least:g}"
    tail = " (or leave it unset)" if unset else ""
    why = f"; {why}" if why else ""
    raise LoopConfigError(f"{name}: must be {want}{tail}, got {value!r}{_text_hint(value)}{why}")


def check_boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise LoopConfigError(f"{name}: must be true or false, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LoopConfigError(f"{name}: {value!r}; use one of {', '.join(choices)}")
