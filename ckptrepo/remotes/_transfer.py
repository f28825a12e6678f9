"""Copying versions between two repositories: their arrays, then their manifests, parents first.

What a version consists of is immutable, so a copy never overwrites anything: an array already at the
destination (another version's, shared through dedup, or copied by an earlier interrupted run) is skipped,
and a manifest is created only if absent. Order is what makes an interrupted copy invisible: an array's
``zarr.json`` is written after its shards and chunk table, a manifest after all its arrays, and a version's
parents before it, so the destination never holds a manifest whose data is not all there; refs move last
(the callers'), so nothing half-copied is reachable.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ckptrepo import faults
from ckptrepo.core import PRUNED_PREFIX, VERSIONS_PREFIX
from ckptrepo.core.schema import Manifest, decode_manifest
from ckptrepo.errors import CorruptionError
from ckptrepo.storage import INDEX_ENTRY_BYTES, ZARR_JSON, ZARR_JSON_MAX_BYTES, ArrayInfo, ProbedStore, refuse_past
from ckptrepo.storage.protocol import Store

# Objects copied at once: enough to keep an object store's pipe full, few enough that the shards held in
# memory meanwhile (64 MiB each at most, as this release writes them) stay well under a GiB.
COPY_WORKERS = 8
# What a chunk may take beyond its bytes in a shard: a blosc frame's header and its crc32c, each chunk placed
# on a 4096-byte block (the direct writer's alignment, storage/_localwrite.py), and the index on one too.
_CHUNK_SLACK = 64
_BLOCK = 4096

Progress = Callable[[int, int], None]   # (bytes copied so far, bytes to copy in all)


@dataclass
class CopyTally:
    """What one copy did: versions and arrays created at the destination, bytes moved."""

    versions: list[str] = field(default_factory=list)
    arrays: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n


class VersionCopier:
    """Copies versions from ``src`` to ``dst`` (see the module docstring); one per push or fetch."""

    def __init__(self, src: Store, dst: Store, progress: Progress | None = None) -> None:
        self.src, self.dst = src, dst
        self.progress = progress
        self.tally = CopyTally()
        self.total = 0
        self._present: set[str] = set()   # arrays known to be complete at dst

    def plan_bytes(self, manifests: Iterable[Manifest], with_data: Callable[[str], bool]) -> int:
        """The bytes of the arrays a copy of ``manifests`` would move (those not at dst yet), for progress."""
        seen: set[str] = set()
        total = 0
        for m in manifests:
            if not with_data(m.id):
                continue
            for key, info in m.arrays.items():
                if key not in seen:
                    seen.add(key)
                    if not self._array_at_dst(key):
                        total += info.nbytes
        self.total = total
        return total

    def _array_at_dst(self, key: str) -> bool:
        if key in self._present:
            return True
        if self.dst.exists(f"{key}/zarr.json"):
            self._present.add(key)
            return True
        return False

    def copy_arrays(self, m: Manifest, src: Store | None = None, keys: Iterable[str] | None = None) -> None:
        """Every array ``m`` points into that dst lacks, each completed by its ``zarr.json``; read from ``src``
        (default: the copier's), which for a version evicted here reads through to the remote holding it.

        Only the objects the manifest implies are copied (``array_objects``), each read no further than the
        size its record allows: whatever else the source holds in an array's folder stays there. ``keys``:
        only those of its arrays (a node-local tier's node pushes its own ranks')."""
        src = src or self.src
        for key in sorted(m.arrays if keys is None else set(keys) & set(m.arrays)):
            if self._array_at_dst(key):
                continue
            objects = array_objects(src, m.arrays[key])
            if objects is None:
                raise CorruptionError(f"array {key} of version {m.id[:12]} is not in {src.url} (deleted, or "
                                      f"never written there); run `ckptrepo fsck` on it")
            with ThreadPoolExecutor(COPY_WORKERS) as pool:
                for _ in pool.map(lambda kb: self._copy_object(src, *kb), objects):
                    pass
            self._copy_object(src, f"{key}/{ZARR_JSON}", ZARR_JSON_MAX_BYTES)
            self._present.add(key)
            self.tally.arrays += 1
            faults.point("push_after_array")

    def _copy_object(self, src: Store, key: str, bound: int) -> None:
        value = read_bounded(src, key, bound)
        if value is None:
            raise CorruptionError(f"object {key} vanished from {src.url} while it was copied; is a gc running "
                                  f"there? run the command again")
        self.dst.put(key, value)
        self.tally.add_bytes(len(value))
        if self.progress is not None:
            self.progress(self.tally.bytes, self.total)

    def read_manifests(self, vids: list[str]) -> dict[str, tuple[bytes, Manifest]]:
        """Each version's manifest at src, as stored and decoded (so checked: crc32c, fields), requested
        together: one round trip's latency on an object store, and the bytes a copy writes are the ones
        checked."""
        out = {}
        for vid, raw in zip(vids, self.src.get_many([VERSIONS_PREFIX + v for v in vids])):
            if raw is None:
                raise CorruptionError(f"version {vid[:12]} has no manifest in {self.src.url}; run `ckptrepo fsck` "
                                      f"there")
            out[vid] = (raw, decode_manifest(raw, vid))
        return out

    def copy_manifest(self, vid: str, raw: bytes, pruned: bool = False) -> None:
        """Create ``versions/<vid>`` at dst from src's bytes ``raw`` (unchanged: the crc32c they carry is checked
        by every reader), after a pruned version's marker, so that it never reads there as a version with data."""
        if pruned and self.dst.exists(VERSIONS_PREFIX + vid):
            return   # there already, with its data: a marker would make the remote's gc delete it
        if pruned:
            self.dst.put(PRUNED_PREFIX + vid, b"")
        self.dst.put_if_absent(VERSIONS_PREFIX + vid, raw)
        self.tally.versions.append(vid)
        faults.point("push_after_manifest")


