"""Trajectories: a statistic of tensors over the first-parent history of a version.

Answered from the statistics each version recorded while it was captured (``Manifest.tensor_stats``):
one batched read of the manifests, each decoded without its tensor table, and no tensor data. A version
written without them (an older release, or the DCP and Megatron-core adapters)
falls back to reading its data, as ``stats`` and ``diff`` do; so does a change from the previous version
that capture did not measure. Torch is imported only for those fallbacks: a trajectory over recorded
versions stays a sub-second command.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ckptrepo.core import HEADER_BATCH, VERSIONS_PREFIX, Plumbing, first_parents, in_steps, missing_manifest
from ckptrepo.core.schema import (
    STAT_COLUMNS,
    ManifestHeader,
    TensorStatsRecord,
    decode_header,
    decode_header_and_stats,
)
from ckptrepo.errors import ArgumentError, CkptRepoError
from ckptrepo.tools._numeric import NONFLOAT_HINT, is_numeric

METRICS = STAT_COLUMNS   # norm, mean, std, min, max, absmax, nan, inf, delta, relative-change
CHANGE_METRICS = ("delta", "relative-change")


@dataclass
class TrajectoryPoint:
    """One tensor's value of a metric at one version."""

    version: str
    step: int | None
    name: str
    value: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StatMatrix:
    """One statistic of many tensors over many versions: ``values[i, j]`` is tensor ``names[i]`` at version
    ``versions[j]`` (oldest first); ``present[i, j]`` is False where the tensor has no value there (absent from
    that version, or a change with no previous version to measure from)."""

    versions: list[str]
    steps: list[int | None]
    names: list[str]
    values: np.ndarray
    present: np.ndarray
    stat: str = "norm"
    recorded: int = 0        # versions answered from capture-time records, without reading tensor data
    read: list[str] = field(default_factory=list)   # versions whose tensor data had to be read

    def to_json(self) -> dict[str, Any]:
        rows = [[None if not p or math.isnan(v) else float(v) for v, p in zip(vals, pres)]
                for vals, pres in zip(self.values.tolist(), self.present.tolist())]
        return {"stat": self.stat, "versions": self.versions, "steps": self.steps, "names": self.names,
                "values": rows}


def check_metric(metric: Any) -> str:
    if not isinstance(metric, str) or metric not in METRICS:
        raise ArgumentError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")
    return metric


def walk(plumbing: Plumbing, rev: str,
         records: bool = True) -> Iterator[tuple[str, ManifestHeader, TensorStatsRecord | None]]:
    """``rev`` and its first parents, newest first, each with its header and capture-time statistics (None
    with ``records=False``: the headers alone are decoded), every manifest read once: ``HEADER_BATCH`` per
    round trip, in the creation-time order a linear history follows (one listing of the versions), and
    decoded without its tensor table."""
    reads = plumbing.reads
    order: list[str] = []
    where: dict[str, int] = {}
    pending: dict[str, tuple[ManifestHeader, TensorStatsRecord | None]] = {}
    seen: set[str] = set()

    def visit(vid: str) -> tuple[ManifestHeader, TensorStatsRecord | None]:
        seen.add(vid)
        got = pending.pop(vid, None)
        if got is not None:
            return got
        if not order:
            order.extend(reads.newest_first())
            where.update((v, i) for i, v in enumerate(order))
        at = where.get(vid)
        batch = [vid] if at is None else \
            [vid] + [v for v in order[at + 1:at + HEADER_BATCH] if v not in seen and v not in pending]
        for v, raw in zip(batch, plumbing.store.get_many([VERSIONS_PREFIX + v for v in batch])):
            if raw is None:
                if v == vid:
                    raise missing_manifest(vid)
                continue
            try:
                pending[v] = decode_header_and_stats(raw, v) if records else (decode_header(raw, v), None)
            except CkptRepoError:
                if v == vid:
                    raise
        return pending.pop(vid)

    return first_parents(plumbing.resolve(rev), visit)


def sample(n: int, most: int | None) -> list[int]:
    """Up to ``most`` indices of ``range(n)``, evenly spread, the last always among them."""
    if most is None or n <= most:
        return list(range(n))
    if most <= 1:
        return [n - 1]
    return sorted({round(k * (n - 1) / (most - 1)) for k in range(most)})


class _Matcher:
    """Which of a record's names match the glob: decided once per distinct list of names."""

    def __init__(self, pattern: str | None) -> None:
        self.pattern = pattern
        self._seen: dict[tuple[str, ...], list[int]] = {}

    def rows(self, names: tuple[str, ...]) -> list[int]:
        hit = self._seen.get(names)
        if hit is None:
            p = self.pattern
            hit = self._seen[names] = [i for i, n in enumerate(names) if p is None or fnmatch.fnmatchcase(n, p)]
        return hit

    def match(self, name: str) -> bool:
        return self.pattern is None or fnmatch.fnmatchcase(name, self.pattern)


