"""gc with no grace period beside a writer (issue 39): what gc keeps, what fsck names, and the repair."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from support.helpers import assert_bit_exact, run

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import CorruptionError
from ckptrepo.maintenance import _gc as gc_module
from ckptrepo.maintenance._lost import repair_lost


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def state_at(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


def stored(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def paused_writer(url: str, step: int, point: str = "after_manifest") -> tuple[threading.Thread, threading.Event, dict]:
    """A writer in another thread that snapshots ``step`` and stops at fault point ``point`` (by default after
    its manifest is written, before its branch moves); it goes on once the returned event is set (its version,
    or error, lands in the dict)."""
    reached, release, result = threading.Event(), threading.Event(), {}

    def hold(_point: str) -> None:
        reached.set()
        release.wait(60)
    faults.set_hook(point, hold)

    def write() -> None:
        try:
            result["version"] = ckptrepo.open(url).snapshot(state_at(step), step=step)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            result["error"] = err
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert reached.wait(60), "the writer never wrote its manifest"
    faults.clear()
    return writer, release, result


def lose_a_version(url: str, step: int) -> str:
    """The end state of issue 39: a gc with no grace period collects the version a writer is committing, then
    the writer's branch moves onto it, and the writer dies before it checks what gc did."""
    writer, release, result = paused_writer(url, step)
    report = ckptrepo.open(url).gc(grace_period_s=0)
    faults.set_hook("after_ref", lambda _point: (_ for _ in ()).throw(OSError("killed")))
    release.set()
    writer.join(60)
    faults.clear()
    assert "killed" in str(result["error"])
    assert len(report.collected) == 1 and ckptrepo.open(url).resolve("main") == report.collected[0]
    return report.collected[0]


def test_a_writer_whose_version_gc_collected_as_it_committed_moves_its_branch_back(tmp_path):
    """gc names the versions it collects in its intent before it reads the refs again; a writer whose branch
    moved after that read finds its version there, and moves the branch back instead of leaving it on a
    version that does not exist (every later gc refused)."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    ids = [repo.snapshot(state_at(s), step=s).id for s in range(3)]
    writer, release, result = paused_writer(url, 3)
    report = ckptrepo.open(url).gc(grace_period_s=0)
    release.set()
    writer.join(60)
    assert len(report.collected) == 1
    err = result.get("error")
    assert isinstance(err, ckptrepo.errors.SnapshotFailedError), result
    assert all(s in str(err) for s in (f"version {report.collected[0][:12]} was not committed", "gc --grace 0",
                                       f"branch 'main' is back at {ids[2][:12]}")), str(err)
    repo = ckptrepo.open(url)
    assert repo.resolve("main") == ids[2]
    v = repo.snapshot(state_at(4), step=4)
    assert repo.version(v.id).parents == (ids[2],)
    assert repo.gc(grace_period_s=0).collected == []
    check = repo.fsck()
    assert check.ok, check.errors
    assert not [w for w in check.warnings if "not reachable" in w or "lost" in w], check.warnings
    for s, vid in zip(range(3), ids):
        assert_bit_exact(state_at(s), repo.load(vid))


def test_gc_keeps_a_version_its_branch_moved_onto_while_gc_ran(tmp_path, monkeypatch):
    """The refs were read once, before the listing: a writer whose manifest was listed and whose branch moved
    after that read lost its version to a gc with no grace period (manifest and data), and every later gc
    refused. gc reads the refs again before it deletes."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    for s in range(3):
        repo.snapshot(state_at(s), step=s)
    writer, release, result = paused_writer(url, 3)
    listing = gc_module._facts

    def listing_then_the_branch_moves(plumbing, known):
        out = listing(plumbing, known)
        release.set()
        writer.join(60)
        return out
    monkeypatch.setattr(gc_module, "_facts", listing_then_the_branch_moves)
    report = ckptrepo.open(url).gc(grace_period_s=0)
    monkeypatch.undo()
    vid = result["version"].id
    assert report.collected == [] and vid in report.kept and report.bytes_freed == 0
    fresh = ckptrepo.open(url)
    assert fresh.resolve("main") == vid
    assert_bit_exact(state_at(3), fresh.load("main"))
    check = fresh.fsck()
    assert check.ok and not check.warnings, (check.errors, check.warnings)


