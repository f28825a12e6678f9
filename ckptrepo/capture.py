"""Lazy asynchronous capture: the snapshot hook of the training loop.

``Snapshotter.snapshot`` only flattens the state (metadata, no tensor bytes)
and queues a job; it returns at once. Three background threads then run the
pipeline, each stage overlapping the others and the training loop:

* capture: copies each segment's tensor slices into a staging buffer from a
  bounded pool (pinned memory and a side stream ordered after the training
  stream by an event on CUDA). A CPU state bound for a local store with
  ``O_DIRECT`` is not copied: each segment becomes a ``LiveShard`` whose whole
  inner chunks are written from the tensors' own memory, only the chunks at
  tensor edges being copied (``writer.fill_live``); the pre-step hook copies
  whatever the writers have not written yet. An empty pool makes capture wait
  (backpressure), so host memory stays bounded.
* flush: hands each filled buffer on as one whole shard write (to the direct
  writer's threads for a local store, localwrite.py; to TensorStore
  otherwise); the buffer returns to the pool when the write is durable.
* commit: in snapshot order, once a version's data is durable, writes its
  manifest and moves the branch by compare-and-swap.

The training loop waits only for *capture*, and only before it mutates the
state: ``attach(optimizer)`` installs a pre-step hook that does so, or call
``wait_captured()``. It never waits for storage (for live shards: at most for
the one ``LIVE_BATCH`` write in flight per writer thread, ~4 MiB each). A failed write never raises
inside training: the version is not committed, a failure record is written, and
the error is raised by the next ``snapshot``/``wait``/``wait_captured``/``close``.

Dedup: a tensor whose bytes did not change since the last version this
snapshotter committed is not written again; its piece points at the stored
bytes (see ``_Stored`` and ``Snapshotter._decide``).
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from . import faults
from .arrays import INNER_BYTES, SHARD_BYTES, ArrayInfo, create_array
from .boxes import volume
from .distributed import Staging, all_gather, merge_rank_manifests, process_group_rank, assign_writers
from .errors import CkptRepoError, ConflictError, DetachedHeadError, LayoutError, SnapshotFailedError, StorageError
from .gc import RetentionPolicy, VersionFacts
from .layout import ParallelLayout
from .localwrite import DirectWriter, LiveShard
from .manifest import (DATA_PREFIX, FAILURES_PREFIX, FORMAT_VERSION, VERSIONS_PREFIX, Version, new_version_id,
                       plain_metrics, seal, version_from_manifest, version_id_time)
from .providers import TensorRecord, flatten
from .sharding import Sharder, column_blocks
from .writer import (LIVE_ALIGN, Segment, StagingPool, WritePlan, aligned_empty, fill_live, fill_segment,
                     live_residues)

log = logging.getLogger("ckptrepo")


def parse_size(size: int | str | None) -> int | None:
    """``"8GiB"``, ``"512MB"``, ``1 << 30`` -> bytes."""
    if size is None or isinstance(size, int):
        return size
    s = size.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def default_host_memory() -> int:
    """A quarter of the memory available now, at most 8 GiB and at least 256 MiB."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 4 << 30
    return max(256 << 20, min(8 << 30, avail // 4))


@dataclass
class SnapshotStats:
    """Timings of one snapshot, in seconds, and its size."""

    blocking_s: float = 0.0   # the training loop was held: the snapshot() call plus pre-step waits
    capture_s: float = 0.0    # snapshot() until the state was free to change (copied to staging, or written)
    flush_s: float = 0.0      # first shard write until the data was durable
    total_s: float = 0.0      # snapshot() until committed
    bytes: int = 0
    copied_bytes: int = 0     # bytes copied out of the state into staging (all of them, unless written in place)

    @property
    def gbps(self) -> float:
        """Throughput from snapshot() to commit, in GB/s."""
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {"blocking_s": self.blocking_s, "capture_s": self.capture_s, "flush_s": self.flush_s,
                "total_s": self.total_s, "bytes": self.bytes, "copied_bytes": self.copied_bytes, "gbps": self.gbps}


class SnapshotHandle:
    """The future of one asynchronous snapshot."""

    def __init__(self, vid: str, step: int | None) -> None:
        self.id = vid
        self.step = step
        self.stats = SnapshotStats()
        self._captured = threading.Event()
        self._done = threading.Event()
        self._version: Version | None = None
        self._error: BaseException | None = None

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
        if not self._done.wait(timeout):
            raise TimeoutError(f"snapshot {self.id[:12]} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._version is not None
        return self._version

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self.done() else "captured" if self.captured() else "capturing"
        return f"SnapshotHandle({self.id[:12]}, step={self.step}, {state})"


DedupKey = tuple  # (dtype, shape, stride, data_ptr, autograd version) of a live CPU tensor


@dataclass(frozen=True)
class _Stored:
    """Dedup: one tensor of the last version this snapshotter committed, and where its bytes are stored.

    ``digest`` is the xxh3-128 of exactly the bytes stored at ``array``/``offset``
    (None when they were not hashed); ``info`` is the array's ArrayInfo JSON,
    copied into the manifest of every version that reuses the piece.
    """

    key: DedupKey
    digest: int | None
    array: str
    offset: int
    info: dict[str, Any]


@dataclass
class _Job:
    handle: SnapshotHandle
    skeleton: Any
    records: list[TensorRecord]
    plan: WritePlan | None          # None until the capture thread has decided what to write (dedup)
    message: str
    metrics: dict[str, Any]
    started: float
    leaf_names: list[str] = field(default_factory=list)     # distributed: the stored name of each state tensor
    names: list[list[Any]] = field(default_factory=list)    # sharded: [name, dtype, global shape] this rank holds
    boxes: list[Any] = field(default_factory=list)          # sharded: the global box of each record (piece)
    ready: list[Any] = field(default_factory=list)          # CUDA events recorded on the training streams
    # dedup (single process, CPU tensors): see Snapshotter._decide
    keys: list[DedupKey | None] = field(default_factory=list)   # per record; None: never deduped nor hashed
    match: dict[int, _Stored] = field(default_factory=dict)      # record -> last committed tensor with its key
    reused: dict[int, _Stored] = field(default_factory=dict)     # record -> stored bytes it points at instead
    written: list[int] = field(default_factory=list)            # records written, in plan order
    watch: set[int] = field(default_factory=set)                # records to hash if written (maybe frozen)
    hashers: dict[int, Any] = field(default_factory=dict)        # plan index -> xxh3-128 of its staged bytes
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)
    remaining: int = 0
    # written from the tensors' memory (a CPU state, a local store with O_DIRECT): see Snapshotter._capture
    live: bool = False
    live_shards: list[LiveShard] = field(default_factory=list)
    holds: int = 1                  # the capture thread's, plus one per live shard not yet released
    staged: threading.Event = field(default_factory=threading.Event)   # the capture thread is done with the job
    error: BaseException | None = None
    first_write: float = 0.0
    data_done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def vid(self) -> str:
        return self.handle.id

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

    def segment_done(self, err: BaseException | None = None) -> None:
        if err is not None:
            self.fail(err)
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.data_done.set()


class Snapshotter:
    """Asynchronous snapshots of a training state onto the current branch.

    The contract: after ``snapshot(state)`` returns, the tensors in ``state``
    must not be modified in place until capture has finished, which the
    attached optimizer's pre-step hook (or ``wait_captured()``) guarantees.
    Reading them (forward, backward) is fine, and so is writing gradients.
    Plain Python values and the structure are recorded during ``snapshot``
    itself. Buffers of ``nn.Module``s in the state (BatchNorm running
    statistics change in forward) are copied during ``snapshot``.

    With ``dedup`` (the default; single process only), a CPU tensor whose
    bytes equal those of the same tensor in the last version this snapshotter
    committed is not written again: its piece points at the stored bytes. The
    training thread only compares (data_ptr, version counter, dtype, shape,
    stride); the capture thread confirms with an xxh3-128 of the bytes.
    """

    def __init__(self, repo: Any, host_memory: int | str | None = None, pin_memory: bool | None = None,
                 record_failures: bool = True, parallel_layout: ParallelLayout | None = None,
                 group: Any = None, commit_timeout_s: float = 600.0, dedup: bool = True,
                 retention: RetentionPolicy | None = None) -> None:
        self.rank, self.world_size = process_group_rank()
        self.retention = retention
        self._commits = 0
        self._retention_idle = threading.Event()   # clear while a background gc pass is pending or running
        self._retention_idle.set()
        self._gc_facts: dict[str, VersionFacts] = {}   # what retention passes learnt of the manifests
        if parallel_layout is not None and parallel_layout.world_size != self.world_size:
            raise LayoutError(f"the layout ({parallel_layout}) has {parallel_layout.world_size} ranks but "
                              f"torch.distributed has {self.world_size}; initialise the process group first "
                              f"(torchrun) or pass the layout that matches it")
        self.layout = parallel_layout
        self.distributed = self.world_size > 1
        # through the Sharder (global names, boxes, column blocks): every distributed snapshot, and a
        # single process that names a layout (so a later tensor-parallel load reads whole column blocks)
        self.sharded = self.distributed or parallel_layout is not None
        self.group = group
        self.commit_timeout_s = commit_timeout_s
        self.dedup = dedup and not self.sharded   # sharded snapshots always write everything
        self._stored: dict[str, _Stored] = {}         # dedup: the last committed version's tensors, by name
        head = repo.refs.head()
        if head.branch is None:
            raise DetachedHeadError(f"HEAD is detached at {str(head.version)[:12]}; create a branch there first: "
                                    f"repo.checkout(rev, branch=NAME) or `ckptrepo checkout REV -b NAME`")
        self.repo = repo
        self.record_failures = record_failures  # False when the caller waits and gets the error itself
        self.branch = head.branch
        self._tip, self._generation = repo.refs.branch_tip_with_generation(head.branch)
        faults.point("after_read_head")
        self.host_memory = parse_size(host_memory) or default_host_memory()
        shard = min(SHARD_BYTES, max(INNER_BYTES, self.host_memory // 2 // INNER_BYTES * INNER_BYTES))
        self.shard_bytes = shard
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._direct = DirectWriter.for_store(repo.store)   # local store: shards written without TensorStore
        # page-aligned buffers where the direct writer may write them with O_DIRECT as they are (fill_live)
        self.pool = StagingPool(shard, max(2, self.host_memory // shard), pin=pin,
                                align=LIVE_ALIGN if self._direct is not None and self._direct.direct_io else 0)
        # TensorStore may reference a staging buffer instead of copying it; fine where the kvstore copies the
        # bytes out before the write completes, but the memory kvstore would keep the buffer as the stored
        # value, which the pool then reuses for another shard
        self._store_copies = repo.store.spec.get("driver") != "memory"
        self._capture_q: queue.Queue = queue.Queue()
        self._flush_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._inflight: list[_Job] = []
        self._errors: list[SnapshotFailedError] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._hooks: list[Any] = []
        self._closed = False
        self._side_stream: Any = None
        ref = weakref.ref(self)
        self._atexit = lambda: (s := ref()) is not None and s._close_at_exit()
        atexit.register(self._atexit)

    # ---- public API -------------------------------------------------------
    def snapshot(self, state: Any, step: int | None = None, message: str = "",
                 metrics: dict[str, Any] | None = None) -> SnapshotHandle:
        """Start a snapshot of ``state`` and return its handle at once (see the class contract)."""
        t0 = time.perf_counter()
        self._raise_pending()
        if self._closed:
            raise CkptRepoError("this snapshotter is closed; create another with repo.snapshotter()")
        skeleton, records = flatten(state)
        keys = [_dedup_key(r) for r in records] if self.dedup else []   # of the live tensors, before buffer copies
        _copy_module_buffers(state, records)
        vid, leaf_names, names, boxes = new_version_id(), [], [], []
        if self.sharded:
            vid, records, boxes, leaf_names, names = self._shard(records)
        handle = SnapshotHandle(vid, None if step is None else int(step))
        job = _Job(handle, skeleton, records, None, message, plain_metrics(metrics or {}), started=t0,
                   leaf_names=leaf_names, names=names, boxes=boxes, keys=keys)
        # a CPU state to a local store with O_DIRECT is written from where it is (not for CUDA tensors: their
        # bytes must come to the host anyway, and whole-segment DMAs into pinned staging are the cheap way)
        job.live = self._direct is not None and self._direct.direct_io and not any(r.tensor.is_cuda for r in records)
        stored = self._stored   # replaced (never mutated) by the commit thread
        for i, key in enumerate(keys):
            if key is None:
                continue
            prev = stored.get(records[i].name)
            if prev is None or prev.key == key:   # new to this snapshotter, or looks unchanged: worth hashing
                job.watch.add(i)
                if prev is not None:
                    job.match[i] = prev
        if not any(m.digest is not None for m in job.match.values()):
            self._plan(job, list(range(len(records))))   # nothing can be reused: plan here, as without dedup
        devices = {r.tensor.device for r in records if r.tensor.device.type == "cuda"}
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            job.ready.append(ev)
        self._start_threads()
        with self._lock:
            self._inflight.append(job)
        self._capture_q.put(job)
        self._commit_q.put(job)
        handle.stats.blocking_s += time.perf_counter() - t0
        return handle

    def _plan(self, job: _Job, written: list[int]) -> None:
        """Plan the records to write (all but the reused ones) and account for their segments.

        Runs in ``snapshot()``, or in the capture thread once dedup has decided;
        either way before any segment of the job is queued.
        """
        records = [job.records[i] for i in written]
        residues = live_residues(records, INNER_BYTES) if job.live else None
        plan = self.repo.plans.get(records, self.shard_bytes, residues)
        job.written = written
        job.arrays = {d: ArrayInfo(f"{DATA_PREFIX}{job.vid}/{self.rank}/{d}", d, n, s, i)
                      for d, (n, s, i) in plan.streams.items()}
        job.hashers = {pi: xxhash.xxh3_128() for pi, ri in enumerate(written) if ri in job.watch}
        job.handle.stats.bytes = plan.nbytes
        job.remaining = len(plan.segments)
        job.plan = plan
        if job.remaining == 0:
            job.data_done.set()

    def _decide(self, job: _Job) -> None:
        """Capture thread, before planning: which matched tensors reuse their stored bytes.

        The key match in ``snapshot()`` (same name, dtype, shape, stride, storage
        and autograd version as in the last committed version) only says which
        tensors are worth hashing: writes through ``.data`` or a numpy view leave
        the version counter alone. A stored piece is reused only when the
        xxh3-128 of the current bytes equals the hash of the bytes stored there.
        """
        written = []
        for i, r in enumerate(job.records):
            prev = job.match.get(i)
            if prev is not None and prev.digest is not None and _digest(r.tensor) == prev.digest:
                job.reused[i] = prev
            else:
                written.append(i)
        self._plan(job, written)

    def _shard(self, records: list[TensorRecord]) -> tuple[str, list[TensorRecord], list[Any], list[str],
                                                           list[list[Any]]]:
        """Sharded: this rank's pieces, the agreed version id, and which pieces this rank writes."""
        # without a layout (DTensor placements say what each rank holds) every rank is its own data-parallel slot
        layout = self.layout or ParallelLayout(dp=self.world_size)
        sharded = Sharder(layout, self.rank, self.rank).shard(records)
        pieces = column_blocks(sharded.pieces)
        meta = [(p.name, p.box, volume(p.box[1]) * p.view.element_size()) for p in pieces]
        mine_meta = (new_version_id(), meta)
        gathered = all_gather(mine_meta, self.group) if self.distributed else [mine_meta]
        writes = assign_writers([g[1] for g in gathered])[self.rank]
        mine = [p for p, w in zip(pieces, writes) if w]
        names: dict[str, list[Any]] = {}
        for p in pieces:
            names.setdefault(p.name, [p.name, p.dtype, list(p.gshape)])
        for rec, name, gshape in zip(records, sharded.leaf_names, sharded.gshapes):
            if rec.numel == 0 and gshape is not None:   # no pieces here: listed under its global name and shape
                names.setdefault(name, [name, rec.dtype, list(gshape)])
        return (gathered[0][0], [TensorRecord(p.name, p.view, p.dtype, p.box[1]) for p in mine],
                [[list(p.box[0]), list(p.box[1])] for p in mine], sharded.leaf_names, list(names.values()))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` first wait until every pending capture has finished."""
        def pre_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self._wait_for_capture()
        self._hooks.append(optimizer.register_step_pre_hook(pre_step))

    def wait_captured(self) -> None:
        """Block until every snapshot taken so far is in staging memory: the state may be mutated again."""
        self._wait_for_capture()
        self._raise_pending()

    def wait(self, progress: bool | None = None) -> None:
        """Block until every snapshot taken so far is committed (or failed); raise the first failure."""
        jobs = self._pending_jobs()
        show = progress if progress is not None else _stderr_is_terminal()
        if show and jobs:
            _wait_with_progress(jobs)
        for job in jobs:
            job.handle._done.wait()
        self._retention_idle.wait()   # a gc pass after the last commit: its failure is raised here too
        self._raise_pending()

    def close(self) -> None:
        """Finish every pending snapshot, stop the threads and detach hooks; raise a pending failure."""
        if self._closed:
            self._raise_pending()
            return
        for job in self._pending_jobs():
            job.handle._done.wait()
        self._shutdown()
        self._raise_pending()

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except CkptRepoError as err:  # the exception in flight matters more
                log.error("ckptrepo: %s", err)

    # ---- internals ----------------------------------------------------------
    def _pending_jobs(self) -> list[_Job]:
        with self._lock:
            return list(self._inflight)

    def _wait_for_capture(self) -> None:
        t0 = time.perf_counter()
        jobs = [j for j in self._pending_jobs() if not j.handle.captured()]
        for job in jobs:
            if job.live:   # what the writers have not written yet is copied out of the state now
                job.staged.wait()
                copied = sum(shard.release() for shard in list(job.live_shards))
                with job.lock:
                    job.handle.stats.copied_bytes += copied
            job.handle._captured.wait()
        if jobs:
            jobs[-1].handle.stats.blocking_s += time.perf_counter() - t0

    def _raise_pending(self) -> None:
        with self._lock:
            if not self._errors:
                return
            first, rest = self._errors[0], len(self._errors) - 1
            self._errors.clear()
        if rest:
            raise SnapshotFailedError(f"{first} (and {rest} more failed snapshot(s); see `ckptrepo log --all`)") \
                from first.__cause__
        raise first

    def _start_threads(self) -> None:
        if self._threads:
            return
        for name, target in (("capture", self._capture_loop), ("flush", self._flush_loop),
                             ("commit", self._commit_loop)):
            t = threading.Thread(target=target, name=f"ckptrepo-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _shutdown(self) -> None:
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._capture_q.put(None)
        self._commit_q.put(None)
        for t in self._threads:
            t.join()
        self._threads.clear()
        if self._direct is not None:
            self._direct.close()
        atexit.unregister(self._atexit)

    def _close_at_exit(self) -> None:
        """At interpreter exit: finish what is in flight so no snapshot is silently dropped."""
        if self._closed:
            return
        try:
            self.close()
        except CkptRepoError as err:
            log.error("ckptrepo: %s", err)

    # capture thread
    def _capture_loop(self) -> None:
        while True:
            job = self._capture_q.get()
            if job is None:
                self._flush_q.put(None)
                return
            try:
                self._capture(job)
            except BaseException as err:  # noqa: BLE001 - reported through the job
                job.fail(err)
            finally:
                job.staged.set()
                job.drop_hold()   # captured now, or once its live shards are written or released

    def _capture(self, job: _Job) -> None:
        if job.plan is None:
            try:
                self._decide(job)
            except BaseException:
                job.data_done.set()   # no segment was queued; the commit thread sees the job's error
                raise
        plan = job.plan
        assert plan is not None
        flat: dict[int, torch.Tensor] = {}
        cuda = bool(job.ready)
        if cuda and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=next(r.tensor.device for r in job.records if r.tensor.is_cuda))

        def source(i: int) -> torch.Tensor:   # i: index in the plan (of the written records)
            t = flat.get(i)
            if t is None:
                t = job.records[job.written[i]].tensor.resolve_conj().resolve_neg()
                if t.is_cuda:  # flattened once (a strided one copied on the device) and kept alive for the side stream
                    t = t.reshape(-1)
                    t.record_stream(self._side_stream)
                flat[i] = t   # CPU: fill_segment copies strided tensors from where they are
            return t

        last_event = None
        queued = 0
        try:
            for seg in plan.segments:
                buf = self.pool.take()
                if job.error is not None:
                    self._flush_q.put((job, seg, buf, None, None))
                    queued += 1
                    continue
                try:
                    faults.point("before_capture")
                    if job.live:
                        # written from where it is: only the chunks that are not wholly in one aligned tensor
                        # (edges, small and strided tensors) are copied into the buffer now; the rest stays in
                        # the tensors until the writer has written it or the pre-step hook copies it
                        cb = job.arrays[seg.dtype].inner_bytes
                        chunks, live = fill_live(seg, source, buf, cb, job.hashers)
                        keep = [source(p[0]).untyped_storage() for p in seg.parts]
                        view: Any = LiveShard(chunks, live, buf.numpy(), job.drop_hold, keep)
                        with job.lock:
                            job.holds += 0 if view.released else 1   # a shard of copies only: captured now
                            job.handle.stats.copied_bytes += cb * live.count(False)
                        job.live_shards.append(view)
                    elif cuda:
                        with torch.cuda.stream(self._side_stream):
                            for ev in job.ready:
                                self._side_stream.wait_event(ev)
                            view = fill_segment(seg, source, buf, non_blocking=True, hashers=job.hashers)
                            last_event = torch.cuda.Event()
                            last_event.record(self._side_stream)
                    else:
                        view = fill_segment(seg, source, buf, hashers=job.hashers)
                    if not job.live:
                        job.handle.stats.copied_bytes += (seg.stop - seg.start) * job.arrays[seg.dtype].itemsize
                except BaseException:
                    self.pool.give(buf)
                    raise
                self._flush_q.put((job, seg, buf, view, last_event))
                queued += 1
            if last_event is not None:
                last_event.synchronize()
        except BaseException as err:  # noqa: BLE001 - the segments never queued are accounted as failed
            for _ in range(len(plan.segments) - queued):
                job.segment_done(err)
            raise

    # flush thread
    def _flush_loop(self) -> None:
        while True:
            item = self._flush_q.get()
            if item is None:
                return
            job, seg, buf, view, event = item
            if job.error is not None or view is None:
                self._segment_over(view, buf)
                job.segment_done()
                continue
            try:
                if event is not None:
                    event.synchronize()
                handle = job.handles.get(seg.dtype)
                if handle is None:
                    handle = job.handles[seg.dtype] = create_array(self.repo.store, job.arrays[seg.dtype])
                faults.point("before_shard_write")
                if not job.first_write:
                    job.first_write = time.perf_counter()
                # a local store: one whole shard object written directly (localwrite.py), durable once the future
                # completes, like TensorStore's commit future; otherwise (or for an odd segment) through TensorStore
                info = job.arrays[seg.dtype]
                if isinstance(view, LiveShard):
                    fut = self._direct.submit_live(info, seg.start, view)
                else:
                    fut = None if self._direct is None else self._direct.submit(info, seg.start, view)
                if fut is None:
                    fut = handle[seg.start:seg.stop].write(
                        view, can_reference_source_data_indefinitely=self._store_copies).commit
            except BaseException as err:  # noqa: BLE001
                self._segment_over(view, buf)
                job.segment_done(_storage_error(job, seg, err))
                continue
            fut.add_done_callback(lambda f, job=job, seg=seg, buf=buf, view=view: self._written(job, seg, buf, view, f))

    def _segment_over(self, view: Any, buf: torch.Tensor) -> None:
        """A segment's write is over (durable, failed or never started): its buffer goes back to the pool, and a
        live shard lets go of the tensors (nothing reads their memory any more)."""
        if isinstance(view, LiveShard):
            view.finish()
        self.pool.give(buf)

    def _written(self, job: _Job, seg: Segment, buf: torch.Tensor, view: Any, fut: Any) -> None:
        err = None
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001
            err = _storage_error(job, seg, e)
        self._segment_over(view, buf)
        if err is None:
            faults.point("after_shard_write")
        job.segment_done(err)

    # commit thread
    def _commit_loop(self) -> None:
        while True:
            job = self._commit_q.get()
            if job is None:
                return
            job.data_done.wait()
            job.handle._captured.wait()
            stats = job.handle.stats
            retain = False
            if job.first_write:
                stats.flush_s = time.perf_counter() - job.first_write
            try:
                if job.error is not None:
                    raise job.error
                faults.point("after_data")
                version = self._commit(job)
            except BaseException as err:  # noqa: BLE001
                if self.distributed:
                    self._publish_failure(job, err)
                self._record_failure(job, err)
            else:
                stats.total_s = time.perf_counter() - job.started
                job.handle._version = version
                self._commits += 1
                if self.retention is not None and self.rank == 0 \
                        and self._commits % max(1, self.retention.every_commits) == 0:
                    retain = True
                    self._retention_idle.clear()   # before the job is done, so wait() also waits for this gc
            finally:
                with self._lock:
                    self._inflight.remove(job)
                job.handle._done.set()
            if retain:
                try:
                    self._apply_retention()
                finally:
                    self._retention_idle.set()

    def _commit(self, job: _Job) -> Version:
        if self.sharded:
            return self._commit_sharded(job)
        assert job.plan is not None
        if job.reused:
            self._check_reused(job)
        manifest = build_manifest(job.vid, self._tip, job.handle.step, job.message, job.metrics, job.records,
                                  job.plan, job.arrays, job.skeleton, written=job.written, reused=job.reused)
        version = self._publish(job, manifest)
        if self.dedup:
            self._remember(job)
        return version

    def _check_reused(self, job: _Job) -> None:
        """The arrays a version reuses must still be there (gc deletes an array no kept version refers to)."""
        for key, info in sorted({s.array: s.info for s in job.reused.values()}.items()):
            array = ArrayInfo.from_json(key, info)
            present = set(self.repo.store.list(key + "/"))
            missing = [k for k in [f"{key}/zarr.json", *(array.shard_key(s) for s in array.shards())]
                       if k not in present]
            if missing:
                self._stored = {}   # write everything again from the next snapshot on
                raise StorageError(f"{missing[0]} was deleted (gc) while snapshot {job.vid[:12]} was in flight "
                                   f"and this snapshot reuses its unchanged tensors; take the snapshot again "
                                   f"(the next one writes every tensor), and run gc between snapshotter.wait() "
                                   f"and the next snapshot")

    def _remember(self, job: _Job) -> None:
        """After a commit: this version's tensors become what the next snapshots compare with (dedup)."""
        assert job.plan is not None
        placement = {ri: pi for pi, ri in enumerate(job.written)}
        stored: dict[str, _Stored] = {}
        for i, (r, key) in enumerate(zip(job.records, job.keys)):
            if key is None:
                continue
            if i in job.reused:
                stored[r.name] = job.reused[i]
                continue
            pi = placement[i]
            p, h = job.plan.placements[pi], job.hashers.get(pi)
            info = job.arrays[p.dtype]
            stored[r.name] = _Stored(key, None if h is None else h.intdigest(), info.key, p.offset, info.to_json())
        self._stored = stored   # replaced whole: snapshot() reads it without a lock

    def _commit_sharded(self, job: _Job) -> Version:
        """Two-phase commit: publish this rank's part; rank 0 merges, checks and commits (see distributed.py).

        A single process (a layout named without torch.distributed) is the only
        rank: its part is merged and checked the same way, without the handshake
        objects in the store.
        """
        part = {
            "rank": self.rank, "tree": job.skeleton, "leaf_names": job.leaf_names, "names": job.names,
            "coords": vars(self.layout.coords(self.rank)) if self.layout is not None else None,
            "tensors": [{"name": r.name, "pieces": [{"box": box, "array": job.arrays[p.dtype].key, "offset": p.offset}]}
                        for r, p, box in zip(job.records, job.plan.placements, job.boxes) if p.numel],
            "arrays": {a.key: a.to_json() for a in job.arrays.values()}}
        if not self.distributed:
            return self._publish_merged(job, [part])
        staging = Staging(self.repo.store, job.vid, self.world_size, self.commit_timeout_s)
        staging.publish_rank(self.rank, part)
        if self.rank != 0:
            staging.wait_outcome()
            return version_from_manifest(self.repo.manifest(job.vid), (self.branch,))
        try:
            version = self._publish_merged(job, staging.gather_ranks())
        except BaseException as err:
            staging.publish_outcome(_first_line(err))
            raise
        staging.publish_outcome(None)
        return version

    def _publish_merged(self, job: _Job, ranks: list[dict[str, Any]]) -> Version:
        """Rank 0: merge and check every rank's part into the version manifest, then publish it."""
        manifest = merge_rank_manifests(ranks, self.layout, self.world_size)
        manifest.update({"format_version": FORMAT_VERSION, "id": job.vid,
                         "parents": [self._tip] if self._tip else [], "step": job.handle.step,
                         "time": time.time(), "message": job.message, "metrics": job.metrics,
                         "host": socket.gethostname()})
        return self._publish(job, manifest)

    def _apply_retention(self) -> None:
        """Background gc after a commit; a failure is logged and raised by the next call, like a failed snapshot."""
        with self._lock:   # never collect what this snapshotter has in flight, or starts meanwhile
            born = [version_id_time(j.vid) or 0.0 for j in self._inflight]
        since = min(born + [time.time()]) - 1.0
        try:
            self.retention.apply(self.repo, protect_since=since, known=self._gc_facts)
        except Exception as err:  # noqa: BLE001 - never kills the commit thread
            failure = SnapshotFailedError(f"background retention (gc) failed: {_first_line(err)}; "
                                          f"run `ckptrepo gc` by hand")
            failure.__cause__ = err
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)

    def _publish_failure(self, job: _Job, err: BaseException) -> None:
        """Let the other ranks know at once (rank 0 aborts the version; the others stop waiting)."""
        staging = Staging(self.repo.store, job.vid, self.world_size, self.commit_timeout_s)
        try:
            if self.rank == 0:
                staging.publish_outcome(_first_line(err))
            else:
                staging.publish_rank(self.rank, {"rank": self.rank, "error": _first_line(err)})
        except CkptRepoError as publish_err:
            log.error("ckptrepo: could not publish the failure of %s: %s", job.vid[:12], publish_err)

    def _publish(self, job: _Job, manifest: dict[str, Any]) -> Version:
        """Write the manifest, then move the branch: the version exists once the ref moved."""
        job.handle.stats.total_s = time.perf_counter() - job.started  # up to the manifest; updated after the ref
        manifest["stats"] = job.handle.stats.to_json()
        self.repo.store.put_if_absent(VERSIONS_PREFIX + job.vid, seal(manifest))
        faults.point("after_manifest")
        gen = self.repo.refs.move_branch(self.branch, job.vid, self._generation)
        if gen is None:
            now = self.repo.refs.branch_tip(self.branch)
            base = f"version {self._tip[:12]}" if self._tip else "an empty branch"
            raise ConflictError(f"branch {self.branch!r} moved to {str(now)[:12]} while this snapshot was written "
                                f"on top of {base}; version {job.vid[:12]} was not committed: load the branch tip "
                                f"and take the snapshot again")
        self._tip, self._generation = job.vid, gen
        faults.point("after_ref")
        self.repo.remember_manifest(manifest)
        return version_from_manifest(manifest, (self.branch,))

    def _record_failure(self, job: _Job, err: BaseException) -> None:
        step = "" if job.handle.step is None else f" at step {job.handle.step}"
        cause = _first_line(err)
        failure = SnapshotFailedError(f"snapshot {job.vid[:12]}{step} was not committed: {cause}")
        failure.__cause__ = err
        job.handle._error = failure
        if not self.record_failures:  # the caller waits on the handle and gets the error from it
            return
        with self._lock:
            self._errors.append(failure)
        log.error("ckptrepo: %s", failure)
        if self.rank != 0:  # rank 0 records the failure of a distributed version
            return
        try:
            self.repo.store.put(FAILURES_PREFIX + job.vid, seal({
                "id": job.vid, "step": job.handle.step, "time": time.time(), "branch": self.branch,
                "message": job.message, "error": cause}))
        except CkptRepoError as record_err:  # storage may be what failed; the log line above remains
            log.error("ckptrepo: could not record the failure of %s: %s", job.vid[:12], record_err)


def build_manifest(vid: str, parent: str | None, step: int | None, message: str, metrics: dict[str, Any],
                   records: list[TensorRecord], plan: WritePlan, arrays: dict[str, ArrayInfo],
                   skeleton: Any, written: list[int] | None = None,
                   reused: dict[int, _Stored] | None = None) -> dict[str, Any]:
    """The version manifest for a single-process snapshot (see docs/format.md).

    ``plan`` covers the ``written`` records (default: all); a ``reused`` record's
    piece points at bytes an earlier version stored, and that array is listed
    in ``arrays`` too. ``size`` counts only the bytes this version wrote.
    """
    reused = reused or {}
    placement = dict(zip(range(len(records)) if written is None else written, plan.placements))
    listed = {a.key: a.to_json() for a in arrays.values()}
    for s in reused.values():
        listed.setdefault(s.array, s.info)

    def pieces(i: int, r: TensorRecord) -> list[dict[str, Any]]:
        box = [[0] * len(r.shape), list(r.shape)]
        if i in reused:
            return [{"box": box, "array": reused[i].array, "offset": reused[i].offset}]
        p = placement[i]
        return [{"box": box, "array": arrays[p.dtype].key, "offset": p.offset}] if p.numel else []

    return {
        "format_version": FORMAT_VERSION,
        "id": vid,
        "parents": [parent] if parent else [],
        "step": step,
        "time": time.time(),
        "message": message,
        "metrics": metrics,
        "host": socket.gethostname(),
        "layout": {"world_size": 1, "ranks": [{"rank": 0}]},
        "size": plan.nbytes,
        "arrays": listed,
        "tensors": [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "pieces": pieces(i, r)}
                    for i, r in enumerate(records)],
        "tree": skeleton,
    }


def _dedup_key(r: TensorRecord) -> DedupKey | None:
    """What must be unchanged for a tensor to be worth hashing; None: never dedup it (CUDA, empty)."""
    t = r.tensor
    if t.device.type != "cpu" or not r.numel:
        return None
    try:
        version = t._version
    except RuntimeError:   # inference tensors have no version counter: the hash alone decides
        version = -1
    return (r.dtype, tuple(t.shape), tuple(t.stride()), t.data_ptr(), version)


def _digest(t: torch.Tensor) -> int:
    """xxh3-128 of a CPU tensor's bytes in row-major order (no copy when contiguous)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    return xxhash.xxh3_128_intdigest(flat.view(torch.uint8).numpy())


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _storage_error(job: _Job, seg: Segment, err: BaseException) -> BaseException:
    if isinstance(err, CkptRepoError):
        return err
    reason = _first_line(err)
    return StorageError(f"writing {job.arrays[seg.dtype].key} elements [{seg.start}, {seg.stop}) failed: {reason}")


def _copy_module_buffers(state: Any, records: list[TensorRecord]) -> None:
    """Copy now the buffers of modules in ``state``: forward may change them (BatchNorm statistics)."""
    ptrs: set[int] = set()
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.nn.Module):
            ptrs.update(b.data_ptr() for b in obj.buffers())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    if ptrs:
        for r in records:
            if r.tensor.data_ptr() in ptrs and r.numel:
                r.tensor = _page_aligned_copy(r.tensor)


def _page_aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that starts on a page (CPU): a new address every snapshot, but always the same
    offset within a page, so the write plan (``live_residues``) stays the same and is not made again."""
    if t.device.type != "cpu":
        return t.clone()
    out = aligned_empty(t.numel() * t.element_size(), LIVE_ALIGN).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _stderr_is_terminal() -> bool:
    try:
        return os.isatty(2)
    except OSError:
        return False


def _wait_with_progress(jobs: list[_Job]) -> None:
    from rich.progress import BarColumn, Progress, TextColumn
    with Progress(TextColumn("ckptrepo: committing snapshots"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  transient=True) as progress:
        task = progress.add_task("wait", total=len(jobs))
        for job in jobs:
            job.handle._done.wait()
            progress.advance(task)


__all__ = ["Snapshotter", "SnapshotHandle", "SnapshotStats", "build_manifest", "parse_size"]
