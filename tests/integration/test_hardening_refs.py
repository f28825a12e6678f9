"""Refs, revisions and gc against damaged or hostile repositories (issue 27, sections 2, 3 and 7).

Each test first builds the damage the issue reports (a branch named with a trailing newline, a stray pruned
marker, a deleted branch ref, a bit flip in HEAD, manifests re-sealed into a parent cycle, a gc killed
midway), then checks the rule: nothing hangs, fsck exits non-zero, gc deletes nothing, and a snapshot never
silently starts a new root in a repository that has versions.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from support.helpers import outcome_within, run

import ckptrepo
from ckptrepo.core._manifest import seal, unseal
from ckptrepo.core._revisions import MAX_REVISION_CHARS, parse
from ckptrepo.errors import CorruptionError, RefError, RevisionError


def commit_steps(repo: ckptrepo.Repository, steps) -> list[str]:
    return [repo.snapshot({"w": torch.full((4,), float(s))}, step=s).id for s in steps]


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result, raising its exception, failing the test if it has not returned after ``seconds``."""
    got = outcome_within(seconds, call)
    if isinstance(got, BaseException):
        raise got
    return got


def stored(path: Path) -> set[str]:
    """Every file under the repository (what a gc that must delete nothing has to leave)."""
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def five(tmp_path) -> tuple[Path, list[str]]:
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    return path, commit_steps(repo, range(5))


def reseal_parents(path: Path, vid: str, parents: list[str]) -> None:
    """Rewrite a manifest's parents and seal it again: its checksum holds, its history lies."""
    file = path / "versions" / vid
    m = unseal(file.read_bytes(), "test")
    m["parents"] = parents
    file.write_bytes(seal(m))


# ---- section 3: names, HEAD, revisions --------------------------------------------------------------------

def test_a_branch_name_with_a_trailing_newline_is_refused_and_history_stays(five):
    path, ids = five
    r = run("checkout", "HEAD~2", "-b", "evil\n", repo=str(path))
    assert r.returncode != 0 and "invalid branch name 'evil\\n'" in r.stderr and r.stderr.count("\n") == 1
    assert (path / "HEAD").read_bytes() == b"ref: refs/heads/main"
    assert not (path / "refs/heads/evil\n").exists()
    r = run("log", repo=str(path))
    assert r.returncode == 0 and r.stdout.count("step ") == 5
    v = ckptrepo.open(str(path)).snapshot({"w": torch.zeros(4)}, step=5)
    assert v.parents == (ids[4],)


@pytest.mark.parametrize("name", ["evil\n", "a\tb", "a b", "x\x00", "\x1b[2J", "a\r", "nl\nin", "x.lock",
                                  "a/b.lock/c", " lead", "trail "])
def test_names_with_whitespace_control_characters_or_lock_parts_are_refused(five, name):
    repo = ckptrepo.open(str(five[0]))
    for make in (repo.branch, repo.tag, repo.checkout_orphan):
        with pytest.raises(RefError, match="invalid"):
            make(name)
    with pytest.raises(RefError, match="invalid"):
        repo.checkout("HEAD", branch=name)
    assert repo.branches() == {"main": five[1][4]} and repo.tags() == {}


@pytest.mark.parametrize("text, ok", [
    (b"ref: refs/heads/main", True),
    (b"ref: refs/heads/main\n", True),            # as git and `echo` write it
    (b"ref: refs/heads/main\n\n", False),
    (b"ref: refs/heads/main ", False),
    (b"ref: refs/heads/main\r\n", False),
    (b" ref: refs/heads/main", False),
    (b"ref: refs/heads/ma\xffin", False),
])
def test_head_is_read_as_written_not_stripped(five, text, ok):
    path, ids = five
    (path / "HEAD").write_bytes(text)
    repo = ckptrepo.open(str(path))
    if ok:
        assert repo.resolve("HEAD") == ids[4] and repo.current_branch() == "main"
        assert repo.fsck().ok
        return
    with pytest.raises(CorruptionError, match="HEAD is damaged"):
        repo.log()
    assert not repo.fsck().ok
    before = stored(path)
    with pytest.raises(CorruptionError):
        repo.gc(grace_period_s=0)
    assert stored(path) == before


@pytest.mark.parametrize("suffix, ok", [(b"", True), (b"\n", True), (b"\n\n", False), (b" ", False),
                                        (b"\r\n", False)])
