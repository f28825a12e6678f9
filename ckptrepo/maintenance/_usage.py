"""Disk usage per version: bytes only it references, bytes it shares with other versions, and the total stored.

A version's tensors are pieces of flat arrays, and a piece may point into an
array another version wrote (dedup). So "the size of a version" has two useful
meanings: what deleting it alone would free (unique) and what it reads that
others read too (shared). Sharing is decided per array: an array that pieces of
two or more versions point into is shared by all of them, even where they use
different parts of it. That is the granularity at which gc deletes data, so the
unique bytes of a version are a good estimate of what pruning it frees.
Pruned versions store nothing and reference nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ckptrepo.core import Plumbing, Version
from ckptrepo.errors import CorruptionError
from ckptrepo.state import numel
from ckptrepo.storage import ArrayInfo, itemsize, layout_bytes, stored_bytes


@dataclass(frozen=True)
class VersionUsage:
    """One version's share of the repository: bytes of its pieces, split by whether other versions use their arrays."""

    version: Version
    unique_bytes: int
    shared_bytes: int

    @property
    def total_bytes(self) -> int:
        """All tensor bytes the version references (unique + shared)."""
        return self.unique_bytes + self.shared_bytes

    def to_json(self) -> dict[str, Any]:
        v = self.version
        return {"id": v.id, "step": v.step, "pruned": v.pruned, "unique_bytes": self.unique_bytes,
                "shared_bytes": self.shared_bytes, "bytes": self.total_bytes}


@dataclass(frozen=True)
class DiskUsage:
    """``du``: one row per version reachable from a ref (newest first) and the bytes stored for all of them."""

    versions: list[VersionUsage]
    total_bytes: int   # tensor bytes of every array referenced by a listed version, counted once
    stored_bytes: int  # what those arrays take in the store: chunk padding, checksums, indexes (arrays.stored_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"versions": [u.to_json() for u in self.versions], "total_bytes": self.total_bytes,
                "stored_bytes": self.stored_bytes}


def disk_usage(plumbing: Plumbing, versions: Sequence[Version]) -> DiskUsage:
    """Unique and shared bytes of each of ``versions`` (those reachable from a ref, newest first, as ``log``
    lists them), and the total stored once."""
    referrers: dict[str, set[str]] = {}            # array key -> versions with a piece in it
    pieces: dict[str, list[tuple[str, int]]] = {}  # version -> (array key, bytes) of each piece
    extent: dict[str, int] = {}                    # array key -> bytes up to the end of its last referenced piece
    infos: dict[str, ArrayInfo] = {}               # array key -> its manifest entry, where a manifest lists it
    for vid, m in plumbing.each_manifest([v.id for v in versions if not v.pruned]):
        infos.update(m.arrays)
        mine = pieces.setdefault(vid, [])
        for t in m.tensors:
            item = itemsize(t.dtype)
            for p in t.pieces:
                n = numel(p.box[1])
                key = p.array
                referrers.setdefault(key, set()).add(vid)
                mine.append((key, n * item))
                extent[key] = max(extent.get(key, 0), (p.offset + n) * item)
    rows = []
    for v in versions:
        unique = shared = 0
        for key, n in pieces.get(v.id, ()):
            if len(referrers[key]) == 1:
                unique += n
            else:
                shared += n
        rows.append(VersionUsage(v, unique, shared))
    total = stored = 0
    for key in referrers:
        info = _array_info(plumbing, key, infos)
        total += info.nbytes if info is not None else extent[key]
        stored += stored_bytes(plumbing.store, key, layout_bytes(info) if info is not None else extent[key])
    return DiskUsage(rows, total, stored)


def _array_info(plumbing: Plumbing, key: str, infos: dict[str, ArrayInfo]) -> ArrayInfo | None:
    """Array ``key`` as a manifest that lists it records it (its own version's, even if that one is pruned or
    unreachable); None when none does: it then counts up to the end of its last referenced piece."""
    info = infos.get(key)
    if info is None:
        owner = key.split("/")[1]
        try:
            info = plumbing.manifest(owner).arrays.get(key)
        except CorruptionError:   # the owner's manifest was collected; its array lives on through the pieces
            info = None
    return info
