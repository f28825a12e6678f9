"""What the web page's JSON endpoints answer: library calls turned into plain, strictly JSON values.

Each function takes the open Repository and the query's arguments, and returns a dict that ``json.dumps``
writes with ``allow_nan=False``: a missing value is ``null``, an infinity the largest float, so every browser's
``JSON.parse`` reads it. Large histories are cut down here, on the server, so the page stays responsive at
10,000 versions and 1,000 tensors: the graph is limited to the newest versions, metric curves are sampled
keeping each bucket's extremes, and the heatmap samples its columns (``stat_matrix(max_versions=...)``) and
folds its rows into module prefixes when there are too many to show one per line.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ckptrepo.errors import ArgumentError

if TYPE_CHECKING:
    import numpy as np

    from ckptrepo.core import Version
    from ckptrepo.repository import Repository

BIG = 1.7976931348623157e308   # an infinity as JSON can carry it: the hottest colour, the top of a plot
MESSAGE_CHARS = 200            # of a version's message in the graph; the detail view has all of it


def finite(value: Any) -> Any:
    """``value`` with NaN as None and infinities as the largest float (JSON has neither), nested."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else math.copysign(BIG, value)
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def has_versions(repo: Repository, rev: str) -> bool:
    """False only for HEAD of a repository (or orphan branch) with no versions yet: the page shows it empty."""
    return not (rev == "HEAD" and repo.head_version() is None)


# ---- /api/info ------------------------------------------------------------------------------------------------
def info(repo: Repository, rev: str) -> dict[str, Any]:
    from ckptrepo.tools import METRICS
    head = repo.head_version()
    return {"url": repo.url, "rev": rev, "head": head, "branch": repo.current_branch(),
            "branches": repo.branches(), "tags": repo.tags(), "stats": list(METRICS)}


# ---- /api/graph -----------------------------------------------------------------------------------------------
def _version_brief(v: Version) -> dict[str, Any]:
    message = v.message.splitlines()[0] if v.message else ""
    return {"id": v.id, "short": v.short_id, "parents": list(v.parents), "step": v.step, "time": v.time,
            "message": message[:MESSAGE_CHARS], "metrics": v.metrics, "refs": list(v.refs), "pruned": v.pruned}


def graph(repo: Repository, rev: str, all_refs: bool, limit: int) -> dict[str, Any]:
    """The rows of ``log --graph`` (``--all`` by default), newest first, at most ``limit`` versions: each row
    is the drawing on its left (``prefix``) and its version, or None for a line that only joins columns."""
    from ckptrepo.tools import graph as graph_rows
    versions = repo.log(rev, all=all_refs, limit=limit + 1) if all_refs or has_versions(repo, rev) else []
    truncated = len(versions) > limit
    rows = graph_rows(versions[:limit])
    return finite({"rev": rev, "all": all_refs, "limit": limit, "truncated": truncated,
                   "versions": sum(r.version is not None for r in rows),
                   "rows": [{"prefix": r.prefix, "version": None if r.version is None else _version_brief(r.version)}
                            for r in rows]})


