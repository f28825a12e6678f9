"""Remotes through the API: push, fetch, pull and clone between repositories, on local and S3 remotes.

Each test checks what a user relies on: bit-exact versions on both sides, only missing objects moved, shared
(dedup) arrays stored once on the remote, lazy clones that read only what a load needs, and refs that move
only as fast-forwards.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo.core._remotes import EVICTED_PREFIX
from ckptrepo.loading._engine import ReadStats, kvstore_bytes_read
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.rules import Replicated, Rules, Split
from ckptrepo.storage import open_store
from ckptrepo.storage._arrays import INNER_BYTES


def _state(i: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(n, generator=g), "b": torch.full((7,), float(i)), "step": i}


def _keys(repo: ckptrepo.Repository, prefix: str) -> list[str]:
    return repo.plumbing.store.list(prefix)


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path: Path) -> str:
    return str(tmp_path / "remote") if request.param == "file" else request.getfixturevalue("s3_url")


def test_push_then_clone_gives_every_version_bit_exact(tmp_path: Path, remote_url: str) -> None:
    a = ckptrepo.init(tmp_path / "a")
    states = [_state(i) for i in range(3)]
    for i, s in enumerate(states):
        a.snapshot(s, step=i)
    a.remote_add("origin", remote_url)
    pushed = a.push()
    assert [r.status for r in pushed.refs] == ["created"]
    assert len(pushed.versions) == 3
    assert [v.id for v in ckptrepo.open(remote_url).log()] == [v.id for v in a.log()]

    c = ckptrepo.clone(remote_url, tmp_path / "c")
    assert c.current_branch() == "main"
    assert [v.id for v in c.log()] == [v.id for v in a.log()]
    for i, s in enumerate(states):
        assert_bit_exact(c.load(f"@{i}"), s)
    assert c.fsck().ok
    assert ckptrepo.open(remote_url).fsck().ok


def test_a_second_push_moves_only_the_new_version(tmp_path: Path, remote_url: str) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", remote_url)
    first = a.push()
    a.snapshot(_state(1), step=1)
    second = a.push()
    assert second.versions == [a.resolve("HEAD")]
    assert second.refs[0].status == "fast-forward"
    assert 0 < second.bytes <= first.bytes * 1.05   # one version's arrays, not the history's
    again = a.push()
    assert again.versions == [] and again.bytes == 0 and again.refs[0].status == "up to date"


def test_arrays_shared_through_dedup_are_stored_once_on_the_remote(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    frozen = torch.randn(64 << 10)   # 256 KiB that never change
    with a.snapshotter() as snap:
        for i in range(4):
            snap.snapshot({"frozen": frozen, "adapter": torch.full((16,), float(i))}, step=i)
            snap.wait()   # dedup compares with the last committed version
    local_frozen = [k for k in _keys(a, "data/") if k.endswith("zarr.json")]
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    remote = ckptrepo.open(tmp_path / "remote")
    assert sorted(k for k in remote.plumbing.store.list("data/") if k.endswith("zarr.json")) == sorted(local_frozen)
    stored = sum(len(remote.plumbing.store.get(k) or b"") for k in remote.plumbing.store.list("data/"))
    assert stored < 2 * frozen.numel() * 4   # the frozen tensor once, not four times
    for i in range(4):
        assert torch.equal(remote.load(f"@{i}")["frozen"], frozen)


def test_a_push_that_is_not_a_fast_forward_is_rejected_and_changes_nothing(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    b = ckptrepo.clone(tmp_path / "remote", tmp_path / "b")
    b.snapshot(_state(1), step=1)
    b.push()
    tip = ckptrepo.open(tmp_path / "remote").resolve("main")
    a.snapshot(_state(2), step=2)
    with pytest.raises(ckptrepo.PushRejectedError, match="fetch first"):
        a.push()
    assert ckptrepo.open(tmp_path / "remote").resolve("main") == tip
    with pytest.raises(ckptrepo.PushRejectedError, match="diverged"):
        a.pull()
    # the remote's history is fetched all the same, and reachable as origin/main
    assert_bit_exact(a.load("origin/main"), _state(1))


def test_pull_fast_forwards_the_current_branch(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    b = ckptrepo.clone(tmp_path / "remote", tmp_path / "b")
    a.snapshot(_state(1), step=1)
    a.push()
    pulled = b.pull()
    assert pulled.refs[-1].status == "fast-forward"
    assert b.resolve("HEAD") == a.resolve("HEAD")
    assert_bit_exact(b.load("HEAD"), _state(1))


def test_a_lazy_clone_holds_no_data_and_loads_every_version(tmp_path: Path, remote_url: str) -> None:
    a = ckptrepo.init(tmp_path / "a")
    for i in range(3):
        a.snapshot(_state(i), step=i)
    a.remote_add("origin", remote_url)
    a.push()
    c = ckptrepo.clone(remote_url, tmp_path / "c", lazy=True)
    assert _keys(c, "data/") == []
    assert len(_keys(c, EVICTED_PREFIX)) == 3
    for i in range(3):
        assert_bit_exact(c.load(f"@{i}"), _state(i))
    report = c.fsck()
    assert report.ok and any("remote" in w for w in report.warnings)
    # a snapshot on top of the lazy history is local, and pushes back
    c.snapshot(_state(3), step=3)
    assert c.push().versions == [c.resolve("HEAD")]
    assert_bit_exact(ckptrepo.open(remote_url).load("HEAD"), _state(3))


def test_a_clone_with_depth_copies_only_the_newest_data(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    for i in range(4):
        a.snapshot(_state(i), step=i)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    c = ckptrepo.clone(tmp_path / "remote", tmp_path / "c", depth=2)
    assert len(c.log()) == 4   # every manifest: the whole history
    owners = {k.split("/")[1] for k in _keys(c, "data/")}
    assert owners == {a.resolve("HEAD"), a.resolve("HEAD~1")}
    for i in range(4):
        assert_bit_exact(c.load(f"@{i}"), _state(i))


def test_a_resharded_load_from_a_lazy_clone_reads_only_what_it_needs(tmp_path: Path, s3_url: str) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 512, generator=g)   # 4 MiB
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot({"model": {"col.weight": weight, "other": torch.randn(1 << 20, generator=g)}}, step=1)
    a.remote_add("origin", s3_url)
    a.push()
    c = ckptrepo.clone(s3_url, tmp_path / "c", lazy=True)
    rules = Rules([("col.weight", Split(0)), ("other", Replicated())])
    for rank in range(2):
        into = {"model": {"col.weight": torch.empty(1024, 512)}}
        stats = ReadStats()
        before = kvstore_bytes_read()
        c.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=rules), rank=rank, into=into, read_stats=stats)
        read = kvstore_bytes_read() - before
        assert torch.equal(into["model"]["col.weight"], weight.chunk(2)[rank])
        assert stats.needed_bytes == 1024 * 512 * 4
        # the slice, whole inner chunks at its ends, the shard index and the chunk table: <= 1.1x
        assert read <= 1.1 * stats.needed_bytes, (read, stats.needed_bytes, INNER_BYTES)


def test_a_remote_holding_another_repository_is_refused(tmp_path: Path) -> None:
    other = ckptrepo.init(tmp_path / "other")
    other.snapshot(_state(9), step=9)
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", tmp_path / "other")
    with pytest.raises(ckptrepo.RemoteError, match="another repository"):
        a.push()
    assert [v.step for v in other.log()] == [9]


def test_gc_keeps_what_a_remote_tracking_ref_reaches(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.checkout("HEAD", branch="exp")
    a.snapshot(_state(1), step=1)
    a.remote_add("origin", tmp_path / "remote")
    a.push(branches=["exp"])
    exp_tip = a.resolve("exp")
    a.checkout("main")
    a.delete_branch("exp", force=True)
    a.gc(grace_period_s=0)
    assert_bit_exact(a.load("origin/exp"), _state(1))
    assert a.resolve("origin/exp") == exp_tip


def test_pushing_a_pruned_version_pushes_its_history_without_data(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    for i in range(3):
        a.snapshot(_state(i), step=i)
    a.gc(keep_last=1, grace_period_s=0)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    remote = ckptrepo.open(tmp_path / "remote")
    assert [v.pruned for v in remote.log()] == [False, True, True]
    assert_bit_exact(remote.load("HEAD"), _state(2))
    with pytest.raises(ckptrepo.RevisionError, match="pruned"):
        remote.load("@0")
    assert remote.fsck().ok


def test_a_push_to_a_store_that_ignores_conditions_is_refused_with_nothing_reachable(tmp_path: Path,
                                                                                     strip_s3_url: str) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", strip_s3_url)
    with pytest.raises(ckptrepo.StorageError, match="conditional"):
        a.push()
    assert a.plumbing.store.list("refs/remotes/") == []   # not remote-durable: nothing moved there
    assert ckptrepo.open(strip_s3_url).branches() == {}
    assert open_store(strip_s3_url).list("data/") == []   # refused before any data was copied


def test_racing_pushers_fast_forward_one_at_a_time(tmp_path: Path, atomic_s3_url: str) -> None:
    """Two clones push on top of the same remote tip at the same moment: the remote branch moves by CAS, so one
    push lands, the other is rejected with "fetch first", and after a pull and a push both versions are there."""
    import threading

    from ckptrepo import faults

    seed = ckptrepo.init(tmp_path / "seed")
    seed.snapshot(_state(0), step=0)
    seed.remote_add("origin", atomic_s3_url)
    seed.push()
    clones = [ckptrepo.clone(atomic_s3_url, tmp_path / f"c{i}") for i in range(2)]
    for i, c in enumerate(clones):
        c.snapshot(_state(10 + i), step=10 + i)
    lined_up = threading.Barrier(2)
    faults.set_hook("push_before_ref", lambda _p: lined_up.wait(30))
    outcomes: list[BaseException | None] = [None, None]

    def push(i: int) -> None:
        try:
            clones[i].push()
        except BaseException as err:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[i] = err

    try:
        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        faults.clear()
    rejected = [i for i, o in enumerate(outcomes) if o is not None]
    assert len(rejected) == 1 and isinstance(outcomes[rejected[0]], ckptrepo.PushRejectedError), outcomes
    winner, loser = clones[1 - rejected[0]], clones[rejected[0]]
    assert ckptrepo.open(atomic_s3_url).resolve("main") == winner.resolve("HEAD")
    with pytest.raises(ckptrepo.PushRejectedError, match="diverged"):
        loser.pull()   # its own version stays on its branch; the winner's is origin/main
    assert_bit_exact(loser.load("origin/main"), _state(10 + 1 - rejected[0]))


def test_gc_on_the_remote_during_a_push_collects_nothing_it_copies(tmp_path: Path) -> None:
    """A pushed version can be older than gc's grace period (its id's time is when it was snapshotted): the
    push's lease keeps a gc on the remote from collecting its data and manifest before the ref moves."""
    from ckptrepo import faults

    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    a.snapshot(_state(1), step=1)
    reports = []
    faults.set_hook("push_before_ref",
                    lambda _p: reports.append(ckptrepo.open(tmp_path / "remote").gc(grace_period_s=0)))
    try:
        a.push()
    finally:
        faults.clear()
    assert reports and reports[0].collected == [] and reports[0].orphan_data == []
    remote = ckptrepo.open(tmp_path / "remote")
    assert_bit_exact(remote.load("HEAD"), _state(1))
    assert remote.plumbing.store.list("pushes/") == []   # the lease ends with the push
    assert remote.fsck().ok