def test_a_branch_ref_is_read_as_written_not_stripped(five, suffix, ok):
    path, ids = five
    (path / "refs/heads/main").write_bytes(ids[4].encode() + suffix)
    repo = ckptrepo.open(str(path))
    if ok:
        assert repo.resolve("main") == ids[4] and repo.fsck().ok
    else:
        with pytest.raises(CorruptionError, match="refs/heads/main is damaged"):
            repo.resolve("main")
        assert not repo.fsck().ok


def test_a_ref_named_with_a_trailing_newline_by_an_older_release_is_named_as_damage(five):
    """Older releases created `refs/heads/evil\\n`. It is no ref name now, yet it may hold the only way to a
    history: fsck names it, gc stops, listings leave it out with a warning."""
    path, ids = five
    (path / "refs/heads/evil\n").write_bytes(ids[2].encode())
    repo = ckptrepo.open(str(path))
    report = repo.fsck()
    assert not report.ok and any("ending in a newline" in e for e in report.errors)
    before = stored(path)
    with pytest.raises(CorruptionError, match="ending in a newline"):
        repo.gc(grace_period_s=0)
    assert stored(path) == before
    r = run("branch", repo=str(path))
    assert r.returncode == 0 and "warning: ignoring" in r.stderr and "main" in r.stdout


def test_a_long_revision_parses_at_once_and_a_too_long_one_is_refused(five, monkeypatch):
    t = time.perf_counter()
    for rev in ("HEAD" + "~1" * 509 + "x", "HEAD" + "~" * 1019 + "x", "HEAD" + "~1" * 510):
        parse(rev)
    monkeypatch.setattr("ckptrepo.core._revisions.MAX_REVISION_CHARS", 1 << 20)
    for rev in ("HEAD" + "~1" * 16000 + "x", "HEAD" + "~" * 32000 + "x", "HEAD" + "~1" * 16000):   # 32 KB: 14 s
        parse(rev)
    assert time.perf_counter() - t < 0.5, "parsing is linear in the revision's length"
    monkeypatch.undo()
    repo = ckptrepo.open(str(five[0]))
    for rev in ("HEAD" + "~1" * 16000 + "x", "HEAD" + "~1" * 16000):   # 32 KB: took 14 s when malformed
        t = time.perf_counter()
        with pytest.raises(RevisionError, match=f"too long \\(at most {MAX_REVISION_CHARS}\\)"):
            repo.resolve(rev)
        assert time.perf_counter() - t < 0.5
    r = run("log", "HEAD" + "~1" * 16000, repo=str(five[0]))
    assert r.returncode != 0 and "too long" in r.stderr
    assert repo.resolve("HEAD~1~1") == five[1][2] and repo.resolve("HEAD~" + "0" * 900 + "2") == five[1][2]
    with pytest.raises(RevisionError, match="has only 4 ancestors"):
        repo.resolve("HEAD~" + "9" * 900)


@pytest.mark.parametrize("rev, base, back", [
    ("HEAD", "HEAD", 0), ("HEAD~", "HEAD", 1), ("HEAD~~3~", "HEAD", 5), ("~1", "~1", 0), ("~1~2", "~1", 2),
    ("a~b~2", "a~b", 2), ("@3~12", "@3", 12), ("x~1y", "x~1y", 0), ("9~9", "9", 9), (" main~1 ", "main", 1),
])
def test_parse_splits_as_before(rev, base, back):
    assert parse(rev) == (base, back)


# ---- section 3 and 7: a new root only when asked ------------------------------------------------------------

def test_a_deleted_branch_ref_stops_log_snapshot_fsck_and_gc(five):
    path, ids = five
    (path / "refs/heads/main").unlink()
    repo = ckptrepo.open(str(path))
    with pytest.raises(CorruptionError, match="branch 'main', which does not exist, while the repository has 5"):
        repo.log()
    r = run("log", repo=str(path))
    assert r.returncode != 0 and "no versions yet" not in r.stdout and "checkout --orphan main" in r.stderr
    with pytest.raises(RefError, match="not snapshotting: it would start a new history .*checkout --orphan main"):
        repo.snapshot({"w": torch.zeros(4)}, step=5)
    r = run("fsck", repo=str(path))
    assert r.returncode == 1 and "does not exist" in r.stdout
    before = stored(path)
    r = run("gc", "--grace", "0", repo=str(path))
    assert r.returncode != 0 and r.stderr.startswith("ckptrepo: error: gc stopped before deleting anything")
    assert r.stderr.count("\n") == 1 and stored(path) == before
    # the repair the message names
    assert run("branch", "main", ids[4], repo=str(path)).returncode == 0
    assert ckptrepo.open(str(path)).fsck().ok and len(ckptrepo.open(str(path)).log()) == 5


