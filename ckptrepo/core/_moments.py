"""Mergeable summary statistics of a tensor's values: what capture records per tensor, and what the ranks
of a distributed snapshot record per piece for rank 0 to merge (saving/_tensor_stats.py, parallel/)."""
from __future__ import annotations

import math
from typing import Any


class Moments:
    """Count, mean and root of the summed squared deviations (``dev``) of finite values, min/max, NaN and
    Inf counts: mergeable part by part. ``dev`` is kept as a root and merged with ``math.hypot``, so values
    near float64's limits (1e200, 1e-200) neither overflow nor underflow, as in tools/_inspect.py."""

    __slots__ = ("n", "mean", "dev", "lo", "hi", "nan", "inf", "unknown")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.dev = 0.0
        self.lo = math.inf
        self.hi = -math.inf
        self.nan = 0
        self.inf = 0
        self.unknown = False   # the finite values' statistics could not be taken (only the counts are right)

    def add(self, k: int, mean: float, dev: float, lo: float, hi: float) -> None:
        """Merge a part of ``k`` finite values (Chan et al.'s pairwise update)."""
        if not k:
            return
        total = self.n + k
        delta = mean - self.mean
        self.dev = math.hypot(self.dev, dev, abs(delta) * math.sqrt(self.n * k / total) if self.n else 0.0)
        self.mean += delta * k / total
        self.n = total
        self.lo = min(self.lo, lo)
        self.hi = max(self.hi, hi)

    def row(self, numel: int) -> tuple[float, ...]:
        """The recorded columns but the change from the parent (``STAT_COLUMNS[:8]``)."""
        n = self.n
        if self.unknown:
            return (math.nan,) * 6 + (float(self.nan), float(self.inf))
        if not n:
            return (0.0 if numel == 0 else math.nan, math.nan, math.nan, math.nan, math.nan, math.nan,
                    float(self.nan), float(self.inf))
        norm = math.hypot(self.dev, math.sqrt(n) * abs(self.mean))   # ||x||^2 = sum (x - mean)^2 + n mean^2
        return (norm, self.mean, self.dev / math.sqrt(n), self.lo, self.hi,
                max(abs(self.lo), abs(self.hi)), float(self.nan), float(self.inf))

    def merge(self, other: "Moments") -> None:
        """Take in another part's moments (another rank's piece of the same tensor)."""
        self.add(other.n, other.mean, other.dev, other.lo, other.hi)
        self.nan += other.nan
        self.inf += other.inf
        self.unknown = self.unknown or other.unknown

    def to_raw(self) -> list[Any]:
        return [self.n, self.mean, self.dev, self.lo, self.hi, self.nan, self.inf, self.unknown]

    @classmethod
    def from_raw(cls, raw: Any) -> "Moments":
        """Moments as ``to_raw`` gave them (a rank's part); raises ValueError for anything else."""
        if type(raw) not in (list, tuple) or len(raw) != 8:
            raise ValueError(f"moments {str(raw)[:60]} are not the 8 values a rank records")
        m = cls()
        n, mean, dev, lo, hi, nan, inf, unknown = raw
        if not all(type(x) is int and x >= 0 for x in (n, nan, inf)) or type(unknown) is not bool or \
                not all(type(x) in (int, float) for x in (mean, dev, lo, hi)):
            raise ValueError(f"moments {str(raw)[:60]} are not the 8 values a rank records")
        m.n, m.mean, m.dev, m.lo, m.hi, m.nan, m.inf, m.unknown = n, float(mean), float(dev), float(lo), \
            float(hi), nan, inf, unknown
        return m
