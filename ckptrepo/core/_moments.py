"""Mergeable summary statistics of a tensor's values: what capture records per tensor, what the ranks
of a distributed snapshot record per piece for rank 0 to merge (saving/_tensor_stats.py, parallel/), and
the pairwise merge that ``stats`` and ``diff`` use on their partials (tools/_inspect.py)."""
from __future__ import annotations

import math
from typing import Any


def merge_moments(n1: int, mean1: float, dev1: float, n2: int, mean2: float,
                  dev2: float) -> tuple[int, float, float]:
    """Count, mean and ``dev`` of two parts together (Chan et al.'s pairwise update); either may be empty.

    ``dev`` is the root of the summed squared deviations from the mean, merged with ``math.hypot``: values
    near float64's limits (1e200, 1e-200) neither overflow nor underflow, where sums of squares would.
    """
    if not n2:
        return n1, mean1, dev1
    if not n1:
        return n2, mean2, dev2
    total = n1 + n2
    delta = mean2 - mean1
    return total, mean1 + delta * n2 / total, math.hypot(dev1, dev2, abs(delta) * math.sqrt(n1 * n2 / total))


class Moments:
    """Count, mean and root of the summed squared deviations (``dev``) of finite values, min/max, NaN and
    Inf counts: mergeable part by part (``merge_moments``)."""

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
        """Merge a part of ``k`` finite values."""
        if not k:
            return
        self.n, self.mean, self.dev = merge_moments(self.n, self.mean, self.dev, k, mean, dev)
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