@pytest.mark.parametrize("ref", ["refs/tags/good", "refs/heads/side/x"])
def test_an_empty_folder_in_place_of_a_ref_fails_fsck_and_stops_gc(tmp_path, ref):
    """A folder reads as "no ref": the versions only it reached looked unreachable, and gc collected them."""
    path = tmp_path / "r"
    repo = ckptrepo.init(str(path))
    root = repo.snapshot({"w": torch.zeros(4)}, step=0).id
    repo.checkout(root, branch="side/x")
    only_here = repo.snapshot({"w": torch.ones(4)}, step=1).id
    repo.tag("good", only_here)
    repo.checkout("main")
    (path / ref).unlink()
    (path / ref).mkdir()
    report = ckptrepo.open(str(path)).fsck()
    assert any(f"{ref} is an empty folder or a broken link, not a ref" in e for e in report.errors), report.errors
    before = stored(path)
    with pytest.raises(CorruptionError, match=f"{ref} is an empty folder"):
        ckptrepo.open(str(path)).gc(grace_period_s=0)
    assert stored(path) == before and (path / "versions" / only_here).exists()


def test_a_bit_flip_in_head_naming_no_branch_fails_fsck_and_refuses_a_new_root(five):
    """One flipped bit: 'main' -> 'mail'. fsck said ok, log "no versions yet", and the next snapshot started a
    new root, so a job resuming from HEAD restarted from scratch."""
    path, ids = five
    raw = bytearray((path / "HEAD").read_bytes())
    raw[-1] ^= ord("n") ^ ord("l")
    (path / "HEAD").write_bytes(bytes(raw))
    repo = ckptrepo.open(str(path))
    assert repo.current_branch() == "mail"
    report = repo.fsck()
    assert not report.ok and any("'mail', which does not exist" in e for e in report.errors)
    assert run("fsck", repo=str(path)).returncode == 1
    with pytest.raises(RefError, match="new history"):
        repo.snapshotter()
    before = stored(path)
    with pytest.raises(CorruptionError, match="gc stopped"):
        repo.gc(grace_period_s=0)
    assert stored(path) == before
    repo.checkout("main")
    assert repo.snapshot({"w": torch.zeros(4)}, step=5).parents == (ids[4],)


def test_an_orphan_checkout_starts_a_new_history_on_purpose(five):
    path, ids = five
    r = run("checkout", "--orphan", "fresh", repo=str(path))
    assert r.returncode == 0 and "new branch 'fresh'" in r.stdout
    assert (path / "HEAD").read_bytes() == b"orphan: refs/heads/fresh"
    repo = ckptrepo.open(str(path))
    assert repo.current_branch() == "fresh" and repo.log() == []
    report = repo.fsck()
    assert report.ok and not report.warnings, report
    v = repo.snapshot({"w": torch.ones(4)}, step=0)
    assert v.parents == () and repo.branches() == {"main": ids[4], "fresh": v.id}
    assert (path / "HEAD").read_bytes() == b"ref: refs/heads/fresh", "HEAD is plain once the branch exists"
    assert repo.snapshot({"w": torch.ones(4)}, step=1).parents == (v.id,)
    assert repo.fsck().ok and [x.id for x in repo.log("main")] == ids[::-1]
    assert repo.gc(grace_period_s=0).collected == []


def test_an_orphan_checkout_refuses_an_existing_name_and_extra_arguments(five):
    path, _ = five
    repo = ckptrepo.open(str(path))
    with pytest.raises(RefError, match="already exists"):
        repo.checkout_orphan("main")
    for args in (("--orphan", "x", "HEAD"), ("--orphan", "x", "-b", "y")):
        r = run("checkout", *args, repo=str(path))
        assert r.returncode == 2 and "--orphan NAME takes no REV" in r.stderr
    assert run("checkout", repo=str(path)).returncode == 2
    assert repo.current_branch() == "main"


