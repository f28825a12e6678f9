"""The flush stage: each filled staging buffer (or live shard) handed on as one whole shard write.

A local store's shards go to the direct writer's threads (storage/_localwrite.py), any other store's (and
compressed arrays) through TensorStore; a buffer goes back to the pool once its write is over, durable or
failed. What the stage reads of a snapshot is ``FlushJob``; it reports each segment through
``segment_done``, whose last call lets the commit stage go on.
"""
from __future__ import annotations

import errno
import time
from typing import Any, Protocol

import numpy as np
import torch

from ckptrepo import faults
from ckptrepo.errors import CkptRepoError, StorageError, first_line
from ckptrepo.saving._writer import Segment, StagingPool
from ckptrepo.storage import ArrayInfo, DirectWriter, LiveShard, chunk_crcs, create_array
from ckptrepo.storage.protocol import Store


class FlushJob(Protocol):
    """What the flush stage reads and records of one snapshot (saving/_snapshot_job.py's ``SnapshotJob``)."""

    error: BaseException | None
    arrays: dict[str, ArrayInfo]   # dtype -> the array its segments go into
    handles: dict[str, Any]        # dtype -> TensorStore handle, opened at the first segment
    first_write: float

    def record_crcs(self, seg: Any, crcs: np.ndarray) -> None: ...
    def segment_done(self, err: BaseException | None = None) -> None: ...


class FlushStage:
    """Starts segment writes on one store, from the flush thread; their completions run on writer threads."""

    def __init__(self, store: Store, url: str, pool: StagingPool, direct: DirectWriter | None, tier: bool) -> None:
        self.store, self.url, self.pool, self.direct = store, url, pool, direct
        self.tier = tier   # a local tier: a full disk's message names its bounds
        # TensorStore may reference a staging buffer instead of copying it; fine where the store copies the
        # bytes out before the write completes, but a store that keeps the buffer as the stored value would
        # see the pool reuse it for another shard
        self.store_copies = not store.capabilities.keeps_written_buffers

    def run(self, item: tuple[FlushJob, Segment, torch.Tensor, Any, Any]) -> None:
        """Start the write of one segment the capture stage emitted, ``(job, seg, buf, view, event)``: ``view``
        is the filled part of ``buf``, or a ``LiveShard`` (None: capture gave up on it); ``event`` the CUDA copy
        it waits for first."""
        job, seg, buf, view, event = item
        if job.error is not None or view is None:
            self.segment_over(view, buf)
            job.segment_done()
            return
        try:
            if event is not None:
                event.synchronize()
            handle = job.handles.get(seg.dtype)
            if handle is None:
                handle = job.handles[seg.dtype] = create_array(self.store, job.arrays[seg.dtype])
            faults.point("before_shard_write")
            if not job.first_write:
                job.first_write = time.perf_counter()
            # a local store: one whole shard object written directly (storage/_localwrite.py), durable once the
            # future completes, like TensorStore's commit future; otherwise (or for an odd segment) TensorStore
            info = job.arrays[seg.dtype]
            fut: Any   # a concurrent Future from the direct writer, or TensorStore's commit future
            if isinstance(view, LiveShard):
                assert self.direct is not None   # live shards are planned only for a direct writer
                fut = self.direct.submit_live(info, seg.start, view)
            else:
                fut = None if self.direct is None else self.direct.submit(info, seg.start, view)
            if fut is None:
                fut = handle[seg.start:seg.stop].write(
                    view, can_reference_source_data_indefinitely=self.store_copies).commit
                # TensorStore keeps the crc32cs it takes to itself: the chunk table's are taken here, while it
                # writes (the buffer is the segment's until its write is over, and fastcrc lets go of the GIL)
                job.record_crcs(seg, chunk_crcs(info, view))
        except BaseException as err:  # noqa: BLE001
            self.segment_over(view, buf)
            job.segment_done(storage_error(job.arrays[seg.dtype].key, seg, err, self.url, self.tier))
            return

        def written(f: Any, job: FlushJob = job, seg: Segment = seg, buf: torch.Tensor = buf,
                    view: Any = view) -> None:
            self._written(job, seg, buf, view, f)
        fut.add_done_callback(written)

    def segment_over(self, view: Any, buf: torch.Tensor) -> None:
        """A segment's write is over (durable, failed or never started): its buffer goes back to the pool, and a
        live shard lets go of the tensors (nothing reads their memory any more)."""
        if isinstance(view, LiveShard):
            view.finish()   # gives the buffer back, now or once the feed is over too
            return
        self.pool.give(buf)

    def _written(self, job: FlushJob, seg: Segment, buf: torch.Tensor, view: Any, fut: Any) -> None:
        err = None
        try:
            crcs = fut.result()
            if isinstance(crcs, np.ndarray):   # the direct writer's; TensorStore's were taken before its write
                job.record_crcs(seg, crcs)
        except BaseException as e:  # noqa: BLE001
            err = storage_error(job.arrays[seg.dtype].key, seg, e, self.url, self.tier)
        self.segment_over(view, buf)
        if err is None:
            faults.point("after_shard_write")
        job.segment_done(err)


def storage_error(key: str, seg: Segment, err: BaseException, store_url: str, tier: bool) -> BaseException:
    """The error a failed write of ``seg`` of array ``key`` reports: the library's own as it is, a full disk
    with what to free, anything else with the elements it was writing."""
    if isinstance(err, CkptRepoError):
        return err
    reason = first_line(err)
    if disk_full(err):
        what = ("free space there, or keep less here: a lower local_keep_last, or local_max_bytes" if tier
                else "free space there (`ckptrepo gc` deletes old versions)")
        return StorageError(f"the local disk of {store_url} is full (writing {key}: {reason}): {what}")
    return StorageError(f"writing {key} elements [{seg.start}, {seg.stop}) failed: {reason}")


def disk_full(err: BaseException) -> bool:
    """Whether a write failed because its disk is full: ENOSPC from the direct writer, or TensorStore's text
    for it."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "no space left on device" in str(err).lower()


__all__ = ["FlushJob", "FlushStage", "disk_full", "storage_error"]
