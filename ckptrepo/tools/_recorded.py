"""Per-tensor statistics of a version as the snapshot recorded them at capture: no tensor data, no torch.

``stats`` and the web page ask this first, and read the data (tools/_inspect.py) only for a version
written without records, so answering a recorded version costs a manifest read and no torch import.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Sequence

from ckptrepo.core import Plumbing


@dataclass
class TensorStats:
    """Per-tensor statistics of one version."""

    name: str
    dtype: str
    shape: list[int]
    numel: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    nan: int
    inf: int
    absmax: float = math.nan         # max |x| over the finite values (of |x| for complex tensors)

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


def recorded_stats(plumbing: Plumbing, vid: str, names: Sequence[str]) -> dict[str, dict[str, float]] | None:
    """Version ``vid``'s capture-time statistics of ``names`` (None when it has none for all of them)."""
    record = plumbing.manifest(vid).tensor_stats
    if record is None:
        return None
    rows = record.rows()
    if not all(n in rows for n in names) or not _STATS.issubset(record.columns):
        return None
    if any(math.isnan(rows[n][c]) for n in names for c in ("nan", "inf")):
        return None   # counts not taken: only the data can tell
    return {n: rows[n] for n in names}


_STATS = frozenset(("norm", "mean", "std", "min", "max", "absmax", "nan", "inf"))


def recorded_tensor_stats(plumbing: Plumbing, vid: str, pattern: str | None = None) -> list[TensorStats] | None:
    """What ``tools._inspect.tensor_stats`` reads from the data, answered from the statistics version ``vid``
    recorded at capture; None when it has none for some matching tensor (the caller reads the data)."""
    m = plumbing.manifest(vid)
    entries = [e for e in m.tensors if not pattern or fnmatch.fnmatchcase(e.name, pattern)]
    recorded = recorded_stats(plumbing, vid, [e.name for e in entries])
    if recorded is None:
        return None
    plumbing.require_data(vid, m)
    out = []
    for e in entries:
        r = recorded[e.name]
        out.append(TensorStats(e.name, e.dtype, list(e.shape), e.numel, r["norm"], r["mean"], r["std"], r["min"],
                               r["max"], int(r["nan"]), int(r["inf"]), r["absmax"]))
    return out
