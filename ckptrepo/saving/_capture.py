"""Lazy asynchronous capture: the snapshot hook of the training loop.

``Snapshotter.snapshot`` only flattens the state (metadata, no tensor bytes)
and queues a job; it returns at once. Three background threads then run the
pipeline, each stage overlapping the others and the training loop:

* capture: copies each segment's tensor slices into a staging buffer from a
  bounded pool (pinned memory and a side stream ordered after the training
  stream by an event on CUDA). A CPU state bound for a local store with
  ``O_DIRECT`` is not copied: each segment becomes a ``LiveShard`` whose whole
  inner chunks are written from the tensors' own memory, only the chunks at
  tensor edges being copied (``_writer.fill_live``); once every segment is
  queued, the capture thread feeds the bytes to the hashes and statistics
  (``_writer.feed_live``); the pre-step hook copies whatever the writers or
  that feed have not read yet. An empty pool makes capture wait
  (backpressure), so host memory stays bounded.
* flush: hands each filled buffer on as one whole shard write (to the direct
  writer's threads for a local store, storage/_localwrite.py; to TensorStore
  otherwise); the buffer returns to the pool when the write is durable.
* commit: in snapshot order, once a version's data is durable, has it
  committed (saving/_commit.py: the manifest, then the branch moved by
  compare-and-swap; two phases under torch.distributed).

The training loop waits only for *capture*, and only before it mutates the
state: ``attach(optimizer)`` installs a pre-step hook that does so, or call
``wait_captured()``. It never waits for storage, nor, for live shards, for the
hashes and statistics: only for the copy of what is still to be read. A failed write never raises
inside training: the version is not committed, a failure record is written, and
the error is raised by the next ``snapshot``/``wait``/``wait_captured``/``close``.

Dedup: a tensor whose bytes did not change since the last version this
snapshotter committed is not written again; its piece points at the stored
bytes (saving/_dedup.py). What the threads share about one snapshot is its
``SnapshotJob`` (saving/_snapshot_job.py).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import os
import queue
import shutil
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np
import torch
import xxhash

from ckptrepo import faults
from ckptrepo.core._boxes import volume
from ckptrepo.core._manifest import (
    COMPRESSION_SETTING,
    CONFIG_KEY,
    DATA_PREFIX,
    Version,
    checked_message,
    checked_meta,
    checked_step,
    new_version_id,
    plain_metrics,
    version_id_time,
)
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core._refs import check_ref_name
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import (
    ArgumentError,
    BackpressureWarning,
    CkptRepoError,
    ConflictError,
    FormatVersionError,
    LayoutError,
    RefError,
    SnapshotFailedError,
    StorageError,
    first_line,
)
from ckptrepo.maintenance._gc import VersionFacts
from ckptrepo.parallel._distributed import all_gather, assign_writers, process_group_rank
from ckptrepo.parallel._replicas import fingerprints
from ckptrepo.parallel._sharding import Piece, ShardedState, Sharder, column_blocks
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.saving._commit import Committer, arrays_listed
from ckptrepo.saving._dedup import DedupIndex, dedup_key, piece_id
from ckptrepo.saving._device_copies import DeviceCopies
from ckptrepo.saving._eager_copies import copy_what_forward_may_change
from ckptrepo.saving._gil import quick_gil_handoffs
from ckptrepo.saving._host_memory import default_host_memory
from ckptrepo.saving._options import SnapshotterOptions
from ckptrepo.saving._pusher import BackgroundPusher, check_push_target
from ckptrepo.saving._snapshot_job import SnapshotHandle, SnapshotJob, SnapshotStats
from ckptrepo.saving._tensor_stats import stat_feeds
from ckptrepo.saving._trackers import tracker_meta
from ckptrepo.saving._waiting import interrupts_deferred, stderr_is_terminal, wait_with_progress
from ckptrepo.saving._writer import (
    FEED_CHUNKS,
    LIVE_ALIGN,
    PlanCache,
    Segment,
    StagingPool,
    feed_live,
    fill_live,
    fill_segment,
    live_residues,
)
from ckptrepo.state._providers import TensorRecord, flatten, is_dtensor
from ckptrepo.storage._arrays import (
    COMPRESSIONS,
    INNER_BYTES,
    SHARD_BYTES,
    ArrayInfo,
    check_compression,
    create_array,
    itemsize,
)
from ckptrepo.storage._chunktable import chunk_crcs, write_table
from ckptrepo.storage._localwrite import DirectWriter, LiveShard

log = logging.getLogger("ckptrepo")


def _refuse_spread_dtensors(records: list[TensorRecord]) -> None:
    """A single_process snapshot holds only what this process has: a DTensor spread over several ranks would be
    committed with the other ranks' parts missing, so it is refused before anything is written."""
    for r in records:
        if is_dtensor(r.tensor) and (ranks := r.tensor.device_mesh.size()) > 1:  # type: ignore[attr-defined]
            raise LayoutError(f"{r.name} is a DTensor over {ranks} ranks, and a single_process "
                              f"snapshotter saves only this process's part; snapshot from every rank (no "
                              f"single_process), or gather it first (full_tensor())")


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer whose ``step()`` really runs: accelerate's ``AcceleratedOptimizer`` and Lightning's
    ``LightningOptimizer`` wrap one in ``.optimizer`` and call its ``step()``, so a hook on the wrapper would
    never fire for steps the framework takes on the inner one."""
    for _ in range(8):   # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def default_local_max_bytes(store: Any) -> int | None:
    """The default bound of a local tier's unpushed data: half the space free on its file system when the
    snapshotter starts, so that a remote falling behind holds the run up instead of filling the disk; None
    (no bound) for a store that is not a local directory."""
    root = store.capabilities.local_root
    if root is None:
        return None
    try:
        return max(1, shutil.disk_usage(root).free // 2)
    except OSError:
        return None


def snapshot_compression(plumbing: Plumbing, compression: Any) -> str | None:
    """The compression a snapshotter's arrays get: ``compression`` ("zstd", or "none"/False: off), or for None
    the repository's setting (``ckptrepo.init(url, compression=...)``)."""
    if compression is not None:
        return check_compression(compression)
    setting = plumbing.config.get(COMPRESSION_SETTING)
    if setting is None or setting in COMPRESSIONS:
        return setting
    raise FormatVersionError(f"{plumbing.url}: {CONFIG_KEY} asks for compression {str(setting)[:20]!r}, which this "
                             f"ckptrepo does not write; upgrade ckptrepo, or pass compression='none'")


