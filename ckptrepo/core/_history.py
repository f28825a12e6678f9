"""History walks over version headers: ``log``'s newest-first walk and the first-parent chain of a revision.

Both read headers only (``HeaderWalk``: batched on object stores once a walk proves long), never tensor data,
so they stay as light as ``log`` must be (decisions/032). A version ``fsck --repair`` marked lost ends a walk
where its manifest is gone; any other missing manifest is damage and raised.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

from ckptrepo.core._manifest import LOST_PREFIX, VERSIONS_PREFIX, Version
from ckptrepo.core._manifest_reads import HEADER_BATCH, HeaderWalk, find_cycle, parent_cycle_error
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core._remotes import evicted_ids, tracking_refs
from ckptrepo.core._whereabouts import durability
from ckptrepo.core.schema import ManifestHeader, version_from_manifest
from ckptrepo.errors import CorruptionError


def header_unless_lost(walk: Callable[[str], ManifestHeader], plumbing: Plumbing, vid: str) -> ManifestHeader | None:
    """``walk(vid)``, or None when ``vid`` has no manifest and is marked lost (``log`` ends there); only a read
    that failed looks for the marker."""
    try:
        return walk(vid)
    except CorruptionError:
        if plumbing.store.exists(LOST_PREFIX + vid) and not plumbing.store.exists(VERSIONS_PREFIX + vid):
            return None
        raise


def every_ref_target(plumbing: Plumbing, strict: bool = False) -> list[str]:
    """The versions every branch, tag, detached HEAD and remote-tracking ref point at: what ``log --all``
    starts from (as git's ``--all``), and what gc and fsck reach from (as in git, what was last pushed or
    fetched stays until its tracking ref moves, even after its local branch is deleted).

    Not ``strict`` (log), a damaged branch or tag is left out, as git's "ignoring broken ref", and a HEAD
    whose branch is damaged or lost raises. ``strict`` (gc, fsck), a damaged branch or tag raises: gc must not
    collect what it might point at; HEAD counts by the version it names, its branch's damage being the
    branch read's to raise."""
    refs = plumbing.refs
    starts = list(refs.branches(strict=strict).values()) + list(refs.tags(strict=strict).values())
    head = refs.head().version if strict else plumbing.head_version()
    if head:
        starts.append(head)
    return starts + list(tracking_refs(plumbing.store).values())


def in_steps(step: int | None, since: int | None, until: int | None, keep_stepless: bool = False) -> bool:
    """Whether a version's ``step`` lies in [since, until] (inclusive; no bound: every version, stepless too).
    A version with no step is out of a bounded range, as ``log --since`` lists only versions it can place, unless
    ``keep_stepless``: ``trajectory`` and ``bisect`` keep it, the history they follow running through it."""
    if step is None:
        return keep_stepless or (since is None and until is None)
    return (since is None or step >= since) and (until is None or step <= until)


def log_headers(plumbing: Plumbing, starts: Sequence[str], limit: int | None = None, since: int | None = None,
                until: int | None = None) -> tuple[list[ManifestHeader], HeaderWalk]:
    """The headers of the versions reachable from ``starts``, newest first, in the step range, at most ``limit``;
    with the walk that read them (its cache serves the durability check after it).

    Newest first, as git does: pop the newest version reached so far, then reach its parents; a version is
    never newer than its children, so the walk stops once ``limit`` versions are listed. A parent cycle is
    raised as damage: the ``seen`` set would stop the walk going round, and list a damaged history as whole.
    """
    seen: set[str] = set()
    frontier: list[tuple[float, str, ManifestHeader]] = []
    found: list[ManifestHeader] = []
    expanded: dict[str, tuple[str, ...]] = {}   # the versions whose parents the walk reached: checked for a cycle
    # a long log reads its headers in batches from the start; a short one (`log -n 5`) never lists versions/
    walk = HeaderWalk(plumbing.reads, batch=limit is None or limit > HEADER_BATCH)

    def reach(vid: str) -> None:
        if vid not in seen:
            seen.add(vid)
            h = header_unless_lost(walk, plumbing, vid)   # None: fsck --repair marked it lost
            if h is not None:
                heapq.heappush(frontier, (-h.time, vid, h))
    for vid in starts:
        if vid:
            reach(vid)
    while frontier and (limit is None or len(found) < limit):
        _, popped, h = heapq.heappop(frontier)
        if in_steps(h.step, since, until):
            found.append(h)
            if limit is not None and len(found) >= limit:
                break   # its parents are not listed: do not read them
        expanded[popped] = h.parents
        for p in h.parents:
            reach(p)
    cycle = find_cycle(expanded)
    if cycle is not None:
        raise parent_cycle_error(cycle)
    return found, walk


def log_versions(plumbing: Plumbing, starts: Sequence[str], limit: int | None = None, since: int | None = None,
                 until: int | None = None) -> list[Version]:
    """``log_headers`` as ``log`` lists them: each version with its refs and where its data is durable."""
    found, walk = log_headers(plumbing, starts, limit, since, until)
    names = plumbing.ref_names()
    evicted = evicted_ids(plumbing.store) if found else set()
    pruned, held = durability(plumbing, found, walk, plumbing.pruned_ids(), evicted)
    return [version_from_manifest(h, names.get(h.id, ()), h.id in pruned, h.id in evicted, held.get(h.id, ()))
            for h in found]


def first_parent_headers(plumbing: Plumbing, vid: str) -> list[tuple[str, ManifestHeader]]:
    """(id, header) along the first-parent history of ``vid``, oldest first: headers only, no tensor data."""
    return list(HeaderWalk(plumbing.reads).chain(vid))[::-1]


def metric_rows(plumbing: Plumbing, vid: str) -> list[dict[str, Any]]:
    """The recorded metrics per version along the first-parent history of ``vid``, oldest first, each row with
    its ``version`` and ``step``."""
    return [{"version": v, "step": h.step, **h.metrics} for v, h in first_parent_headers(plumbing, vid)]


__all__ = ["every_ref_target", "first_parent_headers", "header_unless_lost", "in_steps", "log_headers",
           "log_versions", "metric_rows"]
