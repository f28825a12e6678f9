"""Bisect: the first version, oldest first, where a recorded metric or a tensor statistic meets a condition.

Conditions (``--when``; case and spacing are free; X is a number such as ``3``, ``-0.5``, ``1e4`` or ``inf``):

=============================  ===============================================================
``above X``, ``exceeds X``,    value > X
``> X``
``below X``, ``< X``           value < X
``>= X``, ``<= X``,            value >= X, <= X, == X, != X
``== X``, ``!= X``
``rises above X``              previous <= X and value > X (a crossing: needs a previous value)
``falls below X``              previous >= X and value < X (a crossing)
``changes by more than X``     \\|value - previous\\| > X
``changes by more than X%``    \\|value - previous\\| > X/100 * \\|previous\\| (from 0: any change)
``is nan``                     value is NaN (metrics only: a tensor statistic is NaN where the
                               tensor is absent; ``--nonfinite`` counts NaN elements exactly)
``is inf``, ``is not finite``  value is +-Inf; value is NaN or +-Inf
=============================  ===============================================================

"previous" is the value of the same series (the metric, or the same tensor) at the version before in the range
that has one; the first value of a series has none, so a crossing condition never matches there.

The scan is linear, not a binary search: the values come from headers and capture-time records, so reading all
of them is cheap, and a scan gives the exact first match of any condition. A binary search assumes the condition
is monotone along the history (false before some version, true from it on); a crossing ("rises above") is true at
isolated versions, and a loss that spikes and recovers breaks even "above", so a binary search would report some
version where the condition holds, not the first.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ckptrepo.arguments import is_number
from ckptrepo.core import Plumbing, in_steps, metric_rows
from ckptrepo.errors import ArgumentError

if TYPE_CHECKING:
    from ckptrepo.tools._trajectory import StatMatrix

# (kind, regex): the accepted forms, in the order they are tried; each regex is matched against the whole
# condition, lower-cased with runs of spaces made one
_NUMBER = r"([-+]?(?:(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf|infinity))"
_FORMS: tuple[tuple[str, str], ...] = (
    ("rises", rf"rises above {_NUMBER}"),
    ("falls", rf"falls below {_NUMBER}"),
    ("change%", rf"changes by more than {_NUMBER} ?%"),
    ("change", rf"changes by more than {_NUMBER}"),
    (">", rf"(?:above|exceeds|>) ?{_NUMBER}"),
    ("<", rf"(?:below|<) ?{_NUMBER}"),
    (">=", rf">= ?{_NUMBER}"),
    ("<=", rf"<= ?{_NUMBER}"),
    ("==", rf"== ?{_NUMBER}"),
    ("!=", rf"!= ?{_NUMBER}"),
    ("nan", r"is nan"),
    ("inf", r"is inf"),
    ("nonfinite", r"is not finite"),
)

ACCEPTED = ("'above X' (or 'exceeds X', '> X'), 'below X' (or '< X'), '>= X', '<= X', '== X', '!= X', "
            "'rises above X', 'falls below X', 'changes by more than X' or 'X%', 'is nan', 'is inf', "
            "'is not finite'")


@dataclass(frozen=True)
class Condition:
    """A parsed ``--when``: what to test (``kind``, one of the forms above) against ``threshold``."""

    text: str
    kind: str
    threshold: float = math.nan

    def holds(self, value: float, previous: float | None) -> bool:
        """Whether ``value`` (after ``previous``, None for a series' first value) meets the condition."""
        return bool(_TESTS[self.kind](value, math.nan if previous is None else previous, self.threshold))


# Each test takes the value, the previous value (NaN: none) and the threshold, and is written with operators
# that work alike on floats and, element by element, on numpy arrays (``&``, comparisons, ``abs``; ``v != v``
# is "v is NaN"), so that a tensors x versions matrix is tested in a few array operations. A comparison with
# NaN is false, so a crossing never holds where there is no previous value.
_TESTS: dict[str, Callable[[Any, Any, float], Any]] = {
    ">": lambda v, p, x: v > x,
    "<": lambda v, p, x: v < x,
    ">=": lambda v, p, x: v >= x,
    "<=": lambda v, p, x: v <= x,
    "==": lambda v, p, x: v == x,
    "!=": lambda v, p, x: (v == v) & (v != x),
    "rises": lambda v, p, x: (p <= x) & (v > x),
    "falls": lambda v, p, x: (p >= x) & (v < x),
    "change": lambda v, p, x: abs(v - p) > x,
    "change%": lambda v, p, x: abs(v - p) > x / 100 * abs(p),   # from 0: any change
    "nan": lambda v, p, x: v != v,
    "inf": lambda v, p, x: abs(v) == math.inf,
    "nonfinite": lambda v, p, x: (v != v) | (abs(v) == math.inf),
}


def parse_condition(text: Any) -> Condition:
    """``text`` as a Condition; ArgumentError, listing the accepted forms, when it is none of them."""
    if not isinstance(text, str):
        raise ArgumentError(f"a condition is text such as 'rises above 3.0', not {type(text).__name__}")
    normal = " ".join(text.lower().split())
    for kind, pattern in _FORMS:
        m = re.fullmatch(pattern, normal)
        if m is not None:
            threshold = float(m.group(1)) if m.groups() else math.nan
            if kind in ("change", "change%") and threshold < 0:
                break
            return Condition(text.strip(), kind, threshold)
    raise ArgumentError(f"cannot read the condition {text!r}; write one of {ACCEPTED} (X a number)")


@dataclass
class BisectResult:
    """The first version, oldest first, where the condition held.

    ``value`` is the metric's or statistic's value there and ``previous`` the value before it in the same series
    (None for the first one). For a tensor statistic, ``tensor`` is the first tensor (by name order of the
    pattern's matches) that met the condition, ``tensors`` every one that did at that version. For
    ``nonfinite``, ``value`` counts the NaN and Inf elements of ``tensor``.
    """

    version: str
    step: int | None
    value: float
    previous: float | None
    previous_version: str | None
    what: str                       # the metric's name, or the statistic ("absmax", "nonfinite")
    condition: str
    tensor: str | None = None
    tensors: list[str] = field(default_factory=list)
    checked: int = 0                # versions scanned up to and including this one

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__, found=True)


