"""The capture stage: a snapshot's tensor bytes into staging buffers, segment by segment, for the flush stage.

Runs on the capture thread, one snapshot at a time. Each segment of the plan gets a buffer from the bounded
pool (an empty pool makes capture wait: backpressure, so host memory stays bounded) and is queued for the
flush stage through ``emit``:

* CUDA: copies on a side stream ordered after the training stream by the snapshot's events
  (saving/_device_copies.py), with the hashes and statistics taken there too;
* a CPU state bound for a local store with ``O_DIRECT``: each segment becomes a ``LiveShard`` whose whole
  inner chunks are written from the tensors' own memory, only the chunks at tensor edges copied
  (``fill_live``); once every segment is queued, the bytes are fed to the hashes and statistics
  (``feed_live``), and ``release`` (the pre-step hook) copies whatever the writers or that feed have not
  read yet;
* otherwise a plain copy that feeds the hashes and statistics as it goes (``fill_segment``).

What the stage reads and updates of a snapshot is ``CaptureJob``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ckptrepo import faults
from ckptrepo.parallel import fingerprints
from ckptrepo.saving._device_copies import DeviceCopies
from ckptrepo.saving._gil import quick_gil_handoffs
from ckptrepo.saving._snapshot_job import SnapshotHandle
from ckptrepo.saving._waiting import interrupts_deferred
from ckptrepo.saving._writer import FEED_CHUNKS, Segment, StagingPool, WritePlan, feed_live, fill_live, fill_segment
from ckptrepo.state import TensorRecord
from ckptrepo.storage import ArrayInfo, LiveShard

# what the stage hands the flush stage per segment: (job, segment, buffer, view or None, CUDA event or None)
Emit = Callable[[tuple[Any, Segment, torch.Tensor, Any, Any]], None]


class CaptureJob(Protocol):
    """What the capture stage reads and updates of one snapshot (saving/_snapshot_job.py's ``SnapshotJob``)."""

    handle: SnapshotHandle
    records: list[TensorRecord]
    plan: WritePlan | None        # None: dedup decides what to write first (the stage's ``decide``)
    written: list[int]            # the records the plan writes, in its order
    arrays: dict[str, ArrayInfo]
    live: bool                    # written from the tensors' memory
    ready: list[Any]              # CUDA events recorded on the training streams (empty: a CPU state)
    replicas: list[Any]           # replicated pieces, read into ``fingerprints`` before the state changes
    fingerprints: list[Any]
    feeds: dict[int, Any]         # plan index -> what its bytes are fed to (hashes, statistics)
    feeding: list[Any] | None     # live shards still to feed
    live_shards: list[LiveShard]
    holds: int
    remaining: int
    error: BaseException | None
    lock: threading.Lock
    staged: threading.Event
    data_done: threading.Event

    def fail(self, err: BaseException) -> None: ...
    def drop_hold(self) -> None: ...
    def segment_done(self, err: BaseException | None = None) -> None: ...


class CaptureStage:
    """Captures snapshots into ``pool``'s buffers and hands each segment on through ``emit``; ``decide`` plans
    a job whose plan waits for dedup (run on the side stream for a CUDA state, whose hashes are taken there)."""

    def __init__(self, pool: StagingPool, emit: Emit, decide: Callable[[Any], None] | None = None) -> None:
        self.pool, self.emit, self.decide = pool, emit, decide
        self.side_stream: Any = None
        self.device_copies = DeviceCopies()   # a CUDA state's source views, kept per plan

    def run(self, job: CaptureJob) -> None:
        """Capture the job; a failure is the job's (its commit reports it). Then feed its live shards."""
        try:
            # a CUDA capture is a few hundred short torch calls, each taking the GIL back (saving/_gil.py)
            with quick_gil_handoffs() if job.ready else contextlib.nullcontext():
                self._capture(job)
        except BaseException as err:  # noqa: BLE001 - reported through the job
            job.fail(err)
        finally:
            job.staged.set()
            job.drop_hold()   # captured now, or once its live shards are written and fed, or released
        self.feed(job)

    def release(self, job: CaptureJob) -> None:
        """From the training thread, before the state changes: copy out of the state what the writers and the
        feed of a live job have not read yet."""
        job.staged.wait()
        with interrupts_deferred():   # a Ctrl-C inside a release would lose its hold and hang the next step
            copied = sum(shard.release(_team_copy) for shard in list(job.live_shards))
        with job.lock:
            job.handle.stats.copied_bytes += copied

    def feed(self, job: CaptureJob, final: bool = True) -> None:
        """Feed a live job's hashes and statistics from its shards, while they are written (``feed_live``): after
        every segment is queued, so neither the writes nor the pre-step hook wait for this pass. The job's data
        is done only once the ``final`` pass is over (the commit reads the hashes and statistics); a pass before
        (``final=False``) feeds the shards queued so far, to free their buffers."""
        if job.feeding is None:
            return
        pairs = job.feeding
        job.feeding = None if final else []
        err: BaseException | None = None
        try:
            scratch = np.empty(0, dtype=np.uint8)
            for seg, shard, source, cb in pairs:
                if err is None and job.error is None:
                    if scratch.nbytes < FEED_CHUNKS * cb:
                        scratch = np.empty(FEED_CHUNKS * cb, dtype=np.uint8)
                    try:
                        feed_live(seg, source, shard, cb, job.feeds, scratch)
                    except BaseException as e:  # noqa: BLE001 - reported through the job
                        err = e
                shard.feed_over()
        finally:
            if err is not None:
                job.fail(err)
            if final:
                job.segment_done(err)

    def _capture(self, job: CaptureJob) -> None:
        cuda = bool(job.ready)
        if cuda and self.side_stream is None:
            # a high priority: the hash and statistics kernels run between the training step's kernels instead
            # of after them, since the optimizer's step waits for this capture
            self.side_stream = torch.cuda.Stream(device=next(r.tensor.device for r in job.records if r.tensor.is_cuda),
                                                 priority=-1)
        for ev in job.ready:   # every kernel the side stream runs below comes after the training stream's snapshot()
            self.side_stream.wait_event(ev)
        if job.plan is None:
            assert self.decide is not None   # only dedup defers the plan
            try:   # CUDA tensors are hashed on the side stream
                with torch.cuda.stream(self.side_stream) if cuda else contextlib.nullcontext():
                    self.decide(job)
            except BaseException:
                job.data_done.set()   # no segment was queued; the commit thread sees the job's error
                raise
        plan = job.plan
        assert plan is not None
        flat: dict[int, torch.Tensor] = {}
        if cuda and self.pool.pin:   # the buffers this capture would otherwise pin one by one (see StagingPool)
            self.pool.grow_in_background(len(plan.segments))
        if job.replicas:   # read before the state may change again; a CUDA one once the training stream is done
            with torch.cuda.stream(self.side_stream) if cuda else contextlib.nullcontext():
                job.fingerprints = fingerprints(job.replicas)
            job.replicas = []

        def source(i: int) -> torch.Tensor:   # i: index in the plan (of the written records)
            t = flat.get(i)
            if t is None:
                t = job.records[job.written[i]].tensor.resolve_conj().resolve_neg()
                if t.is_cuda:  # flattened once (a strided one copied on the device) and kept alive for the side stream
                    t = t.reshape(-1)
                    t.record_stream(self.side_stream)
                flat[i] = t   # CPU: fill_segment copies strided tensors from where they are
            return t

        last_event = None
        queued = 0
        try:
            for k, seg in enumerate(plan.segments):
                if job.feeding and not self.pool.has_room():
                    # a pool smaller than the snapshot: the buffers of queued live shards come back only once
                    # they are fed too, so feed them now rather than wait for ever
                    self.feed(job, final=False)
                buf = self.pool.take()
                if job.error is not None:
                    self.emit((job, seg, buf, None, None))
                    queued += 1
                    continue
                try:
                    faults.point("before_capture")
                    if job.live:
                        # written from where it is: only the chunks that are not wholly in one aligned tensor
                        # (edges, small and strided tensors) are copied into the buffer now; the rest stays in
                        # the tensors until the writer has written it and the feed read it, or the pre-step hook
                        # copies it. The feed (hashes, statistics) comes after every segment is queued (feed)
                        cb = job.arrays[seg.dtype].inner_bytes
                        chunks, live = fill_live(seg, source, buf, cb)
                        keep = [source(p[0]).untyped_storage() for p in seg.parts]
                        fed = 0 if any(p[0] in job.feeds for p in seg.parts) else None
                        # the buffer goes back to the pool once the write and the feed are both over
                        view: Any = LiveShard(chunks, live, buf.numpy(), job.drop_hold, keep, fed=fed,
                                              on_over=functools.partial(self.pool.give, buf))
                        with job.lock:
                            job.holds += 0 if view.released else 1   # a shard of copies only: captured now
                            job.handle.stats.copied_bytes += cb * live.count(False)
                        job.live_shards.append(view)
                        if fed is not None:
                            _start_feeding(job).append((seg, view, source, cb))
                    elif cuda:
                        # one _foreach_copy_ per segment over views kept per plan (saving/_device_copies.py): a
                        # few calls per segment, so capture does not wait for the GIL once per tensor
                        with torch.cuda.stream(self.side_stream):
                            if last_event is None:
                                self.device_copies.prepare(plan, [job.records[r].tensor for r in job.written],
                                                           self.side_stream)
                            view = self.device_copies.fill(k, seg, buf, source, job.feeds)
                            last_event = torch.cuda.Event()
                            last_event.record(self.side_stream)
                    else:
                        view = fill_segment(seg, source, buf, hashers=job.feeds)
                    if not job.live:
                        job.handle.stats.copied_bytes += (seg.stop - seg.start) * job.arrays[seg.dtype].itemsize
                except BaseException:
                    self.pool.give(buf)
                    raise
                self.emit((job, seg, buf, view, last_event))
                queued += 1
            if last_event is not None:
                last_event.synchronize()
        except BaseException as err:  # noqa: BLE001 - the segments never queued are accounted as failed
            for _ in range(len(plan.segments) - queued):
                job.segment_done(err)
            raise


def _start_feeding(job: CaptureJob) -> list[Any]:
    """The job's list of shards to feed; made (and counted as one more part of its data) at the first, while
    the segment of that shard is not queued yet (so the job's data cannot be done before)."""
    if job.feeding is None:
        with job.lock:
            job.remaining += 1   # done by feed
        job.feeding = []
    return job.feeding


def _team_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy bytes with torch's intra-op threads: the pre-step hook runs in the training thread, whose team is idle
    while it waits there, so the copy of what the writers have not reached takes every core, not one."""
    torch.from_numpy(dst).copy_(torch.from_numpy(src))


__all__ = ["CaptureJob", "CaptureStage", "Emit"]
