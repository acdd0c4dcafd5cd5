"""Response-length distributions: profiled on the training prompts, refined as iterations run.

Pure numpy. The planner only needs to draw plausible batches of lengths, so the distribution is
an empirical, weighted sample; refining it mixes in the lengths observed in the last iteration
with a fixed weight, so the plan follows the policy as its responses grow or shrink.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..types import RolloutConfigError


def _ndtri(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, rel. error < 1.2e-9)."""
    a = [-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00]
    b = [-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00]
    p = np.asarray(p, dtype=np.float64)
    out = np.empty_like(p)
    lo, hi = p < 0.02425, p > 1 - 0.02425
    mid = ~(lo | hi)
    q = np.sqrt(-2 * np.log(p[lo]))
    out[lo] = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = p[mid] - 0.5
    r = q * q
    out[mid] = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    q = np.sqrt(-2 * np.log(1 - p[hi]))
    out[hi] = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    return out


def lognormal_quantile_lengths(
    n: int, median: float, sigma: float, *, min_len: int = 1, max_len: int | None = None
) -> np.ndarray:
    """``n`` lengths at the mid-quantiles of a lognormal: the distribution's exact shape, no noise.

    p99 / median of the continuous law is exp(2.326 * sigma): sigma = 1 gives ~10x.
    """
    if n < 1 or median <= 0 or sigma < 0:
        raise RolloutConfigError("lognormal lengths need n >= 1, median > 0, sigma >= 0")
    z = _ndtri((np.arange(n) + 0.5) / n)
    lengths = np.rint(median * np.exp(sigma * z)).astype(np.int64)
    return np.clip(lengths, min_len, max_len if max_len is not None else None)


class LengthDistribution:
    """A weighted empirical distribution of response lengths (in tokens)."""

    def __init__(self, lengths: Sequence[int] | np.ndarray,
                 weights: Sequence[float] | np.ndarray | None = None) -> None:
        arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise RolloutConfigError("LengthDistribution needs at least one profiled length")
        if (arr < 1).any():
            raise RolloutConfigError("response lengths must be >= 1 token")
        w = np.ones(arr.size) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != arr.shape or (w < 0).any() or w.sum() <= 0:
            raise RolloutConfigError("weights must be >= 0, one per length, not all zero")
        self.lengths = arr
        self.weights = w / w.sum()

    @classmethod
    def lognormal(cls, median: float, sigma: float, *, max_len: int | None = None,
                  points: int = 4096) -> LengthDistribution:
        return cls(lognormal_quantile_lengths(points, median, sigma, max_len=max_len))

    @classmethod
    def load(cls, path: str | Path) -> LengthDistribution:
        """A JSON list of lengths, a JSON object {"lengths": [...], "weights": [...]}, or .npy."""
        p = Path(path)
        if p.suffix == ".npy":
            return cls(np.load(p))
        data = json.loads(p.read_text())
        if isinstance(data, dict):
            return cls(data["lengths"], data.get("weights"))
        return cls(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"lengths": self.lengths.tolist(),
                                          "weights": self.weights.tolist()}))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(self.lengths, size=n, replace=True, p=self.weights)

    def quantile(self, q: float) -> float:
        order = np.argsort(self.lengths, kind="stable")
        cdf = np.cumsum(self.weights[order])
        return float(self.lengths[order][min(np.searchsorted(cdf, q), cdf.size - 1)])

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def tail_ratio(self) -> float:
        """p99 / median: how long-tailed generation is."""
        return self.quantile(0.99) / self.median

    def refine(self, observed: Sequence[int] | np.ndarray, weight: float = 0.5
               ) -> LengthDistribution:
        """A new distribution: (1 - weight) of this one plus ``weight`` of the observed lengths."""
        if not 0 < weight <= 1:
            raise RolloutConfigError("refine weight must be in (0, 1]")
        obs = np.asarray(observed, dtype=np.int64).reshape(-1)
        if obs.size == 0:
            return self
        lengths = np.concatenate([self.lengths, obs])
        weights = np.concatenate(
            [self.weights * (1 - weight), np.full(obs.size, weight / obs.size)])
        keep = weights > 1e-12  # old iterations fade out instead of growing the sample forever
        return LengthDistribution(lengths[keep], weights[keep])
