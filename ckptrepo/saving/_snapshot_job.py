"""The state of one asynchronous snapshot as it moves through the pipeline, and the handle its caller holds.

``SnapshotHandle`` and ``SnapshotStats`` are what the training loop sees;
``SnapshotJob`` is what the capture, flush and commit threads share about
the snapshot (the stages they run: saving/_capture_stage.py, _flush_stage.py,
_commit_stage.py; saving/_commit.py commits the job).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ckptrepo.core import Version
from ckptrepo.errors import ArgumentError
from ckptrepo.saving._content_hash import hasher_digest
from ckptrepo.saving._dedup import DedupKey, PieceId, StoredTensor
from ckptrepo.saving._step_clock import StepClock
from ckptrepo.saving._writer import WritePlan
from ckptrepo.state import TensorRecord
from ckptrepo.storage import ArrayInfo, LiveShard

log = logging.getLogger("ckptrepo")


@dataclass
class SnapshotStats:
    """Timings of one snapshot, in seconds, and its size."""

    blocking_s: float = 0.0   # the training loop was held: the snapshot() call plus pre-step waits
    # lost_s (below): blocking_s plus the slowdown of the steps the snapshot's background work overlapped
    capture_s: float = 0.0    # snapshot() until the state was free to change (copied to staging, or written)
    flush_s: float = 0.0      # first shard write until the data was durable
    total_s: float = 0.0      # snapshot() until committed
    bytes: int = 0
    copied_bytes: int = 0     # bytes copied out of the state into staging (all of them, unless written in place)
    # the attached optimizer's step intervals and this snapshot's window among them (saving/_step_clock.py)
    _clock: StepClock | None = field(default=None, repr=False, compare=False)
    _window: int = field(default=-1, repr=False, compare=False)
    _lost: float | None = field(default=None, repr=False, compare=False)   # as recorded, once committed or failed

    @property
    def gbps(self) -> float:
        """Throughput from snapshot() to commit, in GB/s."""
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    @property
    def lost_s(self) -> float:
        """The time the training loop lost to this snapshot: ``blocking_s``, or more where the steps it overlapped
        ran slower than the steps clear of any snapshot (its background work took their cores); so far while it
        is in flight, recorded with the version at its commit."""
        clock = self._clock
        if self._lost is not None:
            return self._lost
        return self.blocking_s if clock is None else clock.lost(self._window, self.blocking_s)

    def watch_steps(self, clock: StepClock, started: float) -> None:
        """Measure ``lost_s`` against ``clock``'s steps, from ``started`` (the ``snapshot()`` call)."""
        self._clock, self._window = clock, clock.opened(started)

    def settle_steps(self) -> None:
        """Before the commit: let the step that this snapshot's background work slowed end first (bounded; see
        ``StepClock.hold``), so that ``lost_s`` holds all of it."""
        if self._clock is not None:
            self._clock.hold(self._window)

    def commit_awaited(self) -> None:
        """Something waits for the commit: ``settle_steps`` must not keep it back for a step."""
        if self._clock is not None:
            self._clock.release(self._window)

    def steps_over(self) -> None:
        """The snapshot is committed or failed: later steps are not its to slow down."""
        if self._clock is not None:
            self._lost = self.lost_s   # what the commit recorded, give or take the moments since
            self._clock.closed(self._window)

    def to_json(self) -> dict[str, float]:
        return {"blocking_s": self.blocking_s, "lost_s": self.lost_s, "capture_s": self.capture_s,
                "flush_s": self.flush_s, "total_s": self.total_s, "bytes": self.bytes,
                "copied_bytes": self.copied_bytes, "gbps": self.gbps}


class _Awaited(threading.Event):
    """An event whose waiters first call ``on_wait``: the commit it marks is awaited, so nothing holds it back."""

    def __init__(self, on_wait: Callable[[], None]) -> None:
        super().__init__()
        self._on_wait = on_wait

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self._on_wait()
        return super().wait(timeout)