def stat_matrix(plumbing: Plumbing, pattern: str | None, stat: str = "norm", rev: str = "HEAD",
                since: int | None = None, until: int | None = None, max_versions: int | None = None,
                include_nonfloat: bool = False) -> StatMatrix:
    """``stat`` of every tensor matching ``pattern`` along the first-parent history of ``rev`` (see StatMatrix).

    Versions gc pruned are skipped (their data is gone). ``delta`` (||v_i - v_{i-1}||) and
    ``relative-change`` (that over ||v_{i-1}||) are against the previous version of the range; the first
    has none. ``max_versions`` samples the history evenly, the newest kept: the walk decodes every header,
    and only the sampled versions' statistics (and, for a change capture did not measure, their data).
    A glob that matches no tensor of any version of the range is an ArgumentError; one that matches but
    has no value (a change over a single version) gives an empty matrix. Non-float tensors and step counters
    (tools/_numeric.py) are left out unless ``include_nonfloat``; a glob that matches only those is an
    ArgumentError that says so.
    """
    check_metric(stat)
    pruned = plumbing.pruned_ids()
    matcher = _Matcher(pattern)
    matched = False   # a record of the range names a matching tensor
    # (version, step, first parent, the record's answer or None), newest first
    chain: list[tuple[str, int | None, str | None, dict[str, float] | None]] = []
    for vid, h, record in walk(plumbing, rev, records=max_versions is None):
        if vid in pruned or not in_steps(h.step, since, until, keep_stepless=True):
            continue
        answer = _from_record(record, stat, matcher) if record is not None else None
        matched = matched or (record is not None and bool(matcher.rows(record.names)))
        chain.append((vid, h.step, h.parents[0] if h.parents else None, answer))
    chain.reverse()
    picked = sample(len(chain), max_versions)
    if max_versions is not None:
        sampled = [chain[k][0] for k in picked]
        answers = {v: _from_record(r, stat, matcher) for v, r in plumbing.reads.stat_records(sampled)}
        chain = [(v, step, parent, answers.get(v)) if v in answers else (v, step, parent, None)
                 for v, step, parent, _ in chain]
    out = StatMatrix([chain[k][0] for k in picked], [chain[k][1] for k in picked], [], np.empty((0, 0)),
                     np.empty((0, 0), bool), stat)
    columns: list[dict[str, float]] = []
    for k in picked:
        vid, _, parent, column = chain[k]
        previous = chain[k - 1][0] if k else None
        if stat in CHANGE_METRICS and column is not None and previous != parent:
            column = None   # measured against a parent that is not the previous version of the range
        if stat in CHANGE_METRICS and previous is None:
            column = {}
        if column is None:
            column = _from_data(plumbing, vid, previous, stat, pattern)
            out.read.append(vid)
        else:
            out.recorded += 1
        columns.append(column)
    index: dict[str, int] = {}
    for column in columns:
        for name in column:
            index.setdefault(name, len(index))
    if not include_nonfloat and index:
        left_out = _not_numeric(plumbing, [vid for vid, *_ in chain[::-1]], list(index))
        if left_out and len(left_out) == len(index):
            shown = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
            raise ArgumentError(f"{pattern or '*'!r} matches only non-float tensors or step counters ({shown}), "
                                f"which numeric views leave out; {NONFLOAT_HINT}")
        dropped = set(left_out)
        index = {name: i for i, name in enumerate(n for n in index if n not in dropped)}
    out.names = list(index)
    out.values = np.full((len(index), len(columns)), np.nan)
    out.present = np.zeros((len(index), len(columns)), bool)
    for j, column in enumerate(columns):
        for name, value in column.items():
            if name in index:
                out.values[index[name], j] = value
                out.present[index[name], j] = True
    if chain and not out.names and not matched and not any(
            matcher.match(t.name) for vid, *_ in chain for t in plumbing.manifest(vid).tensors):
        raise ArgumentError(f"no tensor matches {pattern!r} in the history of {rev}; "
                            f"`ckptrepo show {rev}` lists the tensors")
    return out


def _not_numeric(plumbing: Plumbing, newest_first: list[str], names: list[str]) -> list[str]:
    """Those of ``names`` that are non-float tensors or step counters, by the tensor table of the newest
    version of ``newest_first`` that holds each: one manifest decoded where the names stay the same."""
    unknown = set(names)
    numeric: dict[str, bool] = {}
    for vid in newest_first:
        for t in plumbing.manifest(vid).tensors:
            if t.name in unknown:
                unknown.discard(t.name)
                numeric[t.name] = is_numeric(t.name, t.dtype, t.numel)
        if not unknown:
            break
    return [n for n in names if not numeric.get(n, True)]


def _from_record(record: TensorStatsRecord | None, stat: str, matcher: _Matcher) -> dict[str, float] | None:
    """The matching tensors' ``stat`` from a capture-time record; None when it cannot answer (no record, or a
    change from the parent it did not measure: NaN there)."""
    if record is None:
        return None
    values = record.column(stat)
    out = {record.names[i]: values[i] for i in matcher.rows(record.names)}
    if stat in CHANGE_METRICS and any(math.isnan(v) for v in out.values()):
        return None
    return out


def _from_data(plumbing: Plumbing, vid: str, previous: str | None, stat: str, pattern: str | None) -> dict[str, float]:
    from ckptrepo.tools._inspect import diff_versions, tensor_stats
    if stat in CHANGE_METRICS:
        if previous is None:
            return {}
        return {d.name: d.l2 if stat == "delta" else d.relative
                for d in diff_versions(plumbing, previous, vid, pattern, include_nonfloat=True).tensors
                if d.status in ("changed", "unchanged")}
    return {s.name: float(getattr(s, stat)) for s in tensor_stats(plumbing, vid, pattern)}


def trajectory(plumbing: Plumbing, pattern: str, metric: str = "norm", rev: str = "HEAD", since: int | None = None,
               until: int | None = None, include_nonfloat: bool = False) -> list[TrajectoryPoint]:
    """``metric`` of every tensor matching ``pattern`` along the first-parent history of ``rev``, oldest first
    (``stat_matrix``, one point per tensor present in a version)."""
    check_metric(metric)
    m = stat_matrix(plumbing, pattern, metric, rev, since, until, include_nonfloat=include_nonfloat)
    points = []
    for j, (vid, step) in enumerate(zip(m.versions, m.steps)):
        for i, name in enumerate(m.names):
            if m.present[i, j]:
                points.append(TrajectoryPoint(vid, step, name, float(m.values[i, j])))
    return points
