"""The snapshotter's stages one at a time (saving/_capture_stage.py, _flush_stage.py, _commit_stage.py), each
driven with a fake job: a minimal object with the fields and methods of the stage's job protocol, on a real
staging pool and a real local store; no snapshotter, no threads of its own."""
from __future__ import annotations

import errno
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import SnapshotFailedError, StorageError
from ckptrepo.parallel._distributed import GroupHealth
from ckptrepo.saving._capture import Snapshotter
from ckptrepo.saving._capture_stage import CaptureStage
from ckptrepo.saving._commit_stage import CommitStage
from ckptrepo.saving._flush_stage import FlushStage, disk_full, storage_error
from ckptrepo.saving._snapshot_job import SnapshotHandle
from ckptrepo.saving._writer import StagingPool, make_plan
from ckptrepo.state._providers import DTYPE_NAMES, TensorRecord
from ckptrepo.storage._arrays import ArrayInfo
from ckptrepo.storage._chunktable import chunk_crcs

SHARD = 64 << 10


@dataclass
class FakeJob:
    """What the three stages read and record of a snapshot, and no more."""

    records: list[TensorRecord] = field(default_factory=list)
    handle: SnapshotHandle = field(default_factory=lambda: SnapshotHandle("f" * 32, 7))
    plan: Any = None
    written: list[int] = field(default_factory=list)
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)
    live: bool = False
    ready: list[Any] = field(default_factory=list)
    replicas: list[Any] = field(default_factory=list)
    fingerprints: list[Any] = field(default_factory=list)
    feeds: dict[int, Any] = field(default_factory=dict)
    feeding: list[Any] | None = None
    live_shards: list[Any] = field(default_factory=list)
    holds: int = 1
    remaining: int = 0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    staged: threading.Event = field(default_factory=threading.Event)
    data_done: threading.Event = field(default_factory=threading.Event)
    handles: dict[str, Any] = field(default_factory=dict)
    first_write: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    message: str = ""
    tag: str | None = None
    force_tag: bool = False
    crcs: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    done: list[BaseException | None] = field(default_factory=list)

    @property
    def vid(self) -> str:
        return self.handle.id

    def fail(self, err: BaseException) -> None:
        self.error = self.error or err

    def drop_hold(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            self.handle._captured.set()

    def record_crcs(self, seg: Any, crcs: np.ndarray) -> None:
        self.crcs[(seg.dtype, seg.start)] = crcs

    def segment_done(self, err: BaseException | None = None) -> None:
        if err is not None:
            self.fail(err)
        self.done.append(err)
        self.remaining -= 1
        if self.remaining == 0:
            self.data_done.set()


def planned_job(tensors: dict[str, torch.Tensor]) -> FakeJob:
    records = [TensorRecord(n, t, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    plan = make_plan(records, SHARD)
    arrays = {d: ArrayInfo(f"data/{'f' * 32}/0/{d}", d, n, s, i) for d, (n, s, i) in plan.streams.items()}
    return FakeJob(records=records, plan=plan, written=list(range(len(records))), arrays=arrays,
                   remaining=len(plan.segments))


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a": torch.randn(40_000), "b": torch.arange(1000, dtype=torch.int64), "c": torch.randn(3, 5).t()}


# ---- capture -----------------------------------------------------------------------------------------------
def test_capture_stages_every_segment_and_marks_the_job_captured():
    job = planned_job(tensors())
    pool = StagingPool(SHARD, 8)
    emitted: list[tuple] = []
    CaptureStage(pool, emitted.append).run(job)
    assert job.handle.captured() and job.staged.is_set() and job.error is None
    assert [item[1] for item in emitted] == list(job.plan.segments)
    for dtype in job.arrays:   # the staged bytes are the tensors', in plan order
        staged = np.concatenate([view.reshape(-1) for j, seg, buf, view, ev in emitted if seg.dtype == dtype])
        expect = [p for p in job.plan.placements if p.dtype == dtype]
        for p in expect:
            t = job.records[job.written.index(job.plan.placements.index(p))].tensor
            got = staged[p.offset:p.offset + p.numel]
            assert np.array_equal(got.view(t.numpy().dtype), t.contiguous().reshape(-1).numpy())
    assert job.handle.stats.copied_bytes == sum(v.nbytes for *_, v, _e in emitted)


def test_a_failed_capture_is_the_jobs_and_accounts_the_segments_never_queued():
    job = planned_job(tensors())
    segments = len(job.plan.segments)
    emitted: list[tuple] = []
    calls = []

    def fail_second(name):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("staging broke")
    faults.set_hook("before_capture", fail_second)
    try:
        CaptureStage(StagingPool(SHARD, 8), emitted.append).run(job)
    finally:
        faults.clear()
    assert isinstance(job.error, OSError) and job.handle.captured()
    assert len(emitted) == 1 and len(job.done) == segments - 1 and job.remaining == 1   # the queued one: flush's


def test_capture_plans_through_decide_when_the_plan_waits_for_dedup():
    job = planned_job(tensors())
    plan, job.plan = job.plan, None
    decided = []

    def decide(j):
        decided.append(j)
        j.plan = plan
    emitted: list[tuple] = []
    CaptureStage(StagingPool(SHARD, 8), emitted.append, decide).run(job)
    assert decided == [job] and len(emitted) == len(plan.segments) and job.error is None


# ---- flush -------------------------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    return ckptrepo.init(tmp_path / "r").plumbing.store


def staged(job: FakeJob) -> tuple[StagingPool, list[tuple]]:
    pool = StagingPool(SHARD, 8)
    emitted: list[tuple] = []
    CaptureStage(pool, emitted.append).run(job)
    return pool, emitted


def test_flush_writes_each_segment_durably_with_its_chunk_table_and_frees_its_buffer(store):
    job = planned_job(tensors())
    pool, emitted = staged(job)
    stage = FlushStage(store, store.url, pool, None, tier=False)
    for item in emitted:
        stage.run(item)
    assert job.data_done.wait(30) and job.done == [None] * len(emitted) and job.first_write > 0
    for _job, seg, _buf, view, _event in emitted:
        assert np.array_equal(job.crcs[(seg.dtype, seg.start)], chunk_crcs(job.arrays[seg.dtype], view))
    assert all(store.exists(f"{info.key}/zarr.json") for info in job.arrays.values())
    assert len(pool._free) == len(emitted)   # every buffer back


def test_flush_skips_the_writes_of_a_failed_job_and_still_accounts_them(store):
    job = planned_job(tensors())
    pool, emitted = staged(job)
    job.error = RuntimeError("capture failed elsewhere")
    for item in emitted:
        FlushStage(store, store.url, pool, None, tier=False).run(item)
    assert job.data_done.is_set() and job.done == [None] * len(emitted) and not job.crcs


def test_a_full_disk_says_what_to_free():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(full) and disk_full(RuntimeError("write: No space left on device"))
    assert not disk_full(OSError(errno.EIO, "I/O error"))
    seg = make_plan([TensorRecord("a", torch.ones(4), "float32", (4,))]).segments[0]
    tier = storage_error("data/x/0/float32", seg, full, "file:///r", tier=True)
    assert isinstance(tier, StorageError) and "local_keep_last" in str(tier)
    assert "ckptrepo gc" in str(storage_error("data/x/0/float32", seg, full, "file:///r", tier=False))
    assert "elements [0, 4) failed: I/O error" in str(storage_error("k", seg, OSError(errno.EIO, "I/O error"),
                                                                     "file:///r", tier=False))


# ---- commit ------------------------------------------------------------------------------------------------
class FakeCommitter:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.health = GroupHealth()
        self.fail = fail
        self.committed: list[str] = []
        self.records: list[str] = []

    def commit(self, job):
        if self.fail is not None:
            raise self.fail
        self.committed.append(job.vid)
        return f"version {job.vid[:4]}"

    def publish_failure(self, job, err):
        raise AssertionError("a single process publishes nothing")

    def record_failure(self, job, cause):
        self.records.append(cause)


def commit_stage(tmp_path, committer, record_failures=True, retention=None):
    plumbing = ckptrepo.init(tmp_path / "r").plumbing
    finished: list[Any] = []
    reported: list[Any] = []
    stage = CommitStage(plumbing, committer, 0, 1, finished.append, reported.append, lambda: [], record_failures,
                        retention)
    return stage, finished, reported


def ready_job(**kw) -> FakeJob:
    job = FakeJob(**kw)
    job.data_done.set()
    job.handle._captured.set()
    return job


def test_commit_commits_a_durable_job_and_hands_it_back(tmp_path):
    committer = FakeCommitter()
    stage, finished, reported = commit_stage(tmp_path, committer)
    job = ready_job()
    stage.run(job)
    assert committer.committed == [job.vid] and finished == [job] and not reported
    assert stage.commits == 1 and job.handle._version == "version ffff"


@pytest.mark.parametrize("record_failures", [True, False])
def test_a_job_that_failed_is_not_committed_and_its_error_reaches_the_handle(tmp_path, record_failures):
    committer = FakeCommitter()
    stage, finished, reported = commit_stage(tmp_path, committer, record_failures)
    job = ready_job(error=OSError("disk gone"))
    stage.run(job)
    job.handle._finish()
    assert committer.committed == [] and finished == [job]
    with pytest.raises(SnapshotFailedError, match=r"snapshot ffffffffffff at step 7 was not committed: disk gone"):
        job.handle.result(0)
    # the failure record and the next call's error: only where the caller does not wait on the handle itself
    assert committer.records == (["disk gone"] if record_failures else [])
    assert len(reported) == int(record_failures)


def test_a_committer_that_raises_fails_the_job_not_the_stage(tmp_path):
    stage, finished, reported = commit_stage(tmp_path, FakeCommitter(fail=RuntimeError("manifest refused")))
    jobs = [ready_job(), ready_job()]
    for job in jobs:
        stage.run(job)
    assert finished == jobs and len(reported) == 2 and stage.commits == 0


def test_retention_runs_every_so_many_commits_and_a_failing_pass_is_reported(tmp_path):
    class BrokenPolicy(ckptrepo.RetentionPolicy):
        def apply(self, *args, **kwargs):
            raise OSError("gc could not list")
    stage, finished, reported = commit_stage(tmp_path, FakeCommitter(),
                                             retention=BrokenPolicy(keep_last=1, every_commits=2))
    assert not stage.run(ready_job())
    assert stage.retention_idle.is_set() and not reported
    assert stage.run(ready_job())   # due: the caller runs the pass once it has let go of the job
    assert not stage.retention_idle.is_set()
    stage.retain()
    assert stage.retention_idle.is_set()
    assert [str(r) for r in reported] == ["background retention (gc) failed: gc could not list; "
                                          "run `ckptrepo gc` by hand"]


def test_the_commit_thread_lets_go_of_its_job_before_the_retention_pass(tmp_path):
    # a job kept alive through a gc pass that reads many manifests is promoted by the cyclic GC, with its
    # thousands of objects, to the oldest generation
    alive_during_gc: list[bool] = []

    class WatchingPolicy(ckptrepo.RetentionPolicy):
        def apply(self, *args, **kwargs):
            alive_during_gc.append(ref() is not None)

    plumbing = ckptrepo.init(tmp_path / "r").plumbing
    stage = CommitStage(plumbing, FakeCommitter(), 0, 1, lambda job: None, lambda err: None, lambda: [],
                        retention=WatchingPolicy(keep_last=1, every_commits=1))
    job = ready_job()
    ref = weakref.ref(job)
    q: queue.Queue = queue.Queue()
    q.put(job)
    q.put(None)
    del job
    Snapshotter._loop(q, stage.run, due=stage.retain)
    assert alive_during_gc == [False] and stage.retention_idle.is_set()