def first_metric_match(rows: Sequence[dict[str, Any]], metric: str, cond: Condition) -> BisectResult | None:
    """The first of ``rows`` (``repo.metrics`` rows, oldest first) whose ``metric`` meets ``cond``.

    A row that does not record the metric (or records something other than a number) is skipped and is no one's
    previous value.
    """
    previous: float | None = None
    previous_version: str | None = None
    for i, row in enumerate(rows):
        raw = row.get(metric)
        if not is_number(raw):
            continue
        value = float(raw)
        if cond.holds(value, previous):
            return BisectResult(row["version"], row.get("step"), value, previous, previous_version, metric,
                                cond.text, checked=i + 1)
        previous, previous_version = value, row["version"]
    return None


# versions tested at once: a block of a 1,000-tensor matrix and its temporaries stay a few MiB each
_BLOCK = 512


def first_tensor_match(versions: Sequence[str], steps: Sequence[int | None], names: Sequence[str], values: Any,
                       stat: str, cond: Condition) -> BisectResult | None:
    """The first version where a tensor's ``stat`` meets ``cond``; ``values[t][v]`` is the statistic of tensor
    ``names[t]`` at ``versions[v]`` (a stat_matrix: NaN where the tensor is absent, and an absent tensor is
    no one's previous value). Tested with numpy, a block of versions at a time."""
    import numpy as np
    matrix = np.asarray(values, dtype=np.float64).reshape(len(names), len(versions))
    rows = np.arange(len(names))[:, None]
    last = np.full(len(names), -1)   # per tensor, the last version (column) before the block holding it
    for start in range(0, len(versions), _BLOCK):
        block = matrix[:, start:start + _BLOCK]
        present = block == block
        seen = np.where(present, np.arange(start, start + block.shape[1]), -1)
        np.maximum.accumulate(seen, axis=1, out=seen)   # the last column holding the tensor, up to each
        before = np.maximum(np.concatenate([last[:, None], seen[:, :-1]], axis=1), last[:, None])
        previous = np.where(before >= 0, matrix[rows, np.maximum(before, 0)], np.nan)
        with np.errstate(invalid="ignore", over="ignore"):
            hit = present & _TESTS[cond.kind](block, previous, cond.threshold)
        columns = np.flatnonzero(hit.any(axis=0))
        if columns.size:
            j = int(columns[0])
            matched = [int(t) for t in np.flatnonzero(hit[:, j])]
            t, p = matched[0], int(before[matched[0], j])
            return BisectResult(versions[start + j], steps[start + j], float(block[t, j]),
                                None if p < 0 else float(matrix[t, p]), None if p < 0 else versions[p], stat,
                                cond.text, tensor=names[t], tensors=[names[i] for i in matched], checked=start + j + 1)
        last = np.maximum(seen[:, -1], last)
    return None


