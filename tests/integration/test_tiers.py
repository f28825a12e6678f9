"""A local tier in front of a remote: snapshots committed here, pushed in the background, evicted once pushed.

A snapshotter with ``push_to`` commits each version locally, then pushes the branch in the background
(saving/_pusher.py); ``local_keep_last`` deletes here the data of older versions the remote holds
(remotes/_evict.py), which still load bit-exact through the remote. A version the remote lacks is never
evicted, a failed push is raised at the next call and recorded, local disk use of unpushed data stays
bounded (wait or skip, with a warning), a full disk says so in one line, and a push killed at any point
leaves both repositories consistent and is finished by the next one.
"""
from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.ckpt_workers import make_state, run_to_death
from support.helpers import assert_bit_exact, run
from support.tier_workers import push_crash_writer

import ckptrepo
from ckptrepo import faults
from ckptrepo.core._remotes import evicted_ids, tracking_tip
from ckptrepo.errors import (
    ArgumentError,
    BackpressureWarning,
    RefError,
    RemoteError,
    SnapshotFailedError,
    StorageError,
)

JOIN_TIMEOUT = 60


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def _tier(tmp_path: Path, remote: str | None = None) -> tuple[ckptrepo.Repository, str]:
    repo = ckptrepo.init(str(tmp_path / "local"))
    url = remote or str(tmp_path / "remote")
    repo.remote_add("origin", url)
    return repo, url


def _data_dirs(repo: ckptrepo.Repository) -> set[str]:
    """The versions that hold data objects here."""
    return {k.split("/")[1] for k in repo.plumbing.store.list("data/")}


