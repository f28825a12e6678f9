"""Lazy asynchronous capture: the snapshot hook of the training loop, and its lifecycle.

``Snapshotter.snapshot`` only flattens the state (metadata, no tensor bytes), plans it and queues a job; it
returns at once. Three background threads then run the stages, each overlapping the others and the
training loop, each a module with a narrow interface:

* capture (saving/_capture_stage.py): each segment's bytes into a staging buffer from a bounded pool, or,
  for a CPU state bound for a local store with ``O_DIRECT``, a live shard written from the tensors' memory;
* flush (saving/_flush_stage.py): each buffer handed on as one whole shard write; the buffer returns to the
  pool when the write is durable;
* commit (saving/_commit_stage.py): in snapshot order, once a version's data is durable, its commit
  (saving/_commit.py: the manifest, then the branch moved by compare-and-swap; two phases under
  torch.distributed), then its tag, its push and retention.

The training loop waits only for *capture*, and only before it mutates the state: ``attach(optimizer)``
installs a pre-step hook that does so, or call ``wait_captured()``. It never waits for storage, nor, for
live shards, for the hashes and statistics: only for the copy of what is still to be read. A failed write
never raises inside training: the version is not committed, a failure record is written, and the error is
raised by the next ``snapshot``/``wait``/``wait_captured``/``close``.

Dedup: a tensor whose bytes did not change since the last version this snapshotter committed is not
written again; its piece points at the stored bytes (saving/_dedup.py). What the threads share about one
snapshot is its ``SnapshotJob`` (saving/_snapshot_job.py); the options are ``SnapshotterOptions``
(saving/_options.py).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ckptrepo.arguments import checked_message, checked_meta, checked_step
from ckptrepo.core import Plumbing, plain_metrics
from ckptrepo.errors import (
    ArgumentError,
    CkptRepoError,
    ConflictError,
    SnapshotFailedError,
)
from ckptrepo.parallel import process_group_rank
from ckptrepo.saving._capture_stage import CaptureStage
from ckptrepo.saving._commit import Committer, read_branch_base
from ckptrepo.saving._commit_stage import CommitStage
from ckptrepo.saving._dedup import DedupIndex
from ckptrepo.saving._eager_copies import copy_what_forward_may_change, step_owned
from ckptrepo.saving._flush_stage import FlushStage
from ckptrepo.saving._host_memory import default_host_memory
from ckptrepo.saving._node_push import finish_leftover, tier_pusher
from ckptrepo.saving._options import SnapshotterOptions, snapshot_compression
from ckptrepo.saving._prepare import JobMaker, Planner, Sharding, refuse_spread_dtensors
from ckptrepo.saving._pusher import check_tier, skipped_handle
from ckptrepo.saving._snapshot_job import SnapshotHandle, SnapshotJob, SnapshotStats
from ckptrepo.saving._startup import Cluster, start_cluster
from ckptrepo.saving._step_clock import StepClock
from ckptrepo.saving._trackers import tracker_meta
from ckptrepo.saving._waiting import interrupts_deferred, stderr_is_terminal, wait_with_progress
from ckptrepo.saving._writer import LIVE_ALIGN, PlanCache, StagingPool
from ckptrepo.state import flatten, is_dtensor
from ckptrepo.storage import INNER_BYTES, SHARD_BYTES, DirectWriter, itemsize

log = logging.getLogger("ckptrepo")


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
        self.options = opts = SnapshotterOptions.given(options, keywords)
        # the arrays' lossless compression (None: the repository's setting); compressed shards are encoded and
        # written by TensorStore from staged copies, never from the tensors' memory (decisions/035)
        self.compression = snapshot_compression(plumbing, opts.compression)
        # per-tensor statistics taken while capturing (saving/_tensor_stats.py), which trajectory questions read
        self.tensor_stats = opts.tensor_stats
        # backpressure when storage is slower than the snapshots: with nothing bounding them, snapshot() calls
        # pile up in flight without limit, and a state of small tensors (copied at snapshot(), outside the
        # staging pool) takes memory far beyond host_memory
        self.max_in_flight = opts.max_in_flight
        # single_process: this process snapshots the whole state alone, as if torch.distributed had one rank (a
        # framework that saves on rank 0 only, as Lightning and the HF Trainer do under DDP)
        self.rank, self.world_size = (0, 1) if opts.single_process else process_group_rank()
        self.single_process = opts.single_process
        layout = self.layout = opts.parallel_layout
        tier = opts.tier
        # under torch.distributed the ranks meet first (saving/_startup.py): a setup error fails every rank now
        self.cluster = self._start_cluster(plumbing, opts) if self.world_size > 1 else None
        if self.cluster is None:
            opts.check_world(self.world_size)
        self.retention = opts.retention
        self.distributed = self.world_size > 1
        # through the Sharder (global names, boxes, column blocks): every distributed snapshot, and a
        # single process that names a layout (so a later tensor-parallel load reads whole column blocks)
        self.sharded = self.distributed or layout is not None
        self.plumbing = plumbing
        if plumbing.plans is None:   # the handle's first snapshotter: the next ones reuse its plans
            plumbing.plans = PlanCache()
        self.record_failures = record_failures  # False when the caller waits and gets the error itself
        # reads HEAD: DetachedHeadError before anything starts
        self._committer = Committer(plumbing, layout, self.rank, self.world_size, self.sharded,
                                    opts.commit_timeout_s, self.cluster)
        # compares with the branch tip first, whoever wrote it, then with this snapshotter's last commit
        self._dedup = DedupIndex(self._committer.tip, plumbing.manifest, plumbing.store) if opts.dedup else None
        self._committer.dedup = self._dedup
        self._sharding = Sharding(layout, self.rank, self.world_size,
                                  None if self.cluster is None else self.cluster.kv, opts.commit_timeout_s,
                                  self._committer.health)
        self.host_memory = opts.host_bytes or default_host_memory()
        shard = min(SHARD_BYTES, max(INNER_BYTES, self.host_memory // 2 // INNER_BYTES * INNER_BYTES))
        self.shard_bytes = shard
        self._planner = Planner(plumbing.plans, shard, self.rank, self.compression, self.tensor_stats)
        pin = torch.cuda.is_available() if opts.pin_memory is None else opts.pin_memory
        # local store: plain shards written without TensorStore
        self._direct = DirectWriter.for_store(plumbing.store) if self.compression is None else None
        # page-aligned buffers where the direct writer may write them with O_DIRECT as they are (fill_live)
        self.pool = StagingPool(shard, max(2, self.host_memory // shard), pin=pin,
                                align=LIVE_ALIGN if self._direct is not None and self._direct.direct_io else 0)
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
        self._step_clock = StepClock()
        ref = weakref.ref(self)
        def close_at_exit() -> None:
            s = ref()
            if s is not None:
                s._close_at_exit()
        self._atexit = close_at_exit
        self.push_to = None if tier is None else tier.push_to
        self.on_full = "wait" if tier is None else tier.on_full
        self._pusher = None if tier is None else tier_pusher(plumbing, tier, self._committer.branch, self.rank,
                                                             self.world_size, self._report, self._reusable,
                                                             self.cluster, opts.commit_timeout_s)
        if tier is not None and self.cluster is not None and self.cluster.multi_node:
            finish_leftover(self.cluster, self._pusher, opts.commit_timeout_s)
        # the stages, one per thread (see the module docstring)
        self._jobs = JobMaker(self._planner, self._sharding, self._dedup,
                              self._direct is not None and self._direct.direct_io, self.tensor_stats)
        self._capturing = CaptureStage(self.pool, self._flush_q.put,
                                       None if self._dedup is None else self._plan_after_dedup)
        self._flushing = FlushStage(plumbing.store, plumbing.url, self.pool, self._direct, tier is not None)
        self._committing = CommitStage(plumbing, self._committer, self.rank, self.world_size, self._finished,
                                       self._report, self._pending_ids, record_failures, self.retention,
                                       self._pusher)
        atexit.register(self._atexit)

    def _start_cluster(self, plumbing: Plumbing, opts: SnapshotterOptions) -> Cluster:
        """Meet the other ranks, with this rank's own setup error if it has one (every rank then raises)."""
        failure: CkptRepoError | None = None
        branch = None
        try:
            opts.check_world(self.world_size)
            branch = read_branch_base(plumbing).branch
            if opts.tier is not None:
                check_tier(plumbing, opts.tier, self.world_size)
        except CkptRepoError as err:
            failure = err
        return start_cluster(plumbing, self.rank, self.world_size, opts.parallel_layout, branch,
                             None if opts.tier is None else opts.tier.push_to, opts.commit_timeout_s, failure)

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
            self._committing.check_tag(tag, force_tag)
            skeleton, records = flatten(state)
            if self._pusher is not None:
                if not self._pusher.admit(sum(r.numel * itemsize(r.dtype) for r in records), step, self.on_full):
                    return skipped_handle(step, self._pusher.remote, t0)
                self._raise_pending()   # a push that failed while snapshot() waited for room
            # DTensors in a single process (a mesh of one device) are pieces of global tensors all the same: the
            # fill paths below cannot read a tensor subclass's memory, and the version must hold them by their
            # global names and shapes, as a larger mesh would
            sharded = self.sharded or any(is_dtensor(r.tensor) for r in records)
            if self.single_process:
                refuse_spread_dtensors(records)
            keys, ids = self._jobs.keys(records, sharded)
            self._bare_versions = copy_what_forward_may_change(state, records, step_owned(self._optimizers),
                                                                self._bare_versions)
            local = self._sharding.local_pieces(records) if sharded else None
        except Exception as err:
            if self.distributed:   # the other ranks are entering the collective: tell them, or they wait forever
                self._sharding.exchange(None, step, err)
            raise
        job = self._jobs.make(skeleton, records, local, keys, ids, t0, step, message, metrics, meta, tag, force_tag)
        handle, vid, records = job.handle, job.vid, job.records
        # snapshot() from several threads: one set of threads, jobs queued in one order. A Ctrl-C landing between
        # these steps would leave a job in flight that no thread ever finishes, and wait(), close() and exit would hang
        with interrupts_deferred(), self._lock:
            self._start_threads()
            if self._pusher is not None:
                self._pusher.reserve(vid, sum(r.numel * itemsize(r.dtype) for r in records))
            self._inflight.append(job)
            # what the loop lost to it (saving/_step_clock.py): a window opened only for a job that will close it
            handle.stats.watch_steps(self._step_clock, t0)
            self._capture_q.put(job)   # unbounded queues: never blocks under the lock
            self._commit_q.put(job)
        handle.stats.blocking_s += time.perf_counter() - t0
        return handle

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` first wait until every pending capture has finished."""
        self._check_process()
        if self._closed:
            raise CkptRepoError("this snapshotter is closed; attach the optimizer to a new one (repo.snapshotter())")
        optimizer = unwrapped_optimizer(optimizer)
        if not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise ArgumentError(f"attach() takes a torch.optim.Optimizer, whose step() then waits for capture, not "
                                f"{type(optimizer).__name__} {optimizer!r:.40}")

        clock = self._step_clock if not self._optimizers else None   # the first optimizer's steps are timed

        def pre_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if os.getpid() == self._pid:   # in a forked child this snapshotter has nothing in flight
                with clock.step() if clock is not None else contextlib.nullcontext():
                    self._wait_for_capture()
        self._hooks.append(optimizer.register_step_pre_hook(pre_step))
        self._optimizers.append(weakref.ref(optimizer))

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
        self._committing.retention_idle.wait()   # a gc pass after the last commit: its failure is raised here too
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
        self._committer.wait_readers()
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
                self._capturing.release(job)
            job.handle._captured.wait()
        if jobs:
            jobs[-1].handle.stats.blocking_s += time.perf_counter() - t0

    def _raise_pending(self) -> None:
        with self._lock:
            if not self._errors:
                return
            first, rest = self._errors[0], len(self._errors) - 1
            self._errors.clear()
        if rest:   # the first failure's kind (a failed push stays a RemoteError), with a count of the others
            message = f"{first} (and {rest} more failed snapshot(s); see `ckptrepo log --all`)"
            try:
                summary: CkptRepoError = type(first)(message)
            except TypeError:   # a kind made with other arguments
                summary = SnapshotFailedError(message)
            raise summary from first.__cause__
        raise first

    def _report(self, failure: CkptRepoError) -> None:
        """A failure (a snapshot's, a tag's, a gc pass's, a push's) for the next call to raise."""
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
            loops = {"capture": (self._capture_q, self._capturing.run, lambda: self._flush_q.put(None)),
                     "flush": (self._flush_q, self._flushing.run),
                     "commit": (self._commit_q, self._committing.run, lambda: None, self._committing.retain)}
            self._threads = [threading.Thread(target=self._loop, args=args, name=f"ckptrepo-{name}", daemon=True)
                             for name, args in loops.items()]
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

    # The threads' loop: a stage's ``run`` on each item of its queue until None, then ``then()``; where ``run``
    # returns True, ``due()`` after it (the commit stage's retention pass). It lets go of its last item before
    # ``due()`` and before it waits for the next (``del``): a job kept by a waiting thread, or through a gc pass
    # that reads many manifests, would live long enough for the cyclic GC to promote its thousands of objects
    # (records, skeleton lists, tensor objects) to its oldest generation, which brings on full collections.
    @staticmethod
    def _loop(q: queue.Queue, run: Callable[[Any], bool | None], then: Callable[[], None] = lambda: None,
              due: Callable[[], None] = lambda: None) -> None:
        while True:
            item = q.get()
            if item is None:
                return then()
            is_due = run(item)
            del item
            if is_due:
                due()

    def _plan_after_dedup(self, job: SnapshotJob) -> None:
        """The capture stage's plan of a job whose reusable tensors dedup has just decided on."""
        assert self._dedup is not None
        self._planner.plan(job, self._dedup.decide(job))

    def _finished(self, job: SnapshotJob) -> None:
        """A job is committed or failed: out of the in-flight count (a callback may snapshot again without
        waiting for its own job), but still waited for by wait() and close() until its callbacks have run."""
        with self._lock:
            self._inflight.remove(job)
            self._finishing.append(job)
        try:
            job.handle._finish()
        finally:
            with self._lock:
                self._finishing.remove(job)

    def _pending_ids(self) -> list[str]:
        with self._lock:
            return [j.vid for j in self._inflight]



__all__ = ["Snapshotter", "SnapshotHandle", "SnapshotStats"]   # the handle and stats: re-exported API