def first_nonfinite(versions: Sequence[str], steps: Sequence[int | None], names: Sequence[str], nan: Any,
                    inf: Any) -> BisectResult | None:
    """The first version where some tensor holds a NaN or an Inf element: ``nan`` and ``inf`` are the stat
    matrices of their counts (rows by ``names``, columns by ``versions``; NaN where a tensor is absent)."""
    import numpy as np
    counts = np.asarray(nan, dtype=np.float64) + np.asarray(inf, dtype=np.float64)
    return first_tensor_match(versions, steps, names, counts, "nonfinite", NONFINITE)


NONFINITE = Condition("has NaN or Inf", ">", 0.0)


def bisect(plumbing: Plumbing, when: str | None, metric: str | None, tensor: str | None, stat: str,
           nonfinite: bool, rev: str, since: int | None, until: int | None,
           include_nonfloat: bool = False) -> BisectResult | None:
    """``Repository.bisect``: its arguments' combinations checked, then answered from the first-parent history
    of ``rev`` (recorded metrics, or the capture-time statistics of ``stat_matrix``; non-float tensors and
    step counters only with ``include_nonfloat``)."""
    if nonfinite:
        if when is not None or metric is not None:
            raise ArgumentError("nonfinite=True takes no condition and no metric: it looks for NaN and Inf "
                                "elements of tensors (narrow them with tensor=GLOB)")
        pattern = tensor or "*"
        nan = _matrix(plumbing, pattern, "nan", rev, since, until, include_nonfloat)
        inf = _matrix(plumbing, pattern, "inf", rev, since, until, include_nonfloat)
        return first_nonfinite(nan.versions, nan.steps, nan.names, nan.values, inf.values)
    if (metric is None) == (tensor is None):
        raise ArgumentError("bisect needs one of metric= (a recorded metric) or tensor= (a glob, with stat=), "
                            "or nonfinite=True")
    if when is None:
        raise ArgumentError(f"bisect needs a condition (when=): one of {ACCEPTED}")
    cond = parse_condition(when)
    if metric is not None:
        rows = metric_rows(plumbing, plumbing.resolve(rev))
        recorded = sorted({k for r in rows for k in r} - {"version", "step"})
        if metric not in recorded:
            raise ArgumentError(f"no version in the history of {rev} records metric {metric!r}; recorded: "
                                f"{', '.join(recorded) or 'none'}")
        rows = [r for r in rows if in_steps(r["step"], since, until, keep_stepless=True)]
        return first_metric_match(rows, metric, cond)
    if cond.kind == "nan":
        raise ArgumentError("'is nan' is for metrics: a tensor statistic is NaN where the tensor is absent; "
                            "find NaN elements with nonfinite=True (--nonfinite)")
    assert tensor is not None
    m = _matrix(plumbing, tensor, stat, rev, since, until, include_nonfloat)
    return first_tensor_match(m.versions, m.steps, m.names, m.values, stat, cond)


def _matrix(plumbing: Plumbing, pattern: str, stat: str, rev: str, since: int | None, until: int | None,
            include_nonfloat: bool) -> StatMatrix:
    """``stat_matrix`` of ``pattern``, refused in one line when no tensor matches."""
    # numpy: imported when a bisect runs, not with this module
    from ckptrepo.tools._trajectory import stat_matrix
    m = stat_matrix(plumbing, pattern, stat, rev, since, until, include_nonfloat=include_nonfloat)
    if not m.names:
        where = " in the --since/--until range" if since is not None or until is not None else ""
        raise ArgumentError(f"no tensor matches {pattern!r} in the history of {rev}{where}; "
                            f"`ckptrepo show {rev}` lists the names")
    return m


__all__ = ["ACCEPTED", "BisectResult", "Condition", "bisect", "first_metric_match", "first_nonfinite",
           "first_tensor_match", "parse_condition"]
