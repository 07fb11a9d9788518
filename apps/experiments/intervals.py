"""Across-seed summaries: the mean and a 95% percentile-bootstrap interval of a per-seed measure.

With a handful of seeds every resample can be enumerated: the bootstrap distribution
of the mean is then exact (all n^n equally likely ordered resamples), deterministic,
and a test can check it against numbers worked out by hand. Beyond EXACT_MAX_RESAMPLES
the resamples are drawn (seeded) instead.

The interval is the percentile interval: the ``(1 - confidence) / 2`` and
``(1 + confidence) / 2`` quantiles of the resampled means, each the smallest resampled
mean whose cumulative share reaches that level (the inverse of the empirical CDF).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
EXACT_MAX_RESAMPLES = 100_000
"""n^n resamples are enumerated up to this many (n = 7 seeds gives 823543: drawn instead)."""
DRAWN_RESAMPLES = 20_000
"""Resamples drawn when enumeration is too large: the quantiles move by well under 0.01 between draws."""


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    """Seeds that had a value."""

    def apart_from(self, other: "Interval") -> bool:
        """True when the two intervals do not overlap."""
        return self.low > other.high or other.low > self.high


BAND_COLUMNS = 16
"""Points of a curve whose resampled means are computed at once: ``[R, n, 16]`` values (36 MB at 6
seeds' 46656 resamples), where a whole curve of 600 points took 1.6 GB."""


def _resample_indices(n: int, seed: int) -> np.ndarray:
    """``[R, n]`` indices of the resamples: all n^n when few enough, else DRAWN_RESAMPLES seeded draws."""
    if n ** n <= EXACT_MAX_RESAMPLES:
        return np.array(list(itertools.product(range(n), repeat=n)), dtype=np.int64)
    return np.random.default_rng(seed).integers(0, n, size=(DRAWN_RESAMPLES, n))


def bootstrap_band(values: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Pointwise percentile-bootstrap interval of the mean over seeds.

    ``values`` ``[n_seeds, T]`` -> (low ``[T]``, high ``[T]``). One seed gives its own values.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] == 0:
        raise ValueError(f"values must be [seeds, T] with at least one seed, got shape {values.shape}")
    n, points = values.shape
    resamples = _resample_indices(n, seed)
    tail = (1.0 - confidence) / 2.0
    low, high = np.empty(points), np.empty(points)
    for start in range(0, points, BAND_COLUMNS):
        columns = slice(start, start + BAND_COLUMNS)
        means = values[:, columns][resamples].mean(axis=1)  # [R, columns]
        low[columns] = np.quantile(means, tail, axis=0, method="inverted_cdf")
        high[columns] = np.quantile(means, 1.0 - tail, axis=0, method="inverted_cdf")
    return low, high


def interval(values: Sequence[float | None], confidence: float = CONFIDENCE, seed: int = 0) -> Interval | None:
    """Mean and bootstrap interval of the per-seed ``values`` (None entries, e.g. a lag that was
    never reached, are left out and ``n`` says how many remained); None when none remain."""
    kept = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not kept:
        return None
    low, high = bootstrap_band(np.array(kept)[:, None], confidence, seed)
    return Interval(mean=sum(kept) / len(kept), low=float(low[0]), high=float(high[0]), n=len(kept))


def cell(value: Interval | None, digits: int = 3, signed: bool = False, of: int | None = None) -> str:
    """``mean [low, high]`` for a report's table; the mean alone for one seed; '-' for no value.
    ``signed``: every number with its sign (a difference). ``of``: the seeds the value should cover;
    when fewer gave one (a NaN reward, a run without the measure), ``(n of N seeds)`` follows, so a
    seed left out is seen, not averaged away."""
    if value is None or math.isnan(value.mean):
        return "-"
    spec = f"{'+' if signed else ''}.{digits}f"
    text = f"{value.mean:{spec}}" if value.n == 1 else f"{value.mean:{spec}} [{value.low:{spec}}, {value.high:{spec}}]"
    return text if of is None or value.n >= of else f"{text} ({value.n} of {of} seeds)"
