"""The commit stage: each snapshot, in snapshot order, committed once its data is durable; then its tag, its
push and, every so many commits, a retention pass.

Runs on the commit thread. The commit itself is the committer's (saving/_commit.py: chunk tables, manifest,
branch by compare-and-swap; two phases under torch.distributed); this stage waits for the job's data,
decides between commit and failure, and does what follows a commit. Nothing it does raises into training:
a failure becomes the job's handle's error and, with ``report``, is raised by the snapshotter's next call.
What it reads of a snapshot is ``CommitJob``, and of the committer ``Commits``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from ckptrepo import faults
from ckptrepo.arguments import check_flag
from ckptrepo.core import Plumbing, Version, check_ref_name, version_id_time
from ckptrepo.errors import ArgumentError, CkptRepoError, RefError, SnapshotFailedError, first_line
from ckptrepo.maintenance import RetentionPolicy, VersionFacts
from ckptrepo.parallel import GroupHealth
from ckptrepo.saving._pusher import BackgroundPusher
from ckptrepo.saving._snapshot_job import SnapshotHandle

log = logging.getLogger("ckptrepo")


class CommitJob(Protocol):
    """What the commit stage reads of one snapshot (saving/_snapshot_job.py's ``SnapshotJob``)."""

    handle: SnapshotHandle
    data_done: threading.Event    # set once its last segment is written (or failed)
    error: BaseException | None
    started: float
    first_write: float
    message: str
    tag: str | None
    force_tag: bool

    @property
    def vid(self) -> str: ...


class Commits(Protocol):
    """What the commit stage needs of a committer (saving/_commit.py's ``Committer``)."""

    health: GroupHealth

    def commit(self, job: Any) -> Version: ...
    def publish_failure(self, job: Any, err: BaseException) -> None: ...
    def record_failure(self, job: Any, cause: str) -> None: ...


class CommitStage:
    """Commits one snapshotter's jobs through ``committer``.

    ``finished(job)``: the snapshotter's bookkeeping once a job is committed or failed (it runs the handle's
    callbacks); ``report(err)``: a failure for the snapshotter's next call to raise (with ``record_failures``
    False, a failed snapshot's stays on its handle only: the caller waits on it); ``pending()``: the ids of
    the versions still in flight, which a retention pass must never collect."""

    def __init__(self, plumbing: Plumbing, committer: Commits, rank: int, world_size: int,
                 finished: Callable[[Any], None], report: Callable[[CkptRepoError], None],
                 pending: Callable[[], list[str]], record_failures: bool = True,
                 retention: RetentionPolicy | None = None, pusher: BackgroundPusher | None = None) -> None:
        self.plumbing, self.committer = plumbing, committer
        self.rank, self.distributed = rank, world_size > 1
        self.finished, self.report, self.pending = finished, report, pending
        self.record_failures = record_failures
        self.retention, self.pusher = retention, pusher
        self.commits = 0
        self.retention_idle = threading.Event()   # clear while a background gc pass is pending or running
        self.retention_idle.set()
        self.gc_facts: dict[str, VersionFacts] = {}   # what retention passes learnt of the manifests

    def run(self, job: CommitJob) -> bool:
        """Commit the job (or record its failure); returns whether a retention pass is due, which the caller runs
        with ``retain()`` once it has let go of the job."""
        try:
            return self._in_turn(job)
        except BaseException:  # noqa: BLE001 - this thread must outlive any job, or every later one hangs
            log.exception("ckptrepo: the commit thread failed on snapshot %s", job.vid[:12])
            return False

    def retain(self) -> None:
        """The retention pass ``run`` said is due; ``wait()`` waits for it through ``retention_idle``."""
        try:
            self.apply_retention()
        finally:
            self.retention_idle.set()

    def _in_turn(self, job: CommitJob) -> bool:
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
                self.committer.health.check()
            faults.point("after_data")
            job.handle.stats.settle_steps()   # the step it slowed ends first: lost_s holds it (saving/_step_clock.py)
            version = self.committer.commit(job)
        except BaseException as err:  # noqa: BLE001
            if self.distributed:
                self.committer.publish_failure(job, err)
            self._record_failure(job, err)
            if self.pusher is not None:
                self.pusher.dropped(job.vid)
        else:
            stats.total_s = time.perf_counter() - job.started
            job.handle._version = version
            self._tag(job)
            self.commits += 1
            if self.pusher is not None:
                self.pusher.committed(job.vid, stats.bytes)
            if self.retention is not None and self.rank == 0 \
                    and self.commits % max(1, self.retention.every_commits) == 0:
                retain = True
                self.retention_idle.clear()   # before the job is done, so wait() also waits for this gc
        finally:
            self.finished(job)
        return retain

    def check_tag(self, tag: Any, force: Any) -> None:
        """Refuse at ``snapshot()`` a tag this stage could not create: a bad name, or (unless ``force``) one that
        exists. A tag made by another writer between this check and the commit is reported by the next call."""
        if tag is None:
            return
        if not isinstance(tag, str):
            raise ArgumentError(f"tag must be a str, not {type(tag).__name__}")
        check_flag(force, "force_tag")
        check_ref_name(tag, "tag")
        if self.rank == 0:
            if not force and tag in self.plumbing.refs.tags(strict=False):
                raise RefError(f"tag {tag!r} exists; pick another name, or pass force_tag=True to move it")
            self.plumbing.refs.check_tag_name(tag, may_exist=force)

    def _tag(self, job: CommitJob) -> None:
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
            self.report(failure)

    def apply_retention(self) -> None:
        """Background gc after a commit; a failure is logged and raised by the next call, like a failed snapshot."""
        born = [version_id_time(vid) or 0.0 for vid in self.pending()]   # never collect what is in flight
        since = min(born + [time.time()]) - 1.0
        assert self.retention is not None   # called only when a policy was given
        try:
            # a version the remote does not hold yet keeps its data here, or it would reach the remote as history only
            unpushed = self.pusher.unpushed() if self.pusher is not None else []
            self.retention.apply(self.plumbing, protect_since=since, known=self.gc_facts, keep_also=unpushed)
        except Exception as err:  # noqa: BLE001 - never kills the commit thread
            failure = SnapshotFailedError(f"background retention (gc) failed: {first_line(err)}; "
                                          f"run `ckptrepo gc` by hand")
            failure.__cause__ = err
            log.error("ckptrepo: %s", failure)
            self.report(failure)

    def _record_failure(self, job: CommitJob, err: BaseException) -> None:
        step = "" if job.handle.step is None else f" at step {job.handle.step}"
        cause = first_line(err)
        failure = SnapshotFailedError(f"snapshot {job.vid[:12]}{step} was not committed: {cause}")
        failure.__cause__ = err
        job.handle._error = failure
        if not self.record_failures:  # the caller waits on the handle and gets the error from it
            return
        self.report(failure)
        log.error("ckptrepo: %s", failure)
        self.committer.record_failure(job, cause)   # rank 0 records the failure of a distributed version


__all__ = ["CommitJob", "CommitStage", "Commits"]