class Snapshotter:
    """Asynchronous snapshots of a training state onto the current branch.

    The contract: after ``snapshot(state)`` returns, the tensors in ``state``
    must not be modified in place until capture has finished, which the
    attached optimizer's pre-step hook (or ``wait_captured()``) guarantees.
    Reading them (forward, backward) is fine, and so is writing gradients.
    Plain Python values and the structure are recorded during ``snapshot``
    itself. Buffers of ``nn.Module``s in the state (BatchNorm running
    statistics change in forward) are copied during ``snapshot``, those of
    modules held by a Stateful object in it too, and so is every tensor that
    is not a parameter or state of an attached optimizer, up to 16 MiB with an
    optimizer attached and 64 KiB without: that covers the buffers of a
    ``model.state_dict()`` (DCP's way), whose module the snapshot never sees.
    A larger tensor that forward changes in place must come with its module,
    or be copied by the caller: a change before its bytes are written is
    saved as changed (only one while they are written fails the checksum).

    With ``dedup`` (the default), a tensor (a rank's piece of one) whose bytes
    equal those stored for it in the parent version is not written again: its
    piece points at the stored bytes (saving/_dedup.py). The training thread
    only compares (data_ptr, version counter, dtype, shape, stride); the
    capture thread confirms with a digest of the bytes, taken on the GPU for
    CUDA tensors.

    With ``push_to`` (a remote's name), the snapshotter is a local tier in front of that remote: each version
    is committed here, then pushed in the background (saving/_pusher.py; rank 0 under torch.distributed),
    starting with whatever an earlier run left unpushed. ``local_keep_last`` deletes here the data of the
    branch's versions beyond the newest N once the remote holds them (remotes/_evict.py: they still load,
    from the remote). ``local_max_bytes`` bounds the data here that the remote lacks (default: half the
    free disk); a snapshot that would pass it waits for the pusher (``on_full="wait"``) or is skipped
    (``"skip"``: its handle says ``skipped``), with a ``BackpressureWarning`` either way. A failed push is
    raised by the next call, like a failed snapshot; ``wait()`` also waits for the pushes.
    """

    def __init__(self, plumbing: Plumbing, options: SnapshotterOptions | None = None, *,
                 record_failures: bool = True, **keywords: Any) -> None:
        # the options, checked once when made (saving/_options.py): given whole, or as repo.snapshotter's keywords
        self.options = options = SnapshotterOptions.given(options, keywords)
        # the arrays' lossless compression (None: the repository's setting); compressed shards are encoded and
        # written by TensorStore from staged copies, never from the tensors' memory (decisions/035)
        self.compression = snapshot_compression(plumbing, options.compression)
        # per-tensor statistics taken while capturing (saving/_tensor_stats.py), which trajectory questions read
        self.tensor_stats = options.tensor_stats
        single_process, parallel_layout, retention = (options.single_process, options.parallel_layout,
                                                      options.retention)
        tier = options.tier
        push_to = None if tier is None else tier.push_to
        on_full = "wait" if tier is None else tier.on_full
        max_in_flight, group, dedup = options.max_in_flight, options.group, options.dedup
        # backpressure when storage is slower than the snapshots: with nothing bounding them, snapshot() calls
        # pile up in flight without limit, and a state of small tensors (copied at snapshot(), outside the
        # staging pool) takes memory far beyond host_memory
        self.max_in_flight = max_in_flight
        # single_process: this process snapshots the whole state alone, as if torch.distributed had one rank (a
        # framework that saves on rank 0 only, as Lightning and the HF Trainer do under DDP)
        self.rank, self.world_size = (0, 1) if single_process else process_group_rank()
        self.single_process = single_process
        if single_process and parallel_layout is not None and parallel_layout.world_size > 1:
            raise LayoutError(f"a single_process snapshotter saves the whole state from this process alone, so it "
                              f"takes no layout of several ranks ({parallel_layout}); leave single_process off to "
                              f"snapshot from every rank")
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
        self.plumbing = plumbing
        if plumbing.plans is None:   # the handle's first snapshotter: the next ones reuse its plans
            plumbing.plans = PlanCache()
        self.plans = plumbing.plans
        self.record_failures = record_failures  # False when the caller waits and gets the error itself
        # reads HEAD: DetachedHeadError before anything starts
        self._committer = Committer(plumbing, parallel_layout, self.rank, self.world_size, self.sharded,
                                    options.commit_timeout_s)
        self._committer.before_ref = self._recheck_reused
        # compares with the branch tip first, whoever wrote it, then with this snapshotter's last commit
        self._dedup = DedupIndex(self._committer.tip, plumbing.manifest, plumbing.store) if dedup else None
        self.host_memory = options.host_bytes or default_host_memory()
        shard = min(SHARD_BYTES, max(INNER_BYTES, self.host_memory // 2 // INNER_BYTES * INNER_BYTES))
        self.shard_bytes = shard
        pin = torch.cuda.is_available() if options.pin_memory is None else options.pin_memory
        # local store: plain shards written without TensorStore
        self._direct = DirectWriter.for_store(plumbing.store) if self.compression is None else None
        # page-aligned buffers where the direct writer may write them with O_DIRECT as they are (fill_live)
        self.pool = StagingPool(shard, max(2, self.host_memory // shard), pin=pin,
                                align=LIVE_ALIGN if self._direct is not None and self._direct.direct_io else 0)
        # TensorStore may reference a staging buffer instead of copying it; fine where the store copies the
        # bytes out before the write completes, but a store that keeps the buffer as the stored value would
        # see the pool reuse it for another shard
        self._store_copies = not plumbing.store.capabilities.keeps_written_buffers
        self._capture_q: queue.Queue = queue.Queue()
        self._flush_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._inflight: list[SnapshotJob] = []
        # committed or failed, their done callbacks still running: wait() and close() wait for these too
        self._finishing: list[SnapshotJob] = []
        self._errors: list[CkptRepoError] = []   # failed snapshots, background gc passes and pushes
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._hooks: list[Any] = []
        self._optimizers: list[weakref.ref] = []   # attached: what their step changes, capture may leave live
        self._closed = False
        self._pid = os.getpid()   # a forked child inherits this object but none of its threads
        self._bare_versions: dict[str, tuple[int, int]] = {}   # see copy_what_forward_may_change
        self._side_stream: Any = None
        self._device_copies = DeviceCopies()   # a CUDA state's source views, kept per plan
        ref = weakref.ref(self)
        def close_at_exit() -> None:
            s = ref()
            if s is not None:
                s._close_at_exit()
        self._atexit = close_at_exit
        self.push_to = push_to
        self.on_full = on_full
        self._pusher: BackgroundPusher | None = None
        if push_to is not None:
            check_push_target(plumbing, push_to)   # an unknown remote, or this repository itself: one line
            if on_full == "skip" and self.distributed:
                raise ArgumentError("on_full='skip' needs a single process (every rank would have to skip the "
                                    "same snapshot); use on_full='wait'")
            assert tier is not None
            if self.rank == 0:   # one pusher per version: the rank that commits it
                self._pusher = BackgroundPusher(
                    plumbing, push_to, self._committer.branch, tier.keep_last,
                    tier.max_bytes_parsed or default_local_max_bytes(plumbing.store), self._pusher_failed,
                    self._reusable)
        atexit.register(self._atexit)

    # ---- public API -------------------------------------------------------
    def snapshot(self, state: Any, step: int | None = None, message: str = "",
                 metrics: dict[str, Any] | None = None, *, tag: str | None = None, force_tag: bool = False,
                 meta: dict[str, str] | None = None) -> SnapshotHandle:
        """Start a snapshot of ``state`` and return its handle at once (see the class contract).

        ``tag``: created by the commit thread right after the commit, so the loop never waits for it; with
        ``force_tag`` an existing tag of that name moves to the new version (``git tag -f``: what a file name
        that a framework overwrites, such as Lightning's ``last.ckpt``, needs). ``meta``: text key/values kept
        in the version's header (``Version.meta``), e.g. a tracker's run id.
        """
        t0 = time.perf_counter()
        try:
            self._check_process()
            self._raise_pending()
            if self._closed:
                raise CkptRepoError("this snapshotter is closed; create another with repo.snapshotter()")
            if self._committer.conflict is not None:   # its data could never be committed: refused before written
                raise ConflictError(self._committer.conflict)
            self._wait_for_room()
            step, message, metrics = checked_step(step), checked_message(message), plain_metrics(metrics)
            # the tracker runs active in this process (W&B, MLflow), unless the caller's meta says otherwise
            meta = checked_meta(meta)
            meta = {**tracker_meta(), **(meta or {})} or None
            self._check_tag(tag, force_tag)
            skeleton, records = flatten(state)
            if self._pusher is not None:
                nbytes = sum(r.numel * itemsize(r.dtype) for r in records)
                if not self._pusher.make_room(nbytes, self.on_full == "wait", lambda u: self._warn_full(u, nbytes,
                                                                                                        step)):
                    return self._skipped(step, t0)
                self._raise_pending()   # a push that failed while snapshot() waited for room
            # DTensors in a single process (a mesh of one device) are pieces of global tensors all the same: the
            # fill paths below cannot read a tensor subclass's memory, and the version must hold them by their
            # global names and shapes, as a larger mesh would
            sharded = self.sharded or any(is_dtensor(r.tensor) for r in records)
            if self.single_process:
                _refuse_spread_dtensors(records)
            # of the live tensors, before buffer copies
            keys = [dedup_key(r) for r in records] if self._dedup is not None and not sharded else []
            ids = [piece_id(r.name, ((0,) * len(r.shape), r.shape)) for r in records] if keys else []
            self._bare_versions = copy_what_forward_may_change(state, records, self._step_owned(),
                                                                self._bare_versions)
            local = self._local_pieces(records) if sharded else None
        except Exception as err:
            if self.distributed:   # the other ranks are entering the collective: tell them, or they wait forever
                self._exchange_pieces(None, err)
            raise
        vid = new_version_id()
        leaf_names: list[str] = []
        names: list[Any] = []
        boxes: list[Any] = []
        if local is not None:
            vid, records, boxes, leaf_names, names = self._shard(records, local)
            if self._dedup is not None:   # of this rank's pieces (views of the live tensors)
                keys = [dedup_key(r) for r in records]
                ids = [piece_id(r.name, box) for r, box in zip(records, boxes)]
        handle = SnapshotHandle(vid, step)
        job = SnapshotJob(handle, skeleton, records, None, message, metrics, started=t0, sharded=local is not None,
                   record_stats=self.tensor_stats,
                   meta=meta, tag=tag, force_tag=bool(force_tag),
                   leaf_names=leaf_names, names=names, boxes=boxes, keys=keys, ids=ids,
                   replicas=[] if local is None else [(p.name, p.box, p.view, p.replicated) for p in local[0].pieces
                                                      if p.replicated])
        # a CPU state to a local store with O_DIRECT is written from where it is (not for CUDA tensors: their
        # bytes must come to the host anyway, and whole-segment DMAs into pinned staging are the cheap way)
        job.live = self._direct is not None and self._direct.direct_io and not any(r.tensor.is_cuda for r in records)
        if self._dedup is None or not self._dedup.match(job):
            self._plan(job, list(range(len(records))))   # nothing can be reused: plan here, as without dedup
        devices = {r.tensor.device for r in records if r.tensor.device.type == "cuda"}
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            job.ready.append(ev)
        # snapshot() from several threads: one set of threads, jobs queued in one order. A Ctrl-C landing between
        # these steps would leave a job in flight that no thread ever finishes, and wait(), close() and exit would hang
        with interrupts_deferred(), self._lock:
            self._start_threads()
            if self._pusher is not None:
                self._pusher.reserve(vid, sum(r.numel * itemsize(r.dtype) for r in records))
            self._inflight.append(job)
            self._capture_q.put(job)   # unbounded queues: never blocks under the lock
            self._commit_q.put(job)
        handle.stats.blocking_s += time.perf_counter() - t0
        return handle

    def _check_tag(self, tag: Any, force: Any) -> None:
        """Refuse at ``snapshot()`` a tag the commit thread could not create: a bad name, or (unless ``force``) one
        that exists. A tag made by another writer between this check and the commit is reported by the next call."""
        if tag is None:
            return
        if not isinstance(tag, str):
            raise ArgumentError(f"tag must be a str, not {type(tag).__name__}")
        if not isinstance(force, bool):
            raise ArgumentError(f"force_tag must be True or False, not {force!r}")
        check_ref_name(tag, "tag")
        if self.rank == 0:
            if not force and tag in self.plumbing.refs.tags(strict=False):
                raise RefError(f"tag {tag!r} exists; pick another name, or pass force_tag=True to move it")
            self.plumbing.refs.check_tag_name(tag, may_exist=force)

    def _tag(self, job: SnapshotJob) -> None:
        """Rank 0 puts the job's tag on its committed version; a failure is raised by the next call (the version
        itself is committed)."""
        if job.tag is None or self.rank != 0:
            return
        try:
            self.plumbing.refs.set_tag(job.tag, job.vid, force=job.force_tag)
        except CkptRepoError as err:
            failure = RefError(f"version {job.vid[:12]} was committed, but tag {job.tag!r} was not set: "
                               f"{first_line(err)}; tag it with `ckptrepo tag {job.tag} {job.vid[:12]}`")
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)

    def _plan(self, job: SnapshotJob, written: list[int]) -> None:
        """Plan the records to write (all but the reused ones) and account for their segments.

        Runs in ``snapshot()``, or in the capture thread once dedup has decided;
        either way before any segment of the job is queued.
        """
        records = [job.records[i] for i in written]
        residues = live_residues(records, INNER_BYTES) if job.live else None
        plan = self.plans.get(records, self.shard_bytes, residues)
        job.written = written
        job.plan_index = {ri: pi for pi, ri in enumerate(written)}
        job.arrays = {d: ArrayInfo(f"{DATA_PREFIX}{job.vid}/{self.rank}/{d}", d, n, s, i, compression=self.compression)
                      for d, (n, s, i) in plan.streams.items()}
        job.chunk_crcs = {d: np.zeros(info.chunks, dtype="<u4") for d, info in job.arrays.items()}
        # CUDA tensors were hashed on their device before (DedupIndex.decide): nothing of theirs is hashed here
        job.hashers = {pi: xxhash.xxh3_128() for pi, ri in enumerate(written)
                       if ri in job.watch and not job.records[ri].tensor.is_cuda}
        # statistics of each whole tensor a single-process snapshot writes (pieces of global tensors: none)
        job.stats, job.feeds = stat_feeds(job, records, job.hashers) if self.tensor_stats else ({}, dict(job.hashers))
        job.handle.stats.bytes = plan.nbytes
        job.remaining = len(plan.segments)
        job.plan = plan
        if job.remaining == 0:
            job.data_done.set()

    def _local_pieces(self, records: list[TensorRecord]) -> tuple[ShardedState, list[Piece]]:
        """This rank's pieces of the global tensors (raises here, before the collective, for a state that does
        not fit the layout)."""
        # without a layout (DTensor placements say what each rank holds) every rank is its own data-parallel slot
        layout = self.layout or ParallelLayout(dp=self.world_size)
        sharded = Sharder(layout, self.rank, self.rank).shard(records)
        return sharded, column_blocks(sharded.pieces)

    def _exchange_pieces(self, meta: list[tuple[str, Any, int]] | None, failure: Exception | None = None) -> list[Any]:
        """The one collective of a distributed snapshot: every rank's (proposed version id, piece metadata).

        A rank whose own checks failed (``failure``) still joins it, with its error in place of the metadata,
        so that every rank raises at the same call instead of waiting in the collective until its timeout.
        """
        mine = (new_version_id(), meta) if failure is None else \
            (None, f"{type(failure).__name__}: {first_line(failure)}")
        try:
            gathered = all_gather(mine, self.group) if self.distributed else [mine]
        except Exception as err:   # gloo's "Connection closed by peer": a rank died
            cause = f"the snapshot collective failed: {first_line(err)}"
            self._committer.health.mark_broken(cause)   # the snapshots in flight fail now, not at their timeouts
            raise SnapshotFailedError(f"{cause}; a rank died or the process group is down: restart every rank and "
                                      f"resume from the last committed version") from err
        refused = [(r, g[1]) for r, g in enumerate(gathered) if g[0] is None]
        if refused and failure is None:
            r, why = refused[0]
            raise SnapshotFailedError(f"rank {r} refused this snapshot ({why}); no version was written, "
                                      f"fix the state on that rank")
        return gathered

    def _shard(self, records: list[TensorRecord], local: tuple[ShardedState, list[Piece]]) -> \
            tuple[str, list[TensorRecord], list[Any], list[str], list[list[Any]]]:
        """Sharded: this rank's pieces, the agreed version id, and which pieces this rank writes."""
        sharded, pieces = local
        meta = [(p.name, p.box, volume(p.box[1]) * p.view.element_size()) for p in pieces]
        gathered = self._exchange_pieces(meta)
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
        self._check_process()
        if self._closed:
            raise CkptRepoError("this snapshotter is closed; attach the optimizer to a new one (repo.snapshotter())")
        optimizer = unwrapped_optimizer(optimizer)
        if not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise ArgumentError(f"attach() takes a torch.optim.Optimizer, whose step() then waits for capture, not "
                                f"{type(optimizer).__name__} {optimizer!r:.40}")

        def pre_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if os.getpid() == self._pid:   # in a forked child this snapshotter has nothing in flight
                self._wait_for_capture()
        self._hooks.append(optimizer.register_step_pre_hook(pre_step))
        self._optimizers.append(weakref.ref(optimizer))

    def _step_owned(self) -> set[int]:
        """Addresses of the tensors only an attached optimizer's step changes (its parameters and their state),
        which capture may leave live however small: the step waits for capture."""
        owned: set[int] = set()
        for ref in self._optimizers:
            opt = ref()
            if opt is None:
                continue
            for group in opt.param_groups:
                owned.update(p.data_ptr() for p in group["params"])
            for st in opt.state.values():
                owned.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return owned

    def wait_captured(self) -> None:
        """Block until every snapshot taken so far is in staging memory: the state may be mutated again."""
        self._check_process()
        self._wait_for_capture()
        self._raise_pending()

    def wait(self, progress: bool | None = None, remote: bool = True) -> None:
        """Block until every snapshot taken so far is committed (or failed); raise the first failure. With
        ``push_to``, also until the remote holds them (``remote=False``: committed here is enough)."""
        self._check_process()
        jobs = self._pending_jobs()
        show = progress if progress is not None else stderr_is_terminal()
        if show and jobs:
            wait_with_progress(jobs)
        for job in jobs:
            job.handle._done.wait()
        self._retention_idle.wait()   # a gc pass after the last commit: its failure is raised here too
        if remote and self._pusher is not None:
            self._pusher.wait()
        self._raise_pending()

    def close(self) -> None:
        """Finish every pending snapshot, stop the threads and detach hooks; raise a pending failure."""
        self._check_process()
        if self._closed:
            self._raise_pending()
            return
        for job in self._pending_jobs():
            job.handle._done.wait()
        self._shutdown()
        if self._pusher is not None:   # the last versions reach the remote before close returns
            self._pusher.close()
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
    def _check_process(self) -> None:
        """Refuse use in a forked child: its snapshots would wait forever for threads that live in the parent."""
        if os.getpid() != self._pid:
            raise CkptRepoError(f"this snapshotter belongs to process {self._pid}, not to this forked child; "
                                f"create one here with repo.snapshotter()")

    def _wait_for_room(self) -> None:
        """Hold ``snapshot()`` while ``max_in_flight`` snapshots are not committed yet (the oldest commits first)."""
        while True:
            with self._lock:
                if len(self._inflight) < self.max_in_flight:
                    return
                oldest = self._inflight[0]
            oldest.handle._done.wait()

    def _pending_jobs(self) -> list[SnapshotJob]:
        with self._lock:
            return self._finishing + self._inflight

    def _wait_for_capture(self) -> None:
        t0 = time.perf_counter()
        jobs = [j for j in self._pending_jobs() if not j.handle.captured()]
        for job in jobs:
            if job.live:   # what the writers have not written yet is copied out of the state now
                job.staged.wait()
                with interrupts_deferred():   # a Ctrl-C inside a release would lose its hold and hang the next step
                    copied = sum(shard.release(_team_copy) for shard in list(job.live_shards))
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

    def _warn_full(self, unpushed: int, nbytes: int, step: int | None) -> None:
        assert self._pusher is not None and self._pusher.max_bytes is not None
        what = "waits for the push" if self.on_full == "wait" else "is skipped"
        at = "" if step is None else f" at step {step}"
        warnings.warn(f"ckptrepo: the local tier holds {_size(unpushed)} not pushed to {self.push_to!r} yet; the "
                      f"snapshot{at} ({_size(nbytes)}) would pass local_max_bytes={_size(self._pusher.max_bytes)}, "
                      f"so it {what} (on_full={self.on_full!r}); the remote is slower than the snapshots: "
                      f"snapshot less often or raise local_max_bytes", BackpressureWarning, stacklevel=4)

    def _skipped(self, step: int | None, t0: float) -> SnapshotHandle:
        """The handle of a snapshot not taken (``on_full="skip"``): done at once, ``skipped`` set."""
        handle = SnapshotHandle(new_version_id(), checked_step(step))
        reason = SnapshotFailedError(f"the snapshot{'' if step is None else f' at step {step}'} was skipped: the "
                                     f"local tier was full (local_max_bytes) while the push to {self.push_to!r} "
                                     f"caught up (on_full='skip')")
        handle._skip(reason)
        handle.stats.blocking_s = time.perf_counter() - t0
        return handle

    def _pusher_failed(self, failure: CkptRepoError) -> None:
        with self._lock:
            self._errors.append(failure)

    def _reusable(self) -> set[str]:
        """The arrays the next snapshots may point at instead of writing (dedup): local retention keeps them."""
        out = set() if self._dedup is None else {s.array for s in self._dedup.stored.values()}
        for job in self._pending_jobs():
            out.update(s.array for s in job.match.values())
        return out

    def _start_threads(self) -> None:
        """Start the capture, flush and commit threads, or whichever of them an interrupted start left unstarted."""
        if not self._threads:
            self._threads = [threading.Thread(target=target, name=f"ckptrepo-{name}", daemon=True)
                             for name, target in (("capture", self._capture_loop), ("flush", self._flush_loop),
                                                  ("commit", self._commit_loop))]
        for t in self._threads:
            if t.ident is None:
                t.start()

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
        if self._closed or os.getpid() != self._pid:   # a forked child's exit: the parent's snapshots, not its own
            return
        try:
            self.close()
        except CkptRepoError as err:
            log.error("ckptrepo: %s", err)

    # capture thread
    # Each loop lets go of its last item before it waits for the next (``del``): a job kept by a waiting thread
    # would live on until the next snapshot, long enough for the cyclic GC to promote its thousands of objects
    # (records, skeleton lists, tensor objects) to its oldest generation, which brings on full collections.
    def _capture_loop(self) -> None:
        while True:
            job = self._capture_q.get()
            if job is None:
                self._flush_q.put(None)
                return
            try:
                # a CUDA capture is a few hundred short torch calls, each taking the GIL back (saving/_gil.py)
                with quick_gil_handoffs() if job.ready else contextlib.nullcontext():
                    self._capture(job)
            except BaseException as err:  # noqa: BLE001 - reported through the job
                job.fail(err)
            finally:
                job.staged.set()
                job.drop_hold()   # captured now, or once its live shards are written and fed, or released
            self._feed(job)
            del job

    def _feed(self, job: SnapshotJob, final: bool = True) -> None:
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

    def _capture(self, job: SnapshotJob) -> None:
        cuda = bool(job.ready)
        if cuda and self._side_stream is None:
            # a high priority: the hash and statistics kernels run between the training step's kernels instead
            # of after them, since the optimizer's step waits for this capture
            self._side_stream = torch.cuda.Stream(device=next(r.tensor.device for r in job.records if r.tensor.is_cuda),
                                                  priority=-1)
        for ev in job.ready:   # every kernel the side stream runs below comes after the training stream's snapshot()
            self._side_stream.wait_event(ev)
        if job.plan is None:
            assert self._dedup is not None   # only dedup defers the plan
            try:   # CUDA tensors are hashed on the side stream
                with torch.cuda.stream(self._side_stream) if cuda else contextlib.nullcontext():
                    self._plan(job, self._dedup.decide(job))
            except BaseException:
                job.data_done.set()   # no segment was queued; the commit thread sees the job's error
                raise
        plan = job.plan
        assert plan is not None
        flat: dict[int, torch.Tensor] = {}
        if cuda and self.pool.pin:   # the buffers this capture would otherwise pin one by one (see StagingPool)
            self.pool.grow_in_background(len(plan.segments))
        if job.replicas:   # read before the state may change again; a CUDA one once the training stream is done
            with torch.cuda.stream(self._side_stream) if cuda else contextlib.nullcontext():
                job.fingerprints = fingerprints(job.replicas)
            job.replicas = []

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
            for k, seg in enumerate(plan.segments):
                if job.feeding and not self.pool.has_room():
                    # a pool smaller than the snapshot: the buffers of queued live shards come back only once
                    # they are fed too, so feed them now rather than wait for ever
                    self._feed(job, final=False)
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
                        # the tensors until the writer has written it and the feed read it, or the pre-step hook
                        # copies it. The feed (hashes, statistics) comes after every segment is queued (_feed)
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
                            self._start_feeding(job).append((seg, view, source, cb))
                    elif cuda:
                        # one _foreach_copy_ per segment over views kept per plan (saving/_device_copies.py): a
                        # few calls per segment, so capture does not wait for the GIL once per tensor
                        with torch.cuda.stream(self._side_stream):
                            if last_event is None:
                                self._device_copies.prepare(plan, [job.records[r].tensor for r in job.written],
                                                            self._side_stream)
                            view = self._device_copies.fill(k, seg, buf, source, job.feeds)
                            last_event = torch.cuda.Event()
                            last_event.record(self._side_stream)
                    else:
                        view = fill_segment(seg, source, buf, hashers=job.feeds)
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

    @staticmethod
    def _start_feeding(job: SnapshotJob) -> list[Any]:
        """The job's list of shards to feed; made (and counted as one more part of its data) at the first, while
        the segment of that shard is not queued yet (so the job's data cannot be done before)."""
        if job.feeding is None:
            with job.lock:
                job.remaining += 1   # done by _feed
            job.feeding = []
        return job.feeding

    # flush thread
    def _flush_loop(self) -> None:
        while True:
            item = self._flush_q.get()
            if item is None:
                return
            self._flush(*item)
            del item

    def _flush(self, job: SnapshotJob, seg: Segment, buf: torch.Tensor, view: Any, event: Any) -> None:
        """Start one segment's write; its buffer goes back to the pool once the write is over."""
        if job.error is not None or view is None:
            self._segment_over(view, buf)
            job.segment_done()
            return
        try:
            if event is not None:
                event.synchronize()
            handle = job.handles.get(seg.dtype)
            if handle is None:
                handle = job.handles[seg.dtype] = create_array(self.plumbing.store, job.arrays[seg.dtype])
            faults.point("before_shard_write")
            if not job.first_write:
                job.first_write = time.perf_counter()
            # a local store: one whole shard object written directly (storage/_localwrite.py), durable once the future
            # completes, like TensorStore's commit future; otherwise (or for an odd segment) through TensorStore
            info = job.arrays[seg.dtype]
            fut: Any   # a concurrent Future from the direct writer, or TensorStore's commit future
            if isinstance(view, LiveShard):
                assert self._direct is not None   # live shards are planned only for a direct writer
                fut = self._direct.submit_live(info, seg.start, view)
            else:
                fut = None if self._direct is None else self._direct.submit(info, seg.start, view)
            if fut is None:
                fut = handle[seg.start:seg.stop].write(
                    view, can_reference_source_data_indefinitely=self._store_copies).commit
                # TensorStore keeps the crc32cs it takes to itself: the chunk table's are taken here, while it
                # writes (the buffer is the segment's until its write is over, and fastcrc lets go of the GIL)
                job.record_crcs(seg, chunk_crcs(info, view))
        except BaseException as err:  # noqa: BLE001
            self._segment_over(view, buf)
            job.segment_done(_storage_error(job, seg, err, self.plumbing.url, self.push_to is not None))
            return
        def written(f: Any, job: SnapshotJob = job, seg: Any = seg, buf: torch.Tensor = buf, view: Any = view) -> None:
            self._written(job, seg, buf, view, f)
        fut.add_done_callback(written)

    def _segment_over(self, view: Any, buf: torch.Tensor) -> None:
        """A segment's write is over (durable, failed or never started): its buffer goes back to the pool, and a
        live shard lets go of the tensors (nothing reads their memory any more)."""
        if isinstance(view, LiveShard):
            view.finish()   # gives the buffer back, now or once the feed is over too
            return
        self.pool.give(buf)

    def _written(self, job: SnapshotJob, seg: Segment, buf: torch.Tensor, view: Any, fut: Any) -> None:
        err = None
        try:
            crcs = fut.result()
            if isinstance(crcs, np.ndarray):   # the direct writer's; TensorStore's were taken before its write
                job.record_crcs(seg, crcs)
        except BaseException as e:  # noqa: BLE001
            err = _storage_error(job, seg, e, self.plumbing.url, self.push_to is not None)
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
            try:
                retain = self._commit_in_turn(job)
            except BaseException:  # noqa: BLE001 - this thread must outlive any job, or every later one hangs
                log.exception("ckptrepo: the commit thread failed on snapshot %s", job.vid[:12])
                retain = False
            del job
            if retain:
                try:
                    self._apply_retention()
                finally:
                    self._retention_idle.set()

    def _commit_in_turn(self, job: SnapshotJob) -> bool:
        """Commit the job once its data is durable (or record its failure); returns whether a retention pass is due."""
        job.data_done.wait()
        job.handle._captured.wait()
        stats = job.handle.stats
        retain = False
        if job.first_write:
            stats.flush_s = time.perf_counter() - job.first_write
        try:
            if job.error is not None:
                raise job.error
            if self.rank != 0:
                # a broken group fails the job here, before its part is published: rank 0 (if alive) reads the
                # failure and aborts, instead of committing a version this rank has already given up on. Rank 0
                # itself still looks once for every part (Staging.gather_ranks), and commits a version whose
                # parts are all in
                self._committer.health.check()
            faults.point("after_data")
            version = self._commit(job)
        except BaseException as err:  # noqa: BLE001
            if self.distributed:
                self._committer.publish_failure(job, err)
            self._record_failure(job, err)
            if self._pusher is not None:
                self._pusher.dropped(job.vid)
        else:
            stats.total_s = time.perf_counter() - job.started
            job.handle._version = version
            self._tag(job)
            self._commits += 1
            if self._pusher is not None:
                self._pusher.committed(job.vid, stats.bytes)
            if self.retention is not None and self.rank == 0 \
                    and self._commits % max(1, self.retention.every_commits) == 0:
                retain = True
                self._retention_idle.clear()   # before the job is done, so wait() also waits for this gc
        finally:
            # out of the in-flight count (a callback may snapshot again without waiting for its own job), but
            # still waited for by wait() and close() until its callbacks have run
            with self._lock:
                self._inflight.remove(job)
                self._finishing.append(job)
            try:
                job.handle._finish()
            finally:
                with self._lock:
                    self._finishing.remove(job)
        return retain

    def _commit(self, job: SnapshotJob) -> Version:
        job.arrays = {d: write_table(self.plumbing.store, info, job.chunk_crcs[d]) for d, info in job.arrays.items()}
        if self._dedup is not None and job.reused:
            self._dedup.check_reused(self.plumbing.store, job, arrays_listed({}, job.reused))

        version = self._committer.commit(job)
        if self._dedup is not None:
            self._dedup.remember(job)
        return version

    def _recheck_reused(self, job: SnapshotJob, manifest: Manifest) -> None:
        """Between the manifest and the ref: the reused arrays again, every rank's (those of the manifest that
        are not this version's own). A prune that began meanwhile either reads this manifest (and keeps what it
        reuses) or has its intent seen here (maintenance/_gc.py prune_version)."""
        own = f"{DATA_PREFIX}{job.vid}/"
        reused = {k: a for k, a in manifest.arrays.items() if not k.startswith(own)}
        if self._dedup is not None and reused:
            self._dedup.check_reused(self.plumbing.store, job, reused, announced=True)

    def _apply_retention(self) -> None:
        """Background gc after a commit; a failure is logged and raised by the next call, like a failed snapshot."""
        with self._lock:   # never collect what this snapshotter has in flight, or starts meanwhile
            born = [version_id_time(j.vid) or 0.0 for j in self._inflight]
        since = min(born + [time.time()]) - 1.0
        assert self.retention is not None   # called only when a policy was given
        try:
            # a version the remote does not hold yet keeps its data here, or it would reach the remote as history only
            unpushed = self._pusher.unpushed() if self._pusher is not None else []
            self.retention.apply(self.plumbing, protect_since=since, known=self._gc_facts, keep_also=unpushed)
        except Exception as err:  # noqa: BLE001 - never kills the commit thread
            failure = SnapshotFailedError(f"background retention (gc) failed: {first_line(err)}; "
                                          f"run `ckptrepo gc` by hand")
            failure.__cause__ = err
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)

    def _record_failure(self, job: SnapshotJob, err: BaseException) -> None:
        step = "" if job.handle.step is None else f" at step {job.handle.step}"
        cause = first_line(err)
        failure = SnapshotFailedError(f"snapshot {job.vid[:12]}{step} was not committed: {cause}")
        failure.__cause__ = err
        job.handle._error = failure
        if not self.record_failures:  # the caller waits on the handle and gets the error from it
            return
        with self._lock:
            self._errors.append(failure)
        log.error("ckptrepo: %s", failure)
        self._committer.record_failure(job, cause)   # rank 0 records the failure of a distributed version


def _team_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy bytes with torch's intra-op threads: the pre-step hook runs in the training thread, whose team is idle
    while it waits there, so the copy of what the writers have not reached takes every core, not one."""
    torch.from_numpy(dst).copy_(torch.from_numpy(src))


def _storage_error(job: SnapshotJob, seg: Segment, err: BaseException, store_url: str, tier: bool) -> BaseException:
    if isinstance(err, CkptRepoError):
        return err
    reason = first_line(err)
    key = job.arrays[seg.dtype].key
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


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


__all__ = ["Snapshotter", "SnapshotHandle", "SnapshotStats"]   # the handle and stats: re-exported API