def test_an_orphan_checkout_is_the_repair_after_an_interrupted_first_snapshot(tmp_path):
    """The one state a new root is refused in without damage: the very first snapshot killed after its
    manifest and before its ref. The message names the way on; gc then collects the leftover."""
    from ckptrepo import faults
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    faults.set_hook("after_manifest", lambda _: (_ for _ in ()).throw(OSError("interrupted")))
    try:
        with pytest.raises(ckptrepo.CkptRepoError, match="interrupted"):
            repo.snapshot({"w": torch.zeros(4)}, step=0)
    finally:
        faults.clear()
    with pytest.raises(RefError, match="checkout --orphan main"):
        repo.snapshot({"w": torch.zeros(4)}, step=0)
    repo.checkout_orphan("main")
    assert repo.snapshot({"w": torch.zeros(4)}, step=0).parents == ()
    assert len(repo.gc(grace_period_s=0).collected) == 1 and repo.fsck().ok


# ---- section 2: gc refuses on damage ------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["tip", "tag", "detached"])
def test_a_stray_pruned_marker_on_a_ref_version_fails_fsck_and_stops_gc(five, target):
    path, ids = five
    repo = ckptrepo.open(str(path))
    vid = {"tip": ids[4], "tag": ids[2], "detached": ids[3]}[target]
    if target == "tag":
        repo.tag("keep", vid)
    if target == "detached":
        repo.checkout(vid)
    (path / "pruned").mkdir(exist_ok=True)
    (path / "pruned" / vid).write_bytes(b"")
    report = repo.fsck()
    assert not report.ok and any(f"pruned/{vid} marks version" in e for e in report.errors), report.errors
    assert run("fsck", repo=str(path)).returncode == 1
    before = stored(path)
    for gc in (lambda: repo.gc(), lambda: repo.gc(grace_period_s=0), lambda: repo.gc(keep_last=1, grace_period_s=0)):
        with pytest.raises(CorruptionError, match=f"gc stopped before deleting anything: pruned/{vid}"):
            gc()
    r = run("gc", repo=str(path))
    assert r.returncode != 0 and "stray" in r.stderr
    assert stored(path) == before
    (path / "pruned" / vid).unlink()   # the repair the message names
    assert repo.fsck().ok and repo.load(vid)["w"][0].item() == ids.index(vid)


def test_pruning_branch_heads_on_request_is_no_damage_and_an_interrupted_pass_can_be_rerun(five, monkeypatch):
    path, ids = five
    repo = ckptrepo.open(str(path))
    repo.branch("side", ids[3])
    store = repo.plumbing.store
    real = type(store).delete_prefix

    def killed(self, prefix):   # the pass dies after its markers, before any data is deleted
        raise OSError("killed")
    monkeypatch.setattr(type(store), "delete_prefix", killed)
    with pytest.raises(OSError):
        repo.gc(keep_every=2, keep_branch_heads=False, grace_period_s=0)
    monkeypatch.setattr(type(store), "delete_prefix", real)
    assert (path / "pruned" / ids[3]).exists() and (path / "data" / ids[3]).exists()
    assert not repo.fsck().ok            # a marker on branch side's tip, data still there
    with pytest.raises(CorruptionError, match="run it again"):
        repo.gc(grace_period_s=0)        # a plain gc would finish it: refused
    r = repo.gc(keep_every=2, keep_branch_heads=False, grace_period_s=0)   # the same pass again finishes it
    assert not (path / "data" / ids[3]).exists()
    assert repo.fsck().ok, repo.fsck().errors
    assert r.pruned == [] and [v.pruned for v in repo.log("side", limit=1)] == [True]


def test_parent_cycles_are_named_never_walked_for_ever(five):
    path, ids = five
    reseal_parents(path, ids[1], [ids[3]])          # 3 -> 2 -> 1 -> 3 ...; 0 is cut off
    repo = ckptrepo.open(str(path))
    for call in (lambda: repo.log(), lambda: repo.log(all=True), lambda: repo.resolve("HEAD~100"),
                 lambda: repo.load("@999"), lambda: repo.metrics(), lambda: repo.resolve("HEAD~" + "9" * 50)):
        with pytest.raises(CorruptionError, match="form a parent cycle") as info:
            within(10, call)
        assert ids[1][:12] in str(info.value) and ids[3][:12] in str(info.value)
    r = run("log", repo=str(path))
    assert r.returncode != 0 and "parent cycle" in r.stderr
    assert len(repo.log(limit=1)) == 1       # a walk that stops before the cycle lists what it reached
    report = within(30, repo.fsck)
    assert not report.ok and any("parent cycle" in e for e in report.errors)
    before = stored(path)
    with pytest.raises(CorruptionError, match="gc stopped before deleting anything: versions .* parent cycle"):
        within(30, lambda: repo.gc(grace_period_s=0))
    assert stored(path) == before


