"""What framework adapters build on: a tag set at snapshot time (and moved), text metadata in the header, a
callback once a snapshot is committed, pruning one version's data, and attach() through optimizer wrappers."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from support.helpers import assert_bit_exact, run

import ckptrepo
from ckptrepo.errors import ArgumentError, CorruptionError, RefError, RevisionError, UnsupportedValueError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def test_tag_and_meta_at_snapshot_time(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    with repo.snapshotter() as snap:
        h1 = snap.snapshot(_state(1), step=1, tag="epoch=0.ckpt", meta={"wandb_run": "abc123"})
        h2 = snap.snapshot(_state(2), step=2, tag="last.ckpt", force_tag=True)
        h3 = snap.snapshot(_state(3), step=3, tag="last.ckpt", force_tag=True)   # moves it
    assert repo.tags() == {"epoch=0.ckpt": h1.id, "last.ckpt": h3.id}
    assert h2.result().id != h3.id
    assert repo.version("epoch=0.ckpt").meta == {"wandb_run": "abc123"}
    assert repo.version("last.ckpt").meta == {}
    reopened = ckptrepo.open(tmp_path / "r")
    assert reopened.version(h1.id).meta == {"wandb_run": "abc123"}
    assert_bit_exact(reopened.load("last.ckpt"), _state(3))
    out = run("log", "--json", repo=str(tmp_path / "r"))
    assert {"wandb_run": "abc123"} in [v["meta"] for v in json.loads(out.stdout)]
    assert "meta    wandb_run=abc123" in run("show", "epoch=0.ckpt", repo=str(tmp_path / "r")).stdout
    # synchronous snapshots take the same keywords; the version returned lists its tag
    v = repo.snapshot(_state(4), step=4, tag="best", meta={"file": "best.ckpt"})
    assert "tag: best" in " ".join(v.refs) or "best" in " ".join(v.refs)
    assert repo.resolve("best") == v.id and v.meta == {"file": "best.ckpt"}


def test_a_tag_that_exists_is_refused_at_snapshot_unless_forced(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    first = repo.snapshot(_state(1), step=1, tag="keep")
    with repo.snapshotter() as snap:
        with pytest.raises(RefError, match="tag 'keep' exists.*force_tag=True"):
            snap.snapshot(_state(2), step=2, tag="keep")
        with pytest.raises(RefError, match="invalid|not a valid|cannot"):
            snap.snapshot(_state(2), step=2, tag="bad..name")
    assert repo.resolve("keep") == first.id
    assert [v.step for v in repo.log()] == [1]   # nothing was snapshotted by the refused calls


def test_meta_must_be_text(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    with pytest.raises(UnsupportedValueError, match="meta 'run' = 3 is not text"):
        repo.snapshot(_state(1), meta={"run": 3})
    assert repo.log() == []


def test_a_stored_meta_that_is_not_text_is_named_as_corruption(tmp_path):
    from ckptrepo.core._manifest import VERSIONS_PREFIX, seal, unseal
    repo = ckptrepo.init(tmp_path / "r")
    v = repo.snapshot(_state(1), step=1, meta={"run": "x"})
    store = repo.plumbing.store
    raw = unseal(store.get(VERSIONS_PREFIX + v.id), "m")
    raw["meta"] = {"run": 7}
    store.put(VERSIONS_PREFIX + v.id, seal(raw))
    with pytest.raises(CorruptionError, match="meta"):
        ckptrepo.open(tmp_path / "r").version(v.id)


def test_force_moves_a_tag(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    a = repo.snapshot(_state(1), step=1)
    b = repo.snapshot(_state(2), step=2)
    repo.tag("last", a.id)
    with pytest.raises(RefError, match="exists"):
        repo.tag("last", b.id)
    repo.tag("last", b.id, force=True)
    assert repo.resolve("last") == b.id
    repo.tag("fresh", a.id, force=True)   # force on a new name simply creates it
    assert repo.resolve("fresh") == a.id
    with pytest.raises(ArgumentError, match="force must be True or False"):
        repo.tag("x", a.id, force="yes")


def test_done_callbacks_run_after_commit_and_before_wait_returns(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    seen: list[tuple[str, int | None, bool]] = []
    finished = threading.Event()

    def slow(h):
        time.sleep(0.2)
        v = h.result()   # already known inside the callback
        seen.append((v.id, v.step, repo.resolve(v.id) == v.id))
        finished.set()

    with repo.snapshotter() as snap:
        h = snap.snapshot(_state(1), step=7)
        h.add_done_callback(slow)
        snap.wait()
        assert finished.is_set(), "wait() returned before the done callback ran"
        settled = snap.snapshot(_state(2), step=8)
        slow_again: list[str] = []
        settled.add_done_callback(lambda hh: (time.sleep(0.3), slow_again.append(hh.id)))
        settled.result()   # committed; its callback may still be running
        snap.wait()
        assert slow_again == [settled.id], "wait() returned before a committed snapshot's callback ran"
        late: list[str] = []
        h.add_done_callback(lambda hh: late.append(hh.id))   # already done: runs at once, here
        assert late == [h.id]
    assert seen == [(h.id, 7, True)]


def test_a_failing_callback_is_logged_and_later_snapshots_go_on(tmp_path, caplog):
    repo = ckptrepo.init(tmp_path / "r")

    def boom(_h):
        raise ValueError("callback bug")

    with caplog.at_level(logging.ERROR, logger="ckptrepo"):
        with repo.snapshotter() as snap:
            snap.snapshot(_state(1), step=1).add_done_callback(boom)
            snap.wait()
            snap.snapshot(_state(2), step=2)
    assert [v.step for v in repo.log()] == [2, 1]
    assert "callback bug" in caplog.text
    with pytest.raises(ArgumentError, match="callable"):
        ckptrepo.open(tmp_path / "r").snapshotter().snapshot(_state(3)).add_done_callback(42)


def test_prune_deletes_one_versions_data_and_keeps_what_others_share(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    frozen = torch.randn(512, 512, dtype=torch.float64)   # its own array (one per dtype)
    hs = []
    with repo.snapshotter() as snap:   # dedup: versions 2 and 3 point at version 1's bytes of "frozen"
        for i in (1, 2, 3):
            hs.append(snap.snapshot({"frozen": frozen, "adapter": torch.full((64,), float(i))}, step=i))
            snap.wait()
    v1, v2, v3 = (h.id for h in hs)
    repo.tag("best", v2)
    with pytest.raises(RefError, match="tag 'best'"):
        repo.prune(v2)
    with pytest.raises(RefError, match="branch 'main'"):
        repo.prune(v3)
    freed = repo.prune(v1)
    assert freed == 64 * 4   # only its own adapter: "frozen" is still used by versions 2 and 3
    with pytest.raises(RevisionError, match="pruned"):
        repo.load(v1)
    assert_bit_exact(repo.load(v3)["frozen"], frozen)
    assert repo.version(v1).pruned and [v.step for v in repo.log()] == [3, 2, 1]
    assert repo.prune(v1) == 0   # already pruned
    repo.delete_tag("best")
    assert repo.prune(v2) == 64 * 4
    assert_bit_exact(repo.load(v3)["frozen"], frozen)
    assert run("fsck", repo=str(tmp_path / "r")).returncode == 0


def test_attach_reaches_the_optimizer_inside_accelerates_wrapper(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = torch.nn.Linear(8, 8)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = accelerate.Accelerator(cpu=True).prepare(inner)
    assert wrapped is not inner and wrapped.optimizer is inner
    repo = ckptrepo.init(tmp_path / "r")
    with repo.snapshotter() as snap:
        before = len(inner._optimizer_step_pre_hooks)
        snap.attach(wrapped)
        assert len(inner._optimizer_step_pre_hooks) == before + 1   # the step that really runs waits


def test_cli_moves_a_tag_with_f_and_prunes_one_version(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    a = repo.snapshot({"w": torch.ones(100)}, step=1)
    b = repo.snapshot({"w": torch.zeros(100)}, step=2)
    where = str(tmp_path / "r")
    assert run("tag", "last", a.id, repo=where).returncode == 0
    refused = run("tag", "last", b.id, repo=where)
    assert refused.returncode != 0 and "tag -f" in refused.stderr and refused.stderr.count("\n") == 1
    assert "set tag 'last'" in run("tag", "-f", "last", b.id, repo=where).stdout
    assert repo.resolve("last") == b.id
    assert "400 B freed" in run("prune", "@1", repo=where).stdout
    kept = run("prune", "@2", repo=where)
    assert kept.returncode != 0 and "named by tag 'last'" in kept.stderr
    assert repo.version(a.id).pruned and not repo.version(b.id).pruned


def _prune_while_reusing(tmp_path, hook_point: str, action=None):
    """v3 reuses v1's bytes of "y" (dedup: matched while v2, without "y", was not committed yet); ``prune(v1)``
    (or ``action(repo, v1)``) runs at ``hook_point`` of v3's commit. Returns (repo, v1, v3's handle, y)."""
    from ckptrepo import faults
    repo = ckptrepo.init(tmp_path / "r")
    snap = repo.snapshotter(max_in_flight=4)
    y = torch.arange(1000.0)
    v1 = snap.snapshot({"a": torch.zeros(10), "y": y}, step=1).result()
    hold_v2 = threading.Event()
    seen: list[str] = []

    def at_data(_):
        seen.append("data")
        if len(seen) == 1:
            hold_v2.wait(10)   # v2 is held until v3 has been matched against v1

    def at_point(_):
        if repo.branches()["main"] != v1.id:   # v3's commit (v2 is the tip by then)
            faults.set_hook(hook_point, None)
            (action or (lambda r, v: r.prune(v.id)))(repo, v1)
    faults.set_hook("after_data", at_data)
    faults.set_hook(hook_point, at_point)
    try:
        h2 = snap.snapshot({"a": torch.ones(10)}, step=2)
        h3 = snap.snapshot({"a": torch.full((10,), 3.0), "y": y}, step=3)
        hold_v2.set()
        h2.result()
        try:
            h3.result(timeout=30)
        except ckptrepo.CkptRepoError:
            pass
        try:
            snap.close()
        except ckptrepo.CkptRepoError:
            pass
    finally:
        faults.clear()
    return repo, v1, h3, y


def test_a_prune_that_reads_an_in_flight_manifest_keeps_what_it_reuses(tmp_path):
    repo, v1, h3, y = _prune_while_reusing(tmp_path, "after_manifest")
    v3 = h3.result()   # its manifest was written before the prune read the history: "y" is kept
    assert_bit_exact(repo.load(v3.id)["y"], y)
    assert repo.version(v1.id).pruned
    assert run("fsck", repo=str(tmp_path / "r")).returncode == 0


def test_a_gc_that_reads_an_in_flight_manifest_keeps_what_it_reuses(tmp_path):
    freed = []
    repo, v1, h3, y = _prune_while_reusing(tmp_path, "after_manifest",
                                           lambda r, v: freed.append(r.gc(keep_last=1)))
    v3 = h3.result()   # retention pruned v1 (not the tip's history), but v3's manifest, read again, keeps "y"
    assert_bit_exact(repo.load(v3.id)["y"], y)
    assert repo.version(v1.id).pruned and freed[0].bytes_freed == 0   # v1's one float32 array holds "y" too
    assert run("fsck", repo=str(tmp_path / "r")).returncode == 0


def test_a_prune_under_way_fails_a_commit_that_reuses_its_arrays_instead_of_corrupting_it(tmp_path):
    from ckptrepo.core._manifest import PRUNING_PREFIX, seal
    from ckptrepo.maintenance._gc import pruning_arrays
    repo = ckptrepo.init(tmp_path / "r")
    store = repo.plumbing.store
    store.put(PRUNING_PREFIX + "a" * 32, seal({"time": time.time(), "arrays": ["data/x/0/float32"]}))
    store.put(PRUNING_PREFIX + "b" * 32, seal({"time": time.time() - 7200, "arrays": ["data/y/0/float32"]}))
    assert pruning_arrays(store, time.time()) == {"data/x/0/float32"}   # the stale intent of a dead prune is not
    y = torch.arange(100.0)
    with repo.snapshotter() as snap:
        v1 = snap.snapshot({"y": y}, step=1).result()
        array = next(iter(repo.plumbing.manifest(v1.id).arrays))
        store.put(PRUNING_PREFIX + "c" * 32, seal({"time": time.time(), "arrays": [array]}))
        h = snap.snapshot({"y": y}, step=2)   # unchanged: reuses v1's array, which a prune is deleting
        with pytest.raises(ckptrepo.CkptRepoError, match="being deleted by a `prune`"):
            h.result()
        with pytest.raises(ckptrepo.CkptRepoError):
            snap.wait()
    assert [v.step for v in repo.log()] == [1]
    repo.gc()   # the dead prune's intent goes; a young one stays
    assert sorted(store.list(PRUNING_PREFIX)) == [PRUNING_PREFIX + "a" * 32, PRUNING_PREFIX + "c" * 32]


def test_snapshot_refuses_a_tag_the_commit_could_not_set(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    v = repo.snapshot(_state(1), step=1)
    with repo.snapshotter() as snap:
        for bad, force in (("main", False), ("main", True), (v.id[:8], True), (v.id[:8], False)):
            with pytest.raises(RefError, match="branch of that name|start of a version id|exists"):
                snap.snapshot(_state(2), step=2, tag=bad, force_tag=force)
    assert [x.step for x in repo.log()] == [1] and repo.tags() == {}


def test_meta_is_bounded(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    with pytest.raises(UnsupportedValueError, match="more than the 65536"):
        repo.snapshot(_state(1), meta={"blob": "x" * 70_000})
    assert repo.log() == []


def test_single_process_refuses_a_layout_of_several_ranks(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    with pytest.raises(ckptrepo.LayoutError, match="single_process"):
        repo.snapshotter(single_process=True, parallel_layout=ckptrepo.ParallelLayout(tp=2))
    with pytest.raises(ArgumentError, match="single_process must be True or False"):
        repo.snapshotter(single_process="yes")