def test_pushing_a_branch_off_old_history_never_marks_the_remote_s_versions_pruned(tmp_path: Path) -> None:
    """Versions pruned here but on the remote with their data stay loadable there: a push that walks down to
    them (a new branch forking off old history) neither re-sends them nor writes a pruned marker over them."""
    a = ckptrepo.init(tmp_path / "a")
    for i in range(4):
        a.snapshot(_state(i), step=i)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    a.checkout("@1", branch="feat")
    a.snapshot(_state(10), step=10)
    a.checkout("main")
    a.gc(keep_last=1, grace_period_s=0)
    assert [v.pruned for v in a.log()] == [False, True, True, True]
    assert len(a.push(branches=["main", "feat"]).versions) == 1
    remote = ckptrepo.open(tmp_path / "remote")
    assert [v.pruned for v in remote.log()] == [False] * 4
    assert remote.gc(grace_period_s=0).bytes_freed == 0
    for i in range(4):
        assert_bit_exact(remote.load(f"@{i}"), _state(i))


def test_a_resumed_push_leases_what_an_interrupted_one_left_unreachable(tmp_path: Path) -> None:
    """Manifests an interrupted push left on the remote are no longer missing there, but are not reachable
    yet either: the resumed push's lease names them, so a gc on the remote meanwhile keeps them."""
    from ckptrepo import faults

    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.remote_add("origin", tmp_path / "remote")
    a.push()
    a.checkout("HEAD", branch="feat")
    for i in range(1, 4):
        a.snapshot(_state(i), step=i)
    copied = []

    def interrupt(_point: str) -> None:
        copied.append(_point)
        if len(copied) == 2:
            raise KeyboardInterrupt("the push dies after two manifests")

    faults.set_hook("push_after_manifest", interrupt)
    with pytest.raises(KeyboardInterrupt):
        a.push(branches=["feat"])
    reports = []
    faults.set_hook("push_after_manifest", None)
    faults.set_hook("push_before_ref", lambda _p: reports.append(ckptrepo.open(tmp_path / "remote").gc(
        grace_period_s=0)))
    try:
        a.push(branches=["feat"])
    finally:
        faults.clear()
    assert reports[0].collected == []
    remote = ckptrepo.open(tmp_path / "remote")
    assert [v.step for v in remote.log("feat")] == [3, 2, 1, 0]
    assert remote.fsck().ok