def test_a_version_that_is_its_own_parent_is_a_cycle(five):
    path, ids = five
    reseal_parents(path, ids[4], [ids[4]])
    repo = ckptrepo.open(str(path))
    with pytest.raises(CorruptionError, match="parent cycle"):
        within(10, lambda: repo.resolve("HEAD~2"))
    with pytest.raises(CorruptionError, match="parent cycle"):
        within(10, lambda: repo.load("@0"))
    assert not repo.fsck().ok


def test_a_cycle_no_ref_reaches_still_stops_gc(five):
    path, ids = five
    repo = ckptrepo.open(str(path))
    repo.checkout(ids[1], branch="old")
    repo.delete_branch("main", force=True)
    reseal_parents(path, ids[2], [ids[4]])           # 4 -> 3 -> 2 -> 4, unreachable now
    assert [v.id for v in repo.log()] == [ids[1], ids[0]]
    assert not repo.fsck().ok
    before = stored(path)
    with pytest.raises(CorruptionError, match="parent cycle"):
        repo.gc(grace_period_s=0)
    assert stored(path) == before


# ---- section 7: a gc killed midway ----------------------------------------------------------------------------

@pytest.mark.parametrize("deleted", [1, 2, 3])
def test_a_gc_killed_midway_leaves_no_kept_manifest_without_its_parent(tmp_path, monkeypatch, deleted):
    """Unreachable manifests go children first. Ids are made to sort oldest first, the order an id-ordered gc
    deleted them in: killed after one delete, it left a child whose parent was gone, an fsck error."""
    counter = iter(range(100))
    monkeypatch.setattr("ckptrepo.saving._prepare.new_version_id",
                        lambda: f"{next(counter):04x}" + "0" * 16 + f"{int(time.time() * 1000):012x}")
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    commit_steps(repo, range(2))
    repo.checkout("HEAD", branch="dropped")
    dropped = commit_steps(repo, range(2, 6))
    repo.checkout("main")
    repo.delete_branch("dropped", force=True)
    store = repo.plumbing.store
    real, count = type(store).delete, [0]

    def dies(self, key):
        if key.startswith("versions/"):
            if count[0] == deleted:
                raise OSError("killed")
            count[0] += 1
        return real(self, key)
    monkeypatch.setattr(type(store), "delete", dies)
    with pytest.raises(OSError):
        repo.gc(grace_period_s=0)
    monkeypatch.setattr(type(store), "delete", real)
    left = set(ckptrepo.open(str(path)).plumbing.all_version_ids()) & set(dropped)
    assert left == set(dropped[:len(dropped) - deleted]), "the newest go first"
    report = ckptrepo.open(str(path)).fsck()
    assert report.ok, report.errors
    assert ckptrepo.open(str(path)).gc(grace_period_s=0).collected == sorted(left)
    assert ckptrepo.open(str(path)).fsck().ok


def test_an_unreachable_version_whose_parent_is_gone_is_a_warning_that_gc_clears(five):
    """What an id-ordered gc left when killed: fsck called it damage ("parent ... is missing") though the
    next gc removes it. Now a warning that says so; a reachable version's missing parent stays an error."""
    path, ids = five
    repo = ckptrepo.open(str(path))
    repo.checkout(ids[1], branch="old")
    repo.delete_branch("main", force=True)
    (path / "versions" / ids[2]).unlink()
    report = repo.fsck()
    assert report.ok, report.errors
    assert any(ids[3][:12] in w and "interrupted gc" in w and "next `ckptrepo gc`" in w for w in report.warnings)
    r = repo.gc(grace_period_s=0)
    assert set(r.collected) == {ids[3], ids[4]} and repo.fsck().ok and not repo.fsck().warnings
    (path / "versions" / ids[0]).unlink()
    assert any(f"parent {ids[0][:12]} is missing" in e for e in repo.fsck().errors)


def test_gc_dry_run_lists_what_would_go_and_deletes_nothing(five):
    path, ids = five
    repo = ckptrepo.open(str(path))
    repo.checkout(ids[2], branch="old")
    repo.delete_branch("main", force=True)
    before = stored(path)
    r = run("gc", "--grace", "0", "--dry-run", repo=str(path))
    assert r.returncode == 0 and stored(path) == before
    for vid in ids[3:]:
        assert f"would collect {vid[:12]}" in r.stdout
    r = run("gc", "--grace", "0", "--keep-last", "1", "--dry-run", repo=str(path))
    assert f"would prune {ids[1][:12]}" in r.stdout and stored(path) == before