class SnapshotHandle:
    """The future of one asynchronous snapshot."""

    def __init__(self, vid: str, step: int | None) -> None:
        self.id = vid
        self.step = step
        self.stats = SnapshotStats()
        self._captured = threading.Event()
        # waiting for either releases the commit from waiting for the loop's next step (SnapshotStats.settle_steps)
        self._done = _Awaited(lambda: self.stats.commit_awaited())
        # the version or the error is known (set before the callbacks run)
        self._settled = _Awaited(lambda: self.stats.commit_awaited())
        self._version: Version | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["SnapshotHandle"], None]] = []
        self._callbacks_lock = threading.Lock()
        self.skipped = False   # never taken: the local tier was full (``on_full="skip"``); ``result()`` says so

    def _skip(self, reason: BaseException) -> None:
        """Finish the handle of a snapshot that is not taken at all: done, nothing to wait for, no version."""
        self.skipped = True
        self._error = reason
        self._captured.set()
        self._finish()

    def _finish(self) -> None:
        """Settle the outcome (committed or failed), run the done callbacks in the order added, then mark the
        snapshot done: ``wait()`` and ``close()`` return only after the callbacks ran (a framework's pointer
        to the version exists by then), while ``result()`` inside a callback already has its answer."""
        self._settled.set()
        self.stats.steps_over()
        while True:
            with self._callbacks_lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._done.set()
                    return
            for fn in callbacks:
                self._run_callback(fn)

    def _run_callback(self, fn: Callable[["SnapshotHandle"], None]) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - a caller's hook must not stop the commit thread (as concurrent.futures)
            log.exception("ckptrepo: a done callback of snapshot %s raised", self.id[:12])

    def add_done_callback(self, fn: Callable[["SnapshotHandle"], None]) -> None:
        """Run ``fn(handle)`` once the snapshot is committed or has failed: on the commit thread, or at once
        if it is already done, as ``concurrent.futures.Future.add_done_callback`` does. Inside, ``result()``
        returns the Version or raises the failure. An exception ``fn`` raises is logged, not raised: the
        commit thread serves every later snapshot too. Frameworks use it to record a file name or a tracker
        entry only once the version exists."""
        if not callable(fn):
            raise ArgumentError(f"add_done_callback takes a callable, not {type(fn).__name__}")
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def captured(self) -> bool:
        """Whether the state may be mutated again as far as this snapshot is concerned."""
        return self._captured.is_set()

    def wait_captured(self, timeout: float | None = None) -> bool:
        return self._captured.wait(timeout)

    def done(self) -> bool:
        """Whether the snapshot is committed or has failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Version:
        """The committed Version; raises the snapshot's error if it failed."""
        if not self._settled.wait(timeout):
            raise TimeoutError(f"snapshot {self.id[:12]} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._version is not None
        return self._version

    def __repr__(self) -> str:
        state = ("skipped" if self.skipped else "failed" if self._error else "committed" if self.done()
                 else "captured" if self.captured()
                 else "capturing")
        return f"SnapshotHandle({self.id[:12]}, step={self.step}, {state})"


@dataclass
class SnapshotJob:
    """One snapshot on its way through the pipeline: what ``snapshot()`` recorded, what the capture thread
    planned and queued, and how far its writes got; the commit thread turns it into a version."""

    handle: SnapshotHandle
    skeleton: Any
    records: list[TensorRecord]
    plan: WritePlan | None          # None until the capture thread has decided what to write (dedup)
    message: str
    metrics: dict[str, Any]
    started: float
    meta: dict[str, str] | None = None   # free text for the header (``snapshot(meta=)``)
    tag: str | None = None           # created (``force_tag``: moved) right after the commit, by the commit thread
    force_tag: bool = False
    sharded: bool = False            # its records are pieces of global tensors (a layout, ranks, or DTensors)
    leaf_names: list[str] = field(default_factory=list)     # distributed: the stored name of each state tensor
    names: list[list[Any]] = field(default_factory=list)    # sharded: [name, dtype, global shape] this rank holds
    boxes: list[Any] = field(default_factory=list)          # sharded: the global box of each record (piece)
    ready: list[Any] = field(default_factory=list)          # CUDA events recorded on the training streams
    # sharded: the pieces replicated over ranks (by the rules or by a DTensor's placements), (name, box, view,
    # by), until the capture thread turns them into fingerprints that rank 0 compares across ranks
    # (parallel/_replicas.py)
    replicas: list[Any] = field(default_factory=list)
    fingerprints: list[Any] = field(default_factory=list)
    # dedup: see saving/_dedup.py
    keys: list[DedupKey | None] = field(default_factory=list)   # per record; None: never deduped nor hashed
    ids: list[PieceId] = field(default_factory=list)            # per record: (name, box), as the manifest names it
    match: dict[int, StoredTensor] = field(default_factory=dict)      # record -> stored piece it may reuse
    reused: dict[int, StoredTensor] = field(default_factory=dict)     # record -> stored bytes it points at instead
    reused_moments: dict[int, Any] = field(default_factory=dict)      # sharded: record -> its moments, for rank 0
    written: list[int] = field(default_factory=list)            # records written, in plan order
    plan_index: dict[int, int] = field(default_factory=dict)    # written record -> its index in the plan
    watch: set[int] = field(default_factory=set)                # records to hash if written (maybe frozen)
    hashers: dict[int, Any] = field(default_factory=dict)        # plan index -> xxh3-128 of its staged bytes
    digests: dict[int, bytes] = field(default_factory=dict)     # record -> digest taken before capture (CUDA)
    piece_moments: dict[int, Any] = field(default_factory=dict)  # sharded: plan index -> Moments.to_raw()
    record_stats: bool = True                                   # take the statistics below (the snapshotter's)
    stats: dict[int, Any] = field(default_factory=dict)          # plan index -> its statistics (_tensor_stats.py)
    feeds: dict[int, Any] = field(default_factory=dict)          # plan index -> what its staged bytes are fed to
    stat_rows: dict[int, tuple[float, ...]] = field(default_factory=dict)   # record -> its statistics, at commit
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)
    chunk_crcs: dict[str, np.ndarray] = field(default_factory=dict)   # dtype -> its array's chunk table, as written
    handles: dict[str, Any] = field(default_factory=dict)
    remaining: int = 0
    # written from the tensors' memory (a CPU state, a local store with O_DIRECT): see CaptureStage._capture
    live: bool = False
    live_shards: list[LiveShard] = field(default_factory=list)
    feeding: list[Any] | None = None   # live shards whose hashes and statistics are still to feed (CaptureStage.feed)
    holds: int = 1                  # the capture thread's, plus one per live shard not yet released
    staged: threading.Event = field(default_factory=threading.Event)   # the capture thread is done with the job
    error: BaseException | None = None
    first_write: float = 0.0
    data_done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def vid(self) -> str:
        return self.handle.id

    def stored_digest(self, i: int) -> bytes | None:
        """The content digest of the bytes record ``i`` is stored as in this version (None: not hashed)."""
        if i in self.reused:
            return self.reused[i].digest
        if i in self.digests:
            return self.digests[i]
        hasher = self.hashers.get(self.plan_index.get(i, -1))
        return None if hasher is None else hasher_digest(hasher)

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err

    def drop_hold(self) -> None:
        """One hold on the state's memory is gone; with the last, the state may be mutated again."""
        with self.lock:
            self.holds -= 1
            last = self.holds == 0
        if last:
            self.handle.stats.capture_s = time.perf_counter() - self.started
            self.handle._captured.set()

    def record_crcs(self, seg: Any, crcs: np.ndarray) -> None:
        """The crc32cs of a written segment's chunks (a segment is one shard, so it starts on a chunk)."""
        first = seg.start // self.arrays[seg.dtype].inner_elems
        self.chunk_crcs[seg.dtype][first:first + len(crcs)] = crcs

    def segment_done(self, err: BaseException | None = None) -> None:
        if err is not None:
            self.fail(err)
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.data_done.set()