def test_a_lazy_clone_loads_a_version_whose_tensors_all_live_in_a_pruned_version_s_array(tmp_path: Path) -> None:
    frozen = torch.randn(4096)
    a = ckptrepo.init(tmp_path / "a")
    with a.snapshotter() as snap:
        for i in range(2):
            snap.snapshot({"frozen": frozen}, step=i)
            snap.wait()
    a.gc(keep_last=1, grace_period_s=0)   # step 0 pruned; its array stays, step 1 points into it
    c = ckptrepo.clone(tmp_path / "a", tmp_path / "c", lazy=True)
    assert torch.equal(c.load("HEAD")["frozen"], frozen)
    assert c.fsck().ok
    c.remote_add("other", tmp_path / "other")
    c.push("other")
    assert torch.equal(ckptrepo.open(tmp_path / "other").load("HEAD")["frozen"], frozen)


def test_a_clone_of_a_detached_head_is_detached_at_that_version(tmp_path: Path) -> None:
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.checkout("HEAD", branch="exp")
    a.snapshot(_state(1), step=1)
    a.delete_branch("main", force=True)
    a.checkout("@0")   # detached, at a version only exp's history reaches
    c = ckptrepo.clone(tmp_path / "a", tmp_path / "c")
    assert c.current_branch() is None and c.resolve("HEAD") == a.resolve("@0")
    assert_bit_exact(c.load("HEAD"), _state(0))
    assert c.resolve("origin/exp") == a.resolve("exp")


