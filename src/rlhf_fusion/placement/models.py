"""Model shapes: presets by name (``llama-7b``) or a parameter count."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from .errors import PlacementError


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    hidden: int
    vocab: int = 32000
    heads: int = 0       # 0: hidden / 128
    kv_heads: int = 0    # 0: heads (no grouped-query attention)
    name: str = ""

    def __post_init__(self) -> None:
        if self.params <= 0 or self.layers < 1 or self.hidden < 1:
            raise PlacementError((f"model {self.name}: " if self.name else "")
                                 + "params, layers and hidden must be positive")
        if not self.heads:
            object.__setattr__(self, "heads", max(1, self.hidden // 128))
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def param_bytes(self) -> float:
        """bf16 weights."""
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:
        """bf16 K and V over all layers."""
        return 2 * 2.0 * self.layers * self.hidden * self.kv_heads / self.heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# LLaMA-1 (7B..65B) and LLaMA-2 70B (grouped-query attention, 8 KV heads).
MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-7b": ModelShape(6.74e9, 32, 4096, name="llama-7b"),
    "llama-13b": ModelShape(13.0e9, 40, 5120, name="llama-13b"),
    "llama-33b": ModelShape(32.5e9, 60, 6656, heads=52, name="llama-33b"),
    "llama-65b": ModelShape(65.2e9, 80, 8192, name="llama-65b"),
    "llama-70b": ModelShape(69.0e9, 80, 8192, heads=64, kv_heads=8, name="llama-70b"),
}
MODEL_PRESETS["llama-30b"] = MODEL_PRESETS["llama-33b"]


def shape_from_params(params: float, name: str = "") -> ModelShape:
    """A LLaMA-like shape of ``params`` parameters: 12·L·h² ≈ params with h/L ≈ 128 (the
    LLaMA aspect ratio), h rounded to a multiple of 128."""
    h = max(128, int(round((params * 128 / 12) ** (1 / 3) / 128)) * 128)
    layers = max(1, int(round(params / (12 * h * h))))
    return ModelShape(float(params), layers, h, name=name or _fmt(params))


def _fmt(params: float) -> str:
    return f"{params / 1e9:g}b"


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([bm])$", re.IGNORECASE)


def resolve_model(spec: Any, role: str = "model") -> ModelShape:
    """``"llama-7b"``, ``"7b"``, ``7e9`` or ``{params: 7e9}`` / ``{preset: llama-7b}`` /
    ``{params, layers, hidden, ...}``."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return shape_from_params(float(spec))
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in MODEL_PRESETS:
            return MODEL_PRESETS[key]
        m = _SIZE.match(key)
        if m:
            return shape_from_params(float(m.group(1)) * (1e9 if m.group(2).lower() == "b" else 1e6))
        raise PlacementError(f"{role}: {spec!r} is not a model preset; use one of "
                             f"{sorted(MODEL_PRESETS)}, a size such as '7b', or {{params: 7e9}}")
    if isinstance(spec, dict):
        if "preset" in spec:
            return resolve_model(spec["preset"], role)
        if "params" not in spec:
            raise PlacementError(f"{role}: give 'params' (e.g. 7e9) or 'preset' (e.g. llama-7b)")
        params = float(spec["params"])
        if not math.isfinite(params) or params <= 0:
            raise PlacementError(f"{role}.params must be a positive number, got {spec['params']!r}")
        if "layers" in spec or "hidden" in spec:
            try:
                return ModelShape(params, int(spec["layers"]), int(spec["hidden"]),
                                  int(spec.get("vocab", 32000)), int(spec.get("heads", 0)),
                                  int(spec.get("kv_heads", 0)), str(spec.get("name", "")))
            except KeyError as exc:
                raise PlacementError(f"{role}: {exc.args[0]!r} is needed with layers/hidden") from None
            except PlacementError as exc:
                raise PlacementError(f"{role}: {exc}") from None
        return shape_from_params(params, str(spec.get("name", "")))
    raise PlacementError(f"{role}: cannot read a model from {spec!r}; use a preset name or "
                         "{params: N}")
