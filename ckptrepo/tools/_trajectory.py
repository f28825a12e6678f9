"""Trajectories: a statistic of tensors over the first-parent history of a version."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptrepo.core._plumbing import Plumbing
from ckptrepo.errors import ArgumentError
from ckptrepo.tools._inspect import diff_versions, tensor_stats


@dataclass
class TrajectoryPoint:
    """One tensor's value of a metric at one version."""

    version: str
    step: int | None
    name: str
    value: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


METRICS = ("norm", "delta", "relative-change")


def trajectory(plumbing: Plumbing, pattern: str, metric: str = "norm", rev: str = "HEAD", since: int | None = None,
               until: int | None = None) -> list[TrajectoryPoint]:
    """``metric`` of every tensor matching ``pattern`` along the first-parent history of ``rev``, oldest first.

    ``norm`` is ||v_i||; ``delta`` is ||v_i - v_{i-1}|| and ``relative-change``
    ||v_i - v_{i-1}|| / ||v_{i-1}|| against the previous version in the range
    (absent for the first one). Steps outside [since, until] are skipped, and so are versions gc pruned
    (a delta then spans the gap, from the previous kept version).
    Streamed like ``diff``: memory stays bounded.
    """
    if not isinstance(metric, str) or metric not in METRICS:
        raise ArgumentError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")
    from ckptrepo.core._manifest_reads import HeaderWalk
    from ckptrepo.maintenance._gc import pruned_ids
    pruned = pruned_ids(plumbing)   # their data is gone: skipped, and a delta spans the gap to the previous kept one
    chain: list[tuple[str, int | None]] = []   # (version, step), newest first until reversed
    for vid, m in HeaderWalk(plumbing.reads).chain(plumbing.resolve(rev)):
        step = m.step
        if vid in pruned:
            continue
        if (since is None or step is None or step >= since) and (until is None or step is None or step <= until):
            chain.append((vid, step))
    chain.reverse()
    points: list[TrajectoryPoint] = []
    previous: str | None = None
    for vid, step in chain:
        if metric == "norm":
            for s in tensor_stats(plumbing, vid, pattern):
                points.append(TrajectoryPoint(vid, step, s.name, s.norm))
        elif previous is not None:
            for d in diff_versions(plumbing, previous, vid, pattern).tensors:
                if d.status in ("changed", "unchanged"):
                    points.append(TrajectoryPoint(vid, step, d.name, d.l2 if metric == "delta" else d.relative))
        previous = vid
    return points