def shard_ceiling(info: ArrayInfo, index: int) -> int:
    """The most bytes shard object ``index`` of a sound array can hold (see ``storage._arrays.shard_floor``)."""
    lo = index * info.shard_elems
    chunks = -(-(min(info.numel, lo + info.shard_elems) - lo) // info.inner_elems)
    slot = -(-(info.inner_bytes + _CHUNK_SLACK) // _BLOCK) * _BLOCK
    return chunks * slot + info.shard_elems // info.inner_elems * INDEX_ENTRY_BYTES + 2 * _BLOCK


def array_objects(src: Store, info: ArrayInfo) -> list[tuple[str, int]] | None:
    """The objects of array ``info`` that ``src`` holds, but its ``zarr.json``, with the most bytes each may hold:
    its chunk table (when the record binds one; a missing one is left to fsck, as a missing shard is) and its
    shards ``c/<i>`` for ``i`` within the declared geometry (a shard of nothing but fill values is not stored).
    None when ``zarr.json`` is absent. Any other key in the folder is no part of the array and is never read: a
    remote cannot make a copy move what no manifest names."""
    from ckptrepo.storage import table_key  # numpy: not for the history commands that import this
    held = set(src.list(f"{info.key}/"))
    if f"{info.key}/{ZARR_JSON}" not in held:
        return None
    table = table_key(info.key)
    out = [(table, 4 * info.chunks)] if info.digest is not None and table in held else []
    shards = info.shards()
    prefix = f"{info.key}/c/"
    for key in sorted(held):
        name = key[len(prefix):] if key.startswith(prefix) else ""
        if name.isascii() and name.isdigit() and str(int(name)) == name and int(name) in shards:
            out.append((key, shard_ceiling(info, int(name))))
    return out


def read_bounded(src: Store, key: str, bound: int) -> bytes | None:
    """The value at ``key`` in ``src`` (None when absent), refused with CorruptionError when it holds more than
    ``bound`` bytes. A local store looks at the file's size before reading it; an object store is asked for the
    byte just past the bound first, so an oversized object is refused without being downloaded."""
    if src.capabilities.file_path(key) is None and not isinstance(src, ProbedStore):
        refuse_past(src, key, bound)
    return src.get(key, bound)
