"""Local retention after a push: the data of older versions that a remote holds is deleted here.

A local tier (a snapshotter with ``push_to`` and ``local_keep_last``) keeps the data of a branch's newest
versions and lets the remote hold the rest. ``evict`` walks the branch's first-parent chain from its tip:
the newest ``keep_last`` versions stay, and so does every version the remote-tracking ref
``refs/remotes/<remote>/<branch>`` does not reach (not on the remote yet: never evicted). Each older version
is evicted, oldest first:

1. its eviction marker ``evicted/<id>`` is written (core/_remotes.py): from then on its loads, diffs and fsck
   read what is missing here from the remote;
2. then each array it points into is deleted, if the version that wrote it is evicted too and no version
   kept here points into it (dedup: a kept version may reuse an evicted version's unchanged tensor), and
   unless the caller protects it (what a snapshotter's next snapshot may reuse). An array's ``zarr.json`` goes
   first, then its shards and chunk table, so a crash midway leaves an array that opens on the remote, never a
   local one with shards missing.

Nothing is deleted on the word of the remote-tracking ref alone: right before its deletes, a pass checks that
the remote is not this repository's own store (core/_same_store.py), that it still holds each version's
manifest and has not pruned it, and that it holds every object of each array deleted here; an array the remote
lacks stays here (``EvictReport.kept``).

Manifests, refs and history stay: only tensor data is deleted. A pass interrupted between its markers and
its deletes is finished by the next one: the walk goes on past evicted versions while they still hold data
here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from ckptrepo import faults
from ckptrepo.arguments import check_whole
from ckptrepo.core import (
    DATA_PREFIX,
    Plumbing,
    evicted_ids,
    gone_there,
    mark_evicted,
    refuse_if_same_store,
    remote_url,
    tracking_tip,
)
from ckptrepo.errors import RefError
from ckptrepo.remotes._remote import version_ids
from ckptrepo.storage.protocol import Store

log = logging.getLogger("ckptrepo")


@dataclass
class EvictReport:
    """What one pass did: the versions it marked evicted, the arrays it deleted here and their bytes, and the
    arrays it kept because the remote lacks some of their objects."""

    evicted: list[str] = field(default_factory=list)
    arrays: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: list[str] = field(default_factory=list)


def evict(plumbing: Plumbing, remote: str, keep_last: int, branch: str | None = None,
          protect: Iterable[str] = ()) -> EvictReport:
    """Delete here the data of ``branch``'s versions (default: the current branch) beyond its newest
    ``keep_last`` that ``remote`` holds (see the module docstring). ``protect``: array keys never deleted."""
    check_whole(keep_last, "keep_last", 1)
    remote_url(plumbing.store, remote)   # an unknown remote: one line naming the ones there are
    if branch is None:
        branch = plumbing.refs.head().branch
        if branch is None:
            raise RefError("HEAD is detached: name the branch whose versions to evict")
    report = EvictReport()
    tip = plumbing.branch_tip(branch)
    on_remote = tracking_tip(plumbing.store, f"{remote}/{branch}")
    if tip is None or on_remote is None:
        return report
    pruned = plumbing.pruned_ids()
    marked = evicted_ids(plumbing.store)
    todo = _candidates(plumbing, tip, on_remote, keep_last, pruned, marked)
    if not todo:
        return report
    there = plumbing.remote_store(remote)
    refuse_if_same_store(plumbing.store, there, remote)   # its config may name this repository since remote add
    # a version the remote's own gc pruned since it was pushed, or that is not there at all: the copy here is
    # the last one
    todo = [vid for vid in todo if gone_there(there, vid) is None]
    if not todo:
        return report
    gone = marked | set(todo)
    kept = sorted(v for v in version_ids(plumbing) if v not in gone and v not in pruned)
    live = set(protect)
    for _, m in plumbing.each_manifest(kept):   # an unreadable manifest raises: what it points into is unknown
        live.update(m.arrays)
    store = plumbing.store
    for vid in todo:   # oldest first, each marked before its deletes: see _candidates for why
        if vid not in marked:
            mark_evicted(store, vid, remote)
            report.evicted.append(vid)
        faults.point("evict_before_delete")
        for key, info in sorted(plumbing.manifest(vid).arrays.items()):
            if key in live or _owner(key) not in gone:
                continue   # a kept version's, protected, or written by a version kept here
            present = store.list(f"{key}/")
            if not present:
                continue   # deleted already (shared by two evicted versions, or by an earlier pass)
            if not _held_there(there, key, present):
                report.kept.append(key)
                log.warning("ckptrepo: array %s stays here: remote %r lacks some of its objects", key, remote)
                continue
            if f"{key}/zarr.json" in present:
                store.delete(f"{key}/zarr.json")
            store.delete_prefix(f"{key}/")
            report.arrays.append(key)
            report.bytes_freed += info.nbytes
    return report


def _held_there(there: Store, key: str, present: list[str]) -> bool:
    """Whether the remote holds every object of array ``key`` that is here (``present``), ``zarr.json``
    included: one listing there."""
    held = set(there.list(f"{key}/"))
    return f"{key}/zarr.json" in held and held.issuperset(present)


def _owner(array_key: str) -> str:
    """The version that wrote an array (``data/<id>/<rank>/<dtype>``)."""
    return array_key.split("/")[1]


def _candidates(plumbing: Plumbing, tip: str, on_remote: str, keep_last: int, pruned: set[str],
                marked: set[str]) -> list[str]:
    """The versions of the first-parent chain from ``tip`` to evict now, oldest first: beyond the newest
    ``keep_last``, reached by ``on_remote``, not pruned. The walk stops at the first one already evicted whose
    data is all gone here: passes evict oldest first, each version's deletes done before the next is marked,
    so every older one was evicted before it (what the remote reaches is closed under parents)."""
    out: list[str] = []
    seen: set[str] = set()
    durable = False
    vid: str | None = tip
    position = 0
    while vid is not None and vid not in seen:
        seen.add(vid)
        durable = durable or vid == on_remote
        if position >= keep_last and durable and vid not in pruned:
            if vid in marked and not plumbing.store.list(f"{DATA_PREFIX}{vid}/"):
                break
            out.append(vid)
        position += 1
        parents = plumbing.header(vid).parents
        vid = parents[0] if parents else None
    return out[::-1]


__all__ = ["EvictReport", "evict"]