def test_a_lease_of_a_long_history_is_read_whole(tmp_path: Path) -> None:
    """A first push of thousands of versions leases them all: gc must read a lease of ~100 KB, not drop it."""
    import time

    from ckptrepo.core._manifest import new_version_id
    from ckptrepo.core._remotes import PushLease, leased_versions

    repo = ckptrepo.init(tmp_path / "r")
    ids = [new_version_id() for _ in range(3000)]
    lease = PushLease(repo.plumbing.store, ids)
    held, stale = leased_versions(repo.plumbing.store, time.time())
    assert held == set(ids) and stale == []
    lease.close()
    assert leased_versions(repo.plumbing.store, time.time()) == (set(), [])


def test_fetch_drops_the_tracking_refs_of_branches_deleted_on_the_remote(tmp_path: Path) -> None:
    """Once a branch is gone there, its versions may be collected there: nothing here may still count them
    as held by the remote (log's durability, local eviction)."""
    a = ckptrepo.init(tmp_path / "a")
    a.snapshot(_state(0), step=0)
    a.checkout("HEAD", branch="old")
    a.snapshot(_state(1), step=1)
    a.remote_add("origin", tmp_path / "remote")
    a.push(branches=["main", "old"])
    assert a.version("old").remotes == ("origin",)
    ckptrepo.open(tmp_path / "remote").delete_branch("old", force=True)
    fetched = a.fetch()
    assert [(u.ref, u.status) for u in fetched.refs if u.status == "deleted"] == [("refs/remotes/origin/old",
                                                                                    "deleted")]
    assert a.version("old").remotes == ()
    assert a.version("main").remotes == ("origin",)