# ---- /api/metrics ---------------------------------------------------------------------------------------------
def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample_indices(series: Sequence[Sequence[float | None]], n: int, max_points: int) -> list[int]:
    """At most about ``max_points`` of the indices ``0..n-1``: per bucket of consecutive indices the first one and,
    of each series, the index of its smallest and of its largest value, so that a spike survives the sampling
    (an even stride would step over it); the last index is always kept."""
    if n <= max_points:
        return list(range(n))
    per_bucket = 1 + 2 * len(series)
    buckets = max(1, max_points // per_bucket)
    keep = {n - 1}
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        keep.add(lo)
        for values in series:
            present = [(v, i) for i, v in enumerate(values[lo:hi], start=lo) if v is not None and v == v]
            if present:
                keep.add(min(present)[1])
                keep.add(max(present)[1])
    return sorted(keep)


def metrics(repo: Repository, rev: str, max_points: int) -> dict[str, Any]:
    """The numeric metrics along the first-parent history of ``rev``, oldest first, as aligned columns (None
    where a version did not record a metric). ``x`` is the step when every version has one and steps never go
    back, else the position in the history, so a plot's x axis always rises."""
    rows = repo.metrics(rev) if has_versions(repo, rev) else []
    names = list(dict.fromkeys(k for r in rows for k, v in r.items() if k not in ("version", "step") and _numeric(v)))
    columns = {name: [float(r[name]) if _numeric(r.get(name)) else None for r in rows] for name in names}
    steps = [r["step"] for r in rows]
    by_step = all(s is not None for s in steps) and all(a <= b for a, b in zip(steps, steps[1:]))
    keep = sample_indices(list(columns.values()), len(rows), max_points)
    return finite({"rev": rev, "total": len(rows), "sampled": len(keep) < len(rows),
                   "x_label": "step" if by_step else "version (oldest first)",
                   "x": [steps[i] if by_step else i for i in keep],
                   "versions": [rows[i]["version"] for i in keep], "steps": [steps[i] for i in keep],
                   "series": {name: [values[i] for i in keep] for name, values in columns.items()}})


# ---- /api/heatmap ---------------------------------------------------------------------------------------------
# How the tensors folded into one row combine, per statistic: a norm is the norm of the concatenation (root sum
# of squares), counts add up, a minimum stays the smallest and a mean is the mean of the means; everything else
# (max, absmax, std, relative change) shows the group's largest, so one tensor that blows up colours its row.
AGGREGATE = {"norm": "rss", "delta": "rss", "nan": "sum", "inf": "sum", "min": "min", "mean": "mean"}
_SEPARATORS = re.compile(r"[./]")


def _prefix(name: str, depth: int) -> str:
    """The first ``depth`` components of a tensor name, separators kept (``model/blocks.0`` of
    ``model/blocks.0.attn.weight`` at depth 3); the whole name when it has no more."""
    cuts = [m.start() for m in _SEPARATORS.finditer(name)]
    return name if depth > len(cuts) else name[:cuts[depth - 1]]


def group_rows(names: Sequence[str], max_rows: int) -> list[tuple[str, list[int]]]:
    """``names`` as at most ``max_rows`` groups of row indices, ordered by their first name: one per name when
    they fit, else folded by module prefix: the longest prefix length (``model``, then ``model/layers.3``, ...)
    whose groups still fit, the same for every name, so rows read alike (every layer one row, not the first
    layers in detail and the last folded). When even the first components are too many, runs of neighbouring
    names are folded instead."""
    if len(names) <= max_rows:
        return [(n, [i]) for i, n in enumerate(names)]

    def split(depth: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            out.setdefault(_prefix(n, depth), []).append(i)
        return out

    groups = split(1)
    if len(groups) > max_rows:
        size = math.ceil(len(names) / max_rows)
        return [(f"{names[lo]} … ({min(lo + size, len(names)) - lo} tensors)",
                 list(range(lo, min(lo + size, len(names))))) for lo in range(0, len(names), size)]
    deepest = max(len(_SEPARATORS.findall(n)) for n in names) + 1
    for depth in range(2, deepest + 1):   # the number of groups only grows with the depth
        deeper = split(depth)
        if len(deeper) > max_rows:
            break
        groups = deeper
    return [(_label(key, [names[i] for i in idx]), idx) for key, idx in groups.items()]


def _label(prefix: str, members: Sequence[str]) -> str:
    """A row's label: its one tensor's name, or the prefix and the separator after it, then ``*``."""
    if len(members) == 1:
        return members[0]
    first = members[0]
    return f"{prefix}{first[len(prefix)] if len(first) > len(prefix) else ''}*"


def _combine(how: str) -> Callable[[np.ndarray], np.ndarray]:
    import numpy as np

    def rss(block: np.ndarray) -> np.ndarray:
        return np.sqrt(np.nansum(np.square(block), axis=0))

    reducers: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "rss": rss, "sum": lambda b: np.nansum(b, axis=0), "min": lambda b: np.nanmin(b, axis=0),
        "mean": lambda b: np.nanmean(b, axis=0), "max": lambda b: np.nanmax(b, axis=0)}
    return reducers[how]


def aggregate(values: np.ndarray, groups: Sequence[tuple[str, list[int]]], stat: str) -> np.ndarray:
    """One row per group of ``values`` (tensors x versions), combined as AGGREGATE says for ``stat``; NaN where
    no tensor of the group is in that version."""
    import numpy as np
    reduce = _combine(AGGREGATE.get(stat, "max"))
    out = np.full((len(groups), values.shape[1]), np.nan)
    with warnings.catch_warnings():   # an all-NaN column (the group absent from a version) is NaN, as wanted
        warnings.simplefilter("ignore", RuntimeWarning)
        for r, (_, idx) in enumerate(groups):
            block = values[idx]
            absent = np.isnan(block).all(axis=0)
            row = reduce(block) if len(idx) > 1 else block[0]
            out[r] = np.where(absent, np.nan, row)
    return out


NO_FINITE = "nan"   # a cell whose statistic has no value although the tensor is there: none of its values is finite


def _cell(x: float, present: bool) -> float | str | None:
    """A heatmap value for JSON: None where the tensor is absent, NO_FINITE where it is present but its
    statistic is NaN (every value NaN or Inf: the blow-up the page must show), else 6 significant digits,
    all a colour can show."""
    if not present:
        return None
    if x != x:
        return NO_FINITE
    if not math.isfinite(x):
        return math.copysign(BIG, x)
    return float(f"{x:.6g}")


def heatmap(repo: Repository, rev: str, stat: str, pattern: str, max_versions: int, max_rows: int,
            since: int | None = None, until: int | None = None, include_nonfloat: bool = False) -> dict[str, Any]:
    """``stat`` of every tensor matching ``pattern`` (rows) at each version of the first-parent history of ``rev``
    (columns, oldest first), sampled to ``max_versions`` columns and folded to ``max_rows`` rows; non-float
    tensors and step counters only with ``include_nonfloat`` (their bytes would set the colour scale)."""
    import numpy as np

    from ckptrepo.tools import METRICS
    if stat not in METRICS:
        raise ArgumentError(f"unknown stat {stat!r}; use one of {', '.join(METRICS)}")
    empty = {"rev": rev, "stat": stat, "pattern": pattern, "versions": [], "steps": [], "rows": [], "values": [],
             "tensors": 0, "aggregated": None}
    if not has_versions(repo, rev):
        return empty
    m = repo.stat_matrix(pattern, stat=stat, rev=rev, since=since, until=until, max_versions=max_versions,
                         include_nonfloat=include_nonfloat)
    groups = group_rows(m.names, max_rows)
    folded = len(groups) < len(m.names)
    values, present = m.values, m.present
    if folded:   # a group with one tensor of no finite value shows it, whatever the others are
        broken = present & np.isnan(values)
        values = aggregate(np.where(present, values, np.nan), groups, stat)
        present = np.array([present[idx].any(axis=0) for _, idx in groups]).reshape(values.shape)
        values[np.array([broken[idx].any(axis=0) for _, idx in groups]).reshape(values.shape)] = np.nan
    cells = [[_cell(x, p) for x, p in zip(row, here)] for row, here in zip(values.tolist(), present.tolist())]
    return dict(empty, versions=list(m.versions), steps=list(m.steps), tensors=len(m.names),
                aggregated=AGGREGATE.get(stat, "max") if folded else None,
                rows=[{"name": label, "tensors": len(idx)} for label, idx in groups], values=cells)


# ---- /api/version/<rev> and /api/diff/<rev> -------------------------------------------------------------------
def version(repo: Repository, rev: str) -> dict[str, Any]:
    """What ``show`` and ``stats`` say of one version: its header, layout, plain values, and each tensor with
    its statistics (None for a version gc pruned: its data is gone)."""
    d = repo.show(rev)
    v = d.version
    stats = {} if v.pruned else {s.name: s.to_json() for s in repo.stats(v.id)}
    tensors = [dict(t, **{k: x for k, x in stats.get(t["name"], {}).items() if k not in t}) for t in d.tensors]
    # the snapshot's timings as log --stats shows them (lost_s: what the loop lost; absent from older versions)
    return finite({"version": dict(v.to_json(), short=v.short_id), "layout": d.layout, "tensors": tensors,
                   "objects": [{"path": p, "value": val} for p, val in d.objects], "stats": bool(stats),
                   "capture": repo.capture_stats(v.id)})


def diff(repo: Repository, rev: str, against: str | None, include_nonfloat: bool = False) -> dict[str, Any]:
    """The diff of ``rev`` against ``against`` (default: its first parent), per tensor and per module prefix;
    ``a`` is None for a root version compared with nothing. Non-float tensors and step counters are listed,
    changed or unchanged, with numbers only with ``include_nonfloat``."""
    v = repo.version(rev)
    if against is None and not v.parents:
        return {"a": None, "b": v.id, "root": True, "tensors": [], "objects": [], "prefixes": []}
    d = repo.diff(v.id, include_nonfloat=include_nonfloat) if against is None else \
        repo.diff(against, v.id, include_nonfloat=include_nonfloat)
    return finite(dict(d.to_json(), root=False, prefixes=d.by_prefix()))