def _state_bytes(state: object) -> int:
    """The bytes of the tensors (and numpy arrays) in a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def test_push_to_keeps_the_newest_locally_and_all_on_the_remote(tmp_path):
    repo, url = _tier(tmp_path)
    with repo.snapshotter(push_to="origin", local_keep_last=3) as snap:
        for step in range(8):
            snap.snapshot(make_state(step, big=False), step=step)
            snap.wait_captured()
    log = repo.log()
    assert [v.step for v in log] == list(range(7, -1, -1))
    remote = ckptrepo.open(url)
    assert [v.id for v in remote.log()] == [v.id for v in log]
    for v in log:   # every version on the remote, bit-exact
        assert_bit_exact(remote.load(v.id), make_state(v.step, big=False))
    # local data for the newest 3 only; the 5 older ones are marked evicted and load through the remote
    assert _data_dirs(repo) == {v.id for v in log[:3]}
    assert evicted_ids(repo.plumbing.store) == {v.id for v in log[3:]}
    assert tracking_tip(repo.plumbing.store, "origin/main") == log[0].id
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))
    d = repo.diff(log[-1].id, log[0].id)   # an evicted version against a kept one
    assert {t.status for t in d.tensors} == {"changed"}
    for r in (repo, remote):
        report = r.fsck()
        assert report.ok, report.errors
    assert not repo.failures()


def test_a_version_not_on_the_remote_is_never_evicted(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    repo, _ = _tier(tmp_path, remote=str(blocker / "remote"))   # nothing can be written there
    snap = repo.snapshotter(push_to="origin", local_keep_last=1)
    for step in range(4):
        snap.snapshot(make_state(step, big=False), step=step)
        with pytest.raises(RemoteError, match="background push of branch 'main' to 'origin' failed") as err:
            snap.wait()   # the push's error surfaces at the next call
        assert "\n" not in str(err.value)
    with pytest.raises(RemoteError):
        snap.close()
    log = repo.log()
    assert len(log) == 4 and not evicted_ids(repo.plumbing.store)
    assert _data_dirs(repo) == {v.id for v in log}
    # recorded: log --all lists it beside failed snapshots, fsck warns that the branch is not on the remote
    (failure,) = repo.failures()
    assert failure["remote"] == "origin" and failure["id"] == log[0].id
    report = repo.fsck()
    assert report.ok and any("is not on remote 'origin' yet" in w for w in report.warnings), report.warnings
    for command in (("log", "--all"), ("status",)):   # named as a push, not as a failed snapshot
        assert f"push of main to origin at {log[0].id[:12]}" in run(*command, repo=repo.url).stdout
    # the remote fixed, the next push sends all four and clears the record; eviction then goes ahead
    repo.remote_remove("origin")
    repo.remote_add("origin", str(tmp_path / "remote"))
    repo.push("origin")
    assert not repo.failures()
    repo.evict("origin", keep_last=1)
    assert _data_dirs(repo) == {log[0].id}
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))


def test_the_pusher_failing_does_not_evict_versions_it_did_not_push(tmp_path):
    """Pushes that fail after the remote holds the older versions: only those are evicted."""
    repo, url = _tier(tmp_path)
    snap = repo.snapshotter(push_to="origin", local_keep_last=1)
    for step in range(2):
        snap.snapshot(make_state(step, big=False), step=step)
        snap.wait()

    def refuse(_point: str) -> None:
        raise OSError("the remote refuses (injected)")
    faults.set_hook("push_before_ref", refuse)
    for step in range(2, 5):
        snap.snapshot(make_state(step, big=False), step=step)
        with pytest.raises(RemoteError, match="the remote refuses"):
            snap.wait()
    log = repo.log()
    assert evicted_ids(repo.plumbing.store) == {log[-1].id}   # step 0 only: the remote holds steps 0 and 1
    assert _data_dirs(repo) == {v.id for v in log[:-1]}
    faults.clear()
    snap.close()   # pushes at close: all five there now, the four older ones evicted
    log = repo.log()
    assert [v.step for v in ckptrepo.open(url).log()] == [4, 3, 2, 1, 0]
    assert _data_dirs(repo) == {log[0].id}


def test_unpushed_versions_survive_eviction_by_hand(tmp_path):
    repo, _ = _tier(tmp_path)
    for step in range(3):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")
    for step in range(3, 5):
        repo.snapshot(make_state(step, big=False), step=step)
    log = repo.log()
    report = repo.evict("origin", keep_last=1)
    # steps 3 and 4 are not on the remote: kept; 0, 1 and 2 are, and lie beyond the newest one
    assert sorted(report.evicted) == sorted(v.id for v in log[2:])
    assert _data_dirs(repo) == {v.id for v in log[:2]}
    assert not repo.evict("origin", keep_last=1).evicted   # nothing more to do
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))
    assert repo.fsck().ok


def test_eviction_interrupted_after_its_marker_is_finished_by_the_next(tmp_path):
    repo, _ = _tier(tmp_path)
    for step in range(4):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")

    def crash(_point: str) -> None:
        raise KeyboardInterrupt
    faults.set_hook("evict_before_delete", crash)
    with pytest.raises(KeyboardInterrupt):
        repo.evict("origin", keep_last=1)
    faults.clear()
    log = repo.log()
    assert len(evicted_ids(repo.plumbing.store)) == 1 and len(_data_dirs(repo)) == 4   # marked, nothing deleted
    assert repo.fsck().ok
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))
    repo.evict("origin", keep_last=1)
    assert _data_dirs(repo) == {log[0].id}
    assert evicted_ids(repo.plumbing.store) == {v.id for v in log[1:]}
    assert repo.fsck().ok


def test_dedup_shared_arrays_are_pushed_once_and_kept_while_referenced(tmp_path):
    repo, url = _tier(tmp_path)
    frozen = torch.randn(4096, dtype=torch.float64)   # its own array (float64): written by the first version only
    states = []
    with repo.snapshotter(push_to="origin", local_keep_last=2) as snap:
        for step in range(6):
            state = {"frozen": frozen, "w": torch.full((2048,), float(step))}
            states.append({"frozen": frozen.clone(), "w": state["w"].clone()})
            snap.snapshot(state, step=step)
            snap.wait(remote=False)   # committed: the next snapshot compares with it
    log = repo.log()
    remote = ckptrepo.open(url).plumbing.store
    float64_arrays = {k[:-len("/zarr.json")] for k in remote.list("data/") if k.endswith("/float64/zarr.json")}
    assert float64_arrays == {f"data/{log[-1].id}/0/float64"}   # one copy on the remote, the first version's
    # the first version is evicted, but its frozen array stays here: the kept versions point into it
    assert log[-1].id in evicted_ids(repo.plumbing.store)
    assert repo.plumbing.store.exists(f"data/{log[-1].id}/0/float64/zarr.json")
    assert not repo.plumbing.store.exists(f"data/{log[-1].id}/0/float32/zarr.json")
    for v in log:
        assert_bit_exact(repo.load(v.id), states[v.step])
    assert repo.fsck().ok and ckptrepo.open(url).fsck().ok


def _hold_pushes() -> threading.Event:
    """Make every push wait at its last step until the returned event is set."""
    release = threading.Event()
    faults.set_hook("push_before_ref", lambda _p: release.wait(JOIN_TIMEOUT))
    return release


def test_pushes_coalesce_when_the_remote_falls_behind(tmp_path):
    repo, url = _tier(tmp_path)
    pushes = []
    release = threading.Event()

    def slow_remote(_point: str) -> None:
        pushes.append(1)
        release.wait(JOIN_TIMEOUT)
    faults.set_hook("push_before_ref", slow_remote)
    with repo.snapshotter(push_to="origin") as snap:
        for step in range(4):   # the first push holds; the three commits made meanwhile wait for the next
            snap.snapshot(make_state(step, big=False), step=step)
            snap.wait(remote=False)
        release.set()
    assert len(pushes) == 2
    assert [v.step for v in ckptrepo.open(url).log()] == [3, 2, 1, 0]


def test_backpressure_wait_holds_the_snapshot_until_the_push_makes_room(tmp_path):
    repo, url = _tier(tmp_path)
    state = make_state(0, big=False)
    bound = int(_state_bytes(state) * 1.5)   # room for one unpushed version, not two
    release = _hold_pushes()
    with repo.snapshotter(push_to="origin", local_max_bytes=bound, on_full="wait") as snap:
        snap.snapshot(make_state(0, big=False), step=0)
        threading.Timer(0.5, release.set).start()
        t0 = time.perf_counter()
        with pytest.warns(BackpressureWarning, match=r"would pass local_max_bytes=.*waits for the push"):
            snap.snapshot(make_state(1, big=False), step=1)
        assert time.perf_counter() - t0 >= 0.4   # held until the first push was done
        assert snap._pusher.unpushed_bytes() <= bound
    assert [v.step for v in ckptrepo.open(url).log()] == [1, 0]


def test_backpressure_skip_skips_the_snapshot_and_says_so(tmp_path):
    repo, url = _tier(tmp_path)
    bound = int(_state_bytes(make_state(0, big=False)) * 1.5)
    release = _hold_pushes()
    with repo.snapshotter(push_to="origin", local_max_bytes=bound, on_full="skip") as snap:
        snap.snapshot(make_state(0, big=False), step=0)
        with pytest.warns(BackpressureWarning, match="is skipped"):
            skipped = snap.snapshot(make_state(1, big=False), step=1)
        assert skipped.skipped and skipped.done() and "skipped" in repr(skipped)
        with pytest.raises(SnapshotFailedError, match="at step 1 was skipped: the local tier was full"):
            skipped.result()
        release.set()
        snap.wait()
        snap.snapshot(make_state(2, big=False), step=2)   # room again
    assert [v.step for v in repo.log()] == [2, 0]
    assert [v.step for v in ckptrepo.open(url).log()] == [2, 0]
    assert not repo.failures()


@pytest.mark.parametrize("tier", [True, False])
def test_a_full_local_disk_is_one_line_saying_what_to_do(tmp_path, tier):
    repo, _ = _tier(tmp_path)
    repo.snapshot(make_state(0, big=False), step=0)

    def full(_point: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    faults.set_hook("before_shard_write", full)
    if tier:
        snap = repo.snapshotter(push_to="origin", local_keep_last=2)
        snap.snapshot(make_state(1, big=False), step=1)
        with pytest.raises(SnapshotFailedError) as err:
            snap.wait()
        faults.clear()
        snap.close()
        assert "lower local_keep_last, or local_max_bytes" in str(err.value)
    else:   # a snapshot taken by hand raises its own error
        with pytest.raises(StorageError) as err:
            repo.snapshot(make_state(1, big=False), step=1)
        assert "ckptrepo gc" in str(err.value)
    assert "local disk of" in str(err.value) and "is full" in str(err.value) and "\n" not in str(err.value)
    assert [v.step for v in repo.log()] == [0]
    assert repo.fsck().ok


def test_snapshotter_tier_arguments_are_checked(tmp_path):
    repo, _ = _tier(tmp_path)
    with pytest.raises(RefError, match="no remote named 'backup'"):
        repo.snapshotter(push_to="backup")
    with pytest.raises(ArgumentError, match="local_keep_last must be"):
        repo.snapshotter(push_to="origin", local_keep_last=0)
    with pytest.raises(ArgumentError, match="pass push_to"):
        repo.snapshotter(local_keep_last=2)
    with pytest.raises(ArgumentError, match="local_max_bytes 'lots' is not a size"):
        repo.snapshotter(push_to="origin", local_max_bytes="lots")
    with pytest.raises(ArgumentError, match="on_full must be 'wait' or 'skip'"):
        repo.snapshotter(push_to="origin", on_full="drop")
    with pytest.raises(ArgumentError, match="keep_last must be"):
        repo.evict("origin", keep_last=0)


@pytest.mark.parametrize("point", ["push_after_array", "push_after_manifest", "push_before_ref"])
def test_kill_during_a_push_then_resume(tmp_path, point):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    run_to_death(push_crash_writer, local, remote, point)
    here, there = ckptrepo.open(local), ckptrepo.open(remote)
    for r in (here, there):
        report = r.fsck()
        assert report.ok, report.errors
    assert [v.step for v in here.log()] == [1, 0]
    (old,) = there.log()   # nothing half-pushed is visible: the remote's branch still names step 0
    assert old.step == 0
    assert_bit_exact(there.load("main"), make_state(0))
    # resumed by the next snapshotter with push_to (its first push, in the background), or by a push by hand
    if point == "push_after_manifest":
        here.push("origin")
    else:
        with here.snapshotter(push_to="origin"):
            pass
    there = ckptrepo.open(remote)
    assert [v.step for v in there.log()] == [1, 0]
    assert_bit_exact(there.load("main"), make_state(1))
    assert there.fsck().ok and here.fsck().ok


def test_push_to_s3(tmp_path, s3_url):
    repo, _ = _tier(tmp_path, remote=s3_url)
    with repo.snapshotter(push_to="origin", local_keep_last=2) as snap:
        for step in range(4):
            snap.snapshot(make_state(step, big=False), step=step)
    log = repo.log()
    remote = ckptrepo.open(s3_url)
    assert [v.id for v in remote.log()] == [v.id for v in log]
    assert _data_dirs(repo) == {v.id for v in log[:2]}
    for v in log:
        assert_bit_exact(remote.load(v.id), make_state(v.step, big=False))
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))   # evicted ones read from S3
    assert repo.fsck().ok and remote.fsck().ok


def test_retention_never_prunes_a_version_the_remote_does_not_hold_yet(tmp_path):
    """A snapshotter's retention rules run after each commit; with push_to, a version not pushed yet keeps its
    data (pruned first, it would reach the remote as history without data)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    repo, _ = _tier(tmp_path, remote=str(blocker / "remote"))   # every push fails
    states = [make_state(step, big=False) for step in range(4)]
    snap = repo.snapshotter(push_to="origin", retention=ckptrepo.RetentionPolicy(keep_last=1, grace_period_s=0))
    for step, state in enumerate(states):
        snap.snapshot(state, step=step)
        with pytest.raises(ckptrepo.CkptRepoError, match="background push"):
            snap.wait()
    with pytest.raises(ckptrepo.CkptRepoError, match="background push"):
        snap.close()
    assert [v.pruned for v in repo.log()] == [False] * 4
    repo.remote_remove("origin")
    repo.remote_add("origin", str(tmp_path / "remote"))
    repo.push("origin")
    remote = ckptrepo.open(str(tmp_path / "remote"))
    for step, state in enumerate(states):
        assert_bit_exact(remote.load(f"@{step}"), state)


def test_a_version_the_remote_pruned_is_not_evicted_here(tmp_path):
    repo, url = _tier(tmp_path)
    for step in range(3):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")
    ckptrepo.open(url).gc(keep_last=1, grace_period_s=0)   # the remote keeps only the newest's data
    repo.evict("origin", keep_last=1)
    for step in range(3):   # the two older ones' data is here alone now: kept
        assert_bit_exact(repo.load(f"@{step}"), make_state(step, big=False))
