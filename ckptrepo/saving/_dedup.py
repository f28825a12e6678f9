"""Dedup: a tensor whose bytes did not change since the last version a snapshotter committed is not written again.

Its piece in the new manifest points at the bytes the earlier version stored.
Deciding that takes two looks, so that the training thread pays almost
nothing: ``snapshot()`` compares a cheap key of each live CPU tensor (dtype,
shape, stride, storage address, autograd version counter) with the one
recorded at the last commit, which only says which tensors are worth
hashing; the capture thread then reuses a stored piece only when the
xxh3-128 of the current bytes equals the hash of the bytes stored there
(writes through ``.data`` or a numpy view leave the version counter alone).
Single process only: a sharded snapshot always writes everything.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import xxhash

from ckptrepo.errors import StorageError
from ckptrepo.state._providers import TensorRecord
from ckptrepo.storage._arrays import ArrayInfo
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:
    from ckptrepo.saving._snapshot_job import SnapshotJob

DedupKey = tuple  # (dtype, shape, stride, data_ptr, autograd version) of a live CPU tensor


class StoredTensor(NamedTuple):
    """One tensor of the last version a snapshotter committed, and where its bytes are stored.

    ``digest`` is the xxh3-128 of exactly the bytes stored at ``array``/``offset``
    (None when they were not hashed); ``info`` is the array's ArrayInfo JSON,
    copied into the manifest of every version that reuses the piece.

    A tuple of plain values (the JSON shared by the array's tensors): the cyclic GC stops tracking such
    tuples at its first look, so the index a snapshotter keeps from one commit to the next does not age
    into the GC's oldest generation and bring on full collections of the training process.
    """

    key: DedupKey
    digest: int | None
    array: str
    offset: int
    info: dict[str, Any]
    stats: tuple[float, ...] | None = None   # its capture-time statistics (saving/_tensor_stats.py), if taken


def dedup_key(r: TensorRecord) -> DedupKey | None:
    """What must be unchanged for a tensor to be worth hashing; None: never dedup it (CUDA, empty)."""
    t = r.tensor
    if t.device.type != "cpu" or not r.numel:
        return None
    try:
        version = t._version
    except RuntimeError:   # inference tensors have no version counter: the hash alone decides
        version = -1
    return (r.dtype, tuple(t.shape), tuple(t.stride()), t.data_ptr(), version)


def digest(t: torch.Tensor) -> int:
    """xxh3-128 of a CPU tensor's bytes in row-major order (no copy when contiguous).

    ``contiguous()`` after ``reshape``: a strided 1-D view (``x[::2]``) reshapes without a copy but cannot be
    viewed as bytes, which would fail every snapshot after the first that holds one.
    """
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return xxhash.xxh3_128_intdigest(flat.view(torch.uint8).numpy().data)


class DedupIndex:
    """What the next snapshots compare with: the last committed version's tensors, by name.

    The dict is replaced whole, never mutated, by the commit thread, so the
    training thread reads it without a lock.
    """

    def __init__(self) -> None:
        self.stored: dict[str, StoredTensor] = {}

    def match(self, job: "SnapshotJob") -> bool:
        """Training thread: mark the job's tensors worth hashing (new, or with an unchanged key) and those that
        may be reused; returns whether any may be (if not, the job can be planned at once)."""
        stored = self.stored
        for i, key in enumerate(job.keys):
            if key is None:
                continue
            prev = stored.get(job.records[i].name)
            if prev is None or prev.key == key:   # new to this snapshotter, or looks unchanged: worth hashing
                job.watch.add(i)
                if prev is not None:
                    job.match[i] = prev
        return any(m.digest is not None for m in job.match.values())

    @staticmethod
    def decide(job: "SnapshotJob") -> list[int]:
        """Capture thread: reuse the matched tensors whose bytes hash as stored; returns the records to write."""
        written = []
        for i, r in enumerate(job.records):
            prev = job.match.get(i)
            if prev is not None and prev.digest is not None and digest(r.tensor) == prev.digest:
                job.reused[i] = prev
            else:
                written.append(i)
        return written

    def check_reused(self, store: Store, job: "SnapshotJob", announced: bool = False) -> None:
        """Commit thread: the arrays a version reuses must still be there (gc deletes an array no kept version
        refers to); if one is gone, nothing is reused from the next snapshot on. ``announced``: also not listed
        by a gc or prune under way (its intent), which only the check after the manifest needs to see."""
        for key, info in sorted({s.array: s.info for s in job.reused.values()}.items()):
            array = ArrayInfo.from_json(key, info)
            present = set(store.list(key + "/"))
            missing = [k for k in [f"{key}/zarr.json", *(array.shard_key(s) for s in array.shards())]
                       if k not in present]
            if missing:
                self.stored = {}
                raise StorageError(f"{missing[0]} was deleted (gc or prune) while snapshot {job.vid[:12]} was in "
                                   f"flight and this snapshot reuses its unchanged tensors; take the snapshot again "
                                   f"(the next one writes every tensor), and run gc between snapshotter.wait() "
                                   f"and the next snapshot")
        if not announced:
            return
        from ckptrepo.maintenance._gc import pruning_arrays
        doomed = {s.array for s in job.reused.values()} & pruning_arrays(store, time.time())
        if doomed:
            self.stored = {}
            raise StorageError(f"{min(doomed)} is being deleted by a `prune` while snapshot {job.vid[:12]} reuses "
                               f"its unchanged tensors; take the snapshot again (the next one writes every tensor)")

    def remember(self, job: "SnapshotJob") -> None:
        """Commit thread, after a commit: this version's tensors become what the next snapshots compare with."""
        assert job.plan is not None
        placement = {ri: pi for pi, ri in enumerate(job.written)}
        infos = {dtype: info.to_json() for dtype, info in job.arrays.items()}
        stored: dict[str, StoredTensor] = {}
        for i, (r, key) in enumerate(zip(job.records, job.keys)):
            if key is None:
                continue
            if i in job.reused:
                stored[r.name] = job.reused[i]
                continue
            pi = placement[i]
            p, h = job.plan.placements[pi], job.hashers.get(pi)
            stored[r.name] = StoredTensor(key, None if h is None else h.intdigest(), job.arrays[p.dtype].key,
                                          p.offset, infos[p.dtype], job.stat_rows.get(i))
        self.stored = stored
