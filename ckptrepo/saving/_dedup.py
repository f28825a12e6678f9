"""Dedup: a tensor (or a rank's piece of one) whose bytes did not change since the parent version is not
written again; its piece in the new manifest points at the bytes stored before.

Whether bytes changed is decided by content, not by which process saw them: each piece of a manifest
carries the digest of its stored bytes (saving/_content_hash.py), so a snapshotter compares with the parent
version whoever wrote it: an earlier ``repo.snapshot`` call, another snapshotter, a process before a
restart, this rank before it. Deciding takes two looks, so that the training thread pays almost nothing:
``snapshot()`` compares a cheap key of each live tensor (dtype, shape, stride, storage address, autograd
version counter) with the one recorded at this snapshotter's last commit, which only says which tensors
are worth hashing (all of them for the first snapshot, whose parent was written elsewhere); the capture
thread then reuses a stored piece only when the digest of the current bytes equals the digest of the bytes
stored there (writes through ``.data`` or a numpy view leave the version counter alone). CUDA tensors are
hashed on their device before any copy, so an unchanged one crosses neither PCIe nor the disk.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from ckptrepo.core.schema import STAT_COLUMNS, Manifest
from ckptrepo.errors import StorageError
from ckptrepo.saving._content_hash import WORDSUM, digest_as, wordsum_digests
from ckptrepo.saving._tensor_stats import DeviceStats, HostStats
from ckptrepo.state import TensorRecord
from ckptrepo.storage import ArrayInfo
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:
    from ckptrepo.saving._snapshot_job import SnapshotJob

log = logging.getLogger("ckptrepo")

DedupKey = tuple  # (dtype, shape, stride, data_ptr, autograd version, conj and neg bits) of a live tensor
PieceId = tuple   # (name, offsets, sizes): a tensor, or a piece of a global tensor, as the manifest names it


class StoredTensor(NamedTuple):
    """A piece of the parent version (or of this snapshotter's last commit), and where its bytes are stored.

    ``digest`` is the content digest of exactly the bytes stored at ``array``/``offset`` (None when they were
    not hashed); ``info`` is the array's ArrayInfo JSON, copied into the manifest of every version that reuses
    the piece. ``key`` is None for a piece learnt from a manifest: another process's addresses mean nothing.

    A tuple of plain values (the JSON shared by the array's tensors): the cyclic GC stops tracking such
    tuples at its first look, so the index a snapshotter keeps from one commit to the next does not age
    into the GC's oldest generation and bring on full collections of the training process.
    """

    key: DedupKey | None
    digest: bytes | None
    array: str
    offset: int
    info: dict[str, Any]
    stats: tuple[float, ...] | None = None   # a whole tensor's capture-time statistics (saving/_tensor_stats.py)
    moments: Any = None                      # a sharded piece's Moments.to_raw(), which rank 0 merges


def dedup_key(r: TensorRecord) -> DedupKey | None:
    """What must be unchanged for a tensor to look unchanged; None: never dedup it (empty, or no storage)."""
    t = r.tensor
    if not r.numel or t.device.type not in ("cpu", "cuda"):
        return None
    try:
        version = t._version
    except RuntimeError:   # inference tensors have no version counter: the hash alone decides
        version = -1
    return (r.dtype, tuple(t.shape), tuple(t.stride()), t.data_ptr(), version, t.is_conj(), t.is_neg())


def piece_id(name: str, box: Any) -> PieceId:
    return (name, tuple(box[0]), tuple(box[1]))


def missing_objects(store: Store, array: ArrayInfo) -> list[str]:
    """The objects of ``array`` that are not in ``store`` (gc, prune or a local tier's eviction deleted them)."""
    present = set(store.list(array.key + "/"))
    return [k for k in [f"{array.key}/zarr.json", *(array.shard_key(s) for s in array.shards())] if k not in present]


def seed_from(manifest: Manifest, store: Store, ids: set[PieceId]) -> dict[PieceId, StoredTensor]:
    """The pieces of ``manifest`` among ``ids`` that a new snapshot may point at: those with a digest whose
    array is whole in ``store`` (an evicted or pruned version's data is not), with their recorded statistics.
    Only the arrays of those pieces are listed: a rank never lists the arrays of pieces it does not hold."""
    rows = manifest.tensor_stats.rows() if manifest.tensor_stats is not None else {}
    whole: dict[str, bool] = {}
    out: dict[PieceId, StoredTensor] = {}
    for t in manifest.tensors:
        row = rows.get(t.name)
        stats = None if row is None else tuple(row.get(c, math.nan) for c in STAT_COLUMNS[:-2])   # not the change
        for p in t.pieces:
            pid = piece_id(t.name, p.box)
            if p.digest is None or pid not in ids:
                continue
            if p.array not in whole:
                whole[p.array] = not missing_objects(store, manifest.arrays[p.array])
            if whole[p.array]:
                out[pid] = StoredTensor(None, p.digest, p.array, p.offset, manifest.arrays[p.array].to_json(),
                                        stats if len(t.pieces) == 1 else None)
    return out


class DedupIndex:
    """What the next snapshots compare with: by piece, the pieces of the last committed version.

    Until its first commit a snapshotter compares with the branch tip it starts on (``parent``), read once
    by the capture thread. The dict is replaced whole, never mutated, by the capture or commit thread, so
    the training thread reads it without a lock.
    """

    def __init__(self, parent: str | None = None, read: Callable[[str], Manifest] | None = None,
                 store: Store | None = None) -> None:
        self.stored: dict[PieceId, StoredTensor] = {}
        self._parent, self._read, self._store = parent, read, store
        self.seeded = parent is None

    def match(self, job: "SnapshotJob") -> bool:
        """Training thread: mark the job's tensors worth hashing (new, or with an unchanged key) and those that
        may be reused; returns whether any may be (if not, the job can be planned at once)."""
        stored = self.stored
        for i, key in enumerate(job.keys):
            if key is None:
                continue
            prev = stored.get(job.ids[i])
            if prev is None or prev.key is None or prev.key == key:   # new here, or looks unchanged: worth hashing
                job.watch.add(i)
                if prev is not None:
                    job.match[i] = prev
        # decided in the capture thread: before the first look at the parent, where a stored digest may match,
        # and where a watched CUDA tensor is to be hashed on its device (no staging hasher sees its bytes)
        return bool(job.watch) and (not self.seeded or any(m.digest is not None for m in job.match.values())
                                    or any(job.records[i].tensor.is_cuda for i in job.watch))

    def _seed(self, ids: set[PieceId]) -> None:
        """Capture thread, before the first decision: the parent's pieces among ``ids`` (this rank's). A failure
        to read them only costs this snapshot its dedup: everything is written."""
        self.seeded = True
        if self._parent is None or self._read is None or self._store is None or self.stored:
            return
        try:
            self.stored = seed_from(self._read(self._parent), self._store, ids)
        except Exception as err:  # noqa: BLE001 - a store error here must not fail the snapshot
            log.warning("ckptrepo: dedup could not read parent version %s (%s); this snapshot writes every tensor",
                        self._parent[:12], err)

    def decide(self, job: "SnapshotJob") -> list[int]:
        """Capture thread: reuse the matched pieces whose bytes hash as stored; returns the records to write.
        CUDA tensors are hashed in the current stream, which must follow the training stream's events."""
        if not self.seeded:
            self._seed({job.ids[i] for i in job.watch})
            stored = self.stored
            for i in job.watch:
                prev = stored.get(job.ids[i])
                if prev is not None and i not in job.match:
                    job.match[i] = prev
        # every watched CUDA tensor is hashed on its device: the digest of one that is written goes into the
        # manifest, since no staging hasher sees its bytes
        by_device: dict[Any, list[int]] = {}
        for i in sorted(job.watch):
            if job.records[i].tensor.is_cuda:
                by_device.setdefault(job.records[i].tensor.device, []).append(i)
        for device, cuda in by_device.items():
            with torch.cuda.device(device):
                job.digests.update(zip(cuda, wordsum_digests([job.records[i].tensor for i in cuda])))
        written = []
        for i, r in enumerate(job.records):
            prev = job.match.get(i)
            if prev is not None and prev.digest is not None and prev.info.get("dtype") == r.dtype:
                now = job.digests.get(i) if r.tensor.is_cuda and prev.digest[0] == WORDSUM else \
                    digest_as(prev.digest[0], r.tensor)
                if now == prev.digest:
                    job.reused[i] = prev
                    continue
            written.append(i)
        if job.sharded and job.record_stats:   # rank 0 merges every piece's moments: a reused one's too
            for i, prev in job.reused.items():
                job.reused_moments[i] = prev.moments if prev.moments is not None else moments_of(job.records[i])
        return written

    def check_reused(self, store: Store, job: "SnapshotJob", reused: dict[str, ArrayInfo],
                     announced: bool = False) -> None:
        """Commit thread: ``check_reused_arrays`` for snapshot ``job``; if one is gone, nothing is reused from
        the next snapshot on."""
        try:
            check_reused_arrays(store, job.vid, reused, announced)
        except StorageError:
            self.stored = {}
            raise

    def remember(self, job: "SnapshotJob") -> None:
        """Commit thread, after a commit: this version's pieces become what the next snapshots compare with."""
        assert job.plan is not None
        placement = {ri: pi for pi, ri in enumerate(job.written)}
        infos = {dtype: info.to_json() for dtype, info in job.arrays.items()}
        stored: dict[PieceId, StoredTensor] = {}
        for i, key in enumerate(job.keys):
            if key is None:
                continue
            if i in job.reused:
                prev = job.reused[i]
                stored[job.ids[i]] = prev._replace(key=key, moments=job.reused_moments.get(i, prev.moments))
                continue
            pi = placement[i]
            p = job.plan.placements[pi]
            stored[job.ids[i]] = StoredTensor(key, job.stored_digest(i), job.arrays[p.dtype].key, p.offset,
                                              infos[p.dtype], job.stat_rows.get(i), job.piece_moments.get(pi))
        self.stored = stored


def moments_of(r: TensorRecord) -> Any:
    """The statistics' moments of a reused piece whose moments were not kept (its parent was written by
    another process): from its bytes, which a written piece would have fed anyway."""
    t = r.tensor.detach()
    if t.is_cuda:
        stats: Any = DeviceStats(r.dtype)
        stats.update_device(t.reshape(-1))
    else:
        stats = HostStats(r.dtype)
        stats.update(t.resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8).numpy())
    return stats.moments().to_raw()


def check_reused_arrays(store: Store, vid: str, reused: dict[str, ArrayInfo], announced: bool = False) -> None:
    """The arrays version ``vid`` reuses (``reused``, by key) must still be there: gc deletes an array no kept
    version refers to, and a prune or gc that began before the version's manifest was written never saw it.
    ``announced``: also not listed by a gc or prune under way (its intent), which only the check after the
    manifest needs to see (a prune that starts later reads the manifest and keeps what it reuses)."""
    for key in sorted(reused):
        missing = missing_objects(store, reused[key])
        if missing:
            raise StorageError(f"{missing[0]} was deleted (gc or prune) while version {vid[:12]} was being saved "
                               f"and it reuses those unchanged tensors; save again (the next save writes every "
                               f"tensor), and run gc between saves")
    if not announced:
        return
    from ckptrepo.maintenance import pruning_arrays
    doomed = set(reused) & pruning_arrays(store, time.time())
    if doomed:
        raise StorageError(f"{min(doomed)} is being deleted by a `prune` while version {vid[:12]} reuses its "
                           f"unchanged tensors; save again (the next save writes every tensor)")