def test_fsck_names_a_version_gc_collected_under_a_writer_and_repair_lets_gc_run(tmp_path):
    """The writer went on, on top of the collected version: fsck said only "parent ... is missing", gc refused
    for good, and nothing said how to get out. fsck names what happened; `fsck --repair` marks the version
    lost, tags the history before it, deletes nothing, and gc runs again."""
    path = tmp_path / "r"
    url = str(path)
    repo = ckptrepo.init(url)
    ids = [repo.snapshot(state_at(s), step=s).id for s in range(3)]
    lost = lose_a_version(url, 3)
    later = [ckptrepo.open(url).snapshot(state_at(s), step=s).id for s in (4, 5)]
    repo = ckptrepo.open(url)
    report = repo.fsck()
    named = [e for e in report.errors if f"version {lost[:12]} is missing" in e]
    assert not report.ok and len(named) == 1, report.errors
    assert all(s in named[0] for s in (f"version {later[0][:12]} of branch 'main', as its parent", "gc --grace 0",
                                       "fsck --repair", "deleting nothing")), named[0]
    with pytest.raises(CorruptionError, match="gc stopped before deleting anything"):
        repo.gc(grace_period_s=0)

    before = stored(path)
    r = run("fsck", "--repair", repo=url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"repair: marked version {lost[:12]} lost" in r.stdout
    assert f"repair: tagged {ids[2][:12]} lost/{lost[:12]}" in r.stdout
    assert stored(path) >= before, "the repair deletes nothing"
    repo = ckptrepo.open(url)
    assert repo.resolve(f"lost/{lost[:12]}") == ids[2] and repo.resolve("main") == later[1]
    gc = repo.gc(grace_period_s=0)
    assert gc.collected == [] and gc.orphan_data == [] and gc.pruned == []
    report = repo.fsck()
    assert report.ok, report.errors
    assert any(f"version {lost[:12]} is lost" in w for w in report.warnings), report.warnings
    assert not any("not reachable" in w for w in report.warnings), report.warnings
    for s, vid in zip((0, 1, 2, 4, 5), ids + later):
        assert_bit_exact(state_at(s), repo.load(vid))
    assert [v.step for v in repo.log()] == [5, 4], "log ends at the lost version"
    assert [v.step for v in repo.log(f"lost/{lost[:12]}")] == [2, 1, 0]
    assert {v.step for v in repo.log(all=True)} == {0, 1, 2, 4, 5}
    again = run("fsck", "--repair", repo=url)
    assert again.returncode == 0 and "repair:" not in again.stdout, again.stdout


def test_repair_moves_a_branch_that_names_a_lost_version_back_and_snapshots_go_on(tmp_path):
    """The writer stopped after the collected version: its branch named a version that does not exist, so
    load, snapshot and gc all failed on it."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    ids = [repo.snapshot(state_at(s), step=s).id for s in range(3)]
    lost = lose_a_version(url, 3)
    repo = ckptrepo.open(url)
    report = repo.fsck()
    assert any(f"version {lost[:12]} is missing" in e and "yet branch 'main' names it" in e
               for e in report.errors), report.errors
    done = repair_lost(repo.plumbing)
    assert f"moved branch 'main' from lost version {lost[:12]} back to {ids[2][:12]}" in done, done
    repo = ckptrepo.open(url)
    assert repo.resolve("main") == ids[2]
    assert_bit_exact(state_at(2), repo.load("main"))
    v = repo.snapshot(state_at(6), step=6)
    assert repo.version(v.id).parents == (ids[2],)
    assert repo.gc(grace_period_s=0).collected == []
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)
    assert [x.step for x in repo.log()] == [6, 2, 1, 0]


def test_a_writer_whose_data_gc_deleted_as_leftover_moves_its_branch_back(tmp_path):
    """Before its manifest, a snapshot's data is data without a manifest, which a gc with no grace period
    deletes: the snapshot then committed a version whose arrays were gone (fsck: "cannot be opened")."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    ids = [repo.snapshot(state_at(s), step=s).id for s in range(3)]
    writer, release, result = paused_writer(url, 3, point="after_data")
    report = ckptrepo.open(url).gc(grace_period_s=0)
    release.set()
    writer.join(60)
    assert len(report.orphan_data) == 1
    err = result.get("error")
    assert isinstance(err, ckptrepo.errors.SnapshotFailedError), result
    assert all(s in str(err) for s in (f"version {report.orphan_data[0][:12]} was not committed", "gc --grace 0",
                                       "deleted its data", f"branch 'main' is back at {ids[2][:12]}")), str(err)
    repo = ckptrepo.open(url)
    assert repo.resolve("main") == ids[2]
    assert repo.gc(grace_period_s=0).collected == report.orphan_data   # the manifest it wrote, now unreachable
    check = repo.fsck()
    assert check.ok and not [w for w in check.warnings if "failed" not in w], (check.errors, check.warnings)
    assert_bit_exact(state_at(2), repo.load("main"))
