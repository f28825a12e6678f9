"""Retention and garbage collection: keep exactly what the rules say, never harm kept versions or writers."""
from __future__ import annotations

import pytest
import torch
from support.helpers import assert_bit_exact, count_manifest_reads

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import RevisionError


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def state_at(step):
    return {"w": torch.full((1000,), float(step)), "step": step}


def commit(repo, steps):
    return {s: repo.snapshot(state_at(s), step=s).id for s in steps}


def test_retention_rules_keep_exactly_what_they_say(repo):
    ids = commit(repo, range(10))
    repo.tag("best", "@3")
    r = repo.gc(keep_last=2, keep_every=4, grace_period_s=0)
    kept = {repo.version(v).step for v in r.kept}
    assert kept == {9, 8, 0, 4, 3}
    assert {repo.version(v).step for v in r.pruned} == set(range(10)) - kept
    assert r.bytes_freed == 4 * 1000 * len(r.pruned)
    for s in kept:
        assert_bit_exact(state_at(s), repo.load(f"@{s}"))
    with pytest.raises(RevisionError, match="pruned by gc"):
        repo.load("@5")
    log = repo.log()
    assert [v.step for v in log] == list(range(9, -1, -1)), "history and metrics stay after pruning"
    assert {v.step for v in log if v.pruned} == set(range(10)) - kept and all(v.size == 0 for v in log if v.pruned)
    report = repo.fsck()
    assert report.ok, report.errors
    assert not any(f"data/{ids[5]}" in k for k in repo.plumbing.store.list("data/"))
    again = repo.gc(keep_last=2, keep_every=4, grace_period_s=0)
    assert again.pruned == [] and again.bytes_freed == 0


def test_without_rules_only_unreachable_objects_go_and_the_grace_period_protects_writers(repo):
    commit(repo, range(3))
    repo.checkout("@1", branch="side")
    side = repo.snapshot(state_at(100), step=100).id
    repo.checkout("main")
    # an interrupted snapshot: data and manifest written, ref never moved
    faults.set_hook("after_manifest", lambda _: (_ for _ in ()).throw(OSError("interrupted")))
    with pytest.raises(ckptrepo.CkptRepoError, match="interrupted"):
        repo.snapshot(state_at(3), step=3)
    faults.clear()
    dangling = set(repo.plumbing.all_version_ids()) - {v.id for v in repo.log(all=True)}
    assert len(dangling) == 1
    young = repo.gc()                                  # default grace: one hour
    assert young.too_young == sorted(dangling) and young.collected == [] and young.pruned == []
    assert set(repo.plumbing.all_version_ids()) >= dangling
    r = repo.gc(grace_period_s=0)
    assert r.collected == sorted(dangling) and r.pruned == []
    assert set(repo.plumbing.all_version_ids()) == {v.id for v in repo.log(all=True)}
    assert repo.version("side").id == side and len(repo.log("main")) == 3
    assert repo.fsck().ok and not repo.fsck().warnings


def test_branch_heads_and_tags_are_protected(repo):
    commit(repo, range(5))
    repo.branch("old", "@1")
    repo.tag("t", "@2")
    r = repo.gc(keep_last=1, grace_period_s=0)
    assert {repo.version(v).step for v in r.kept} == {4, 1, 2}
    assert_bit_exact(state_at(1), repo.load("old"))
    assert_bit_exact(state_at(2), repo.load("t"))


def test_dry_run_deletes_nothing(repo, tmp_path):
    commit(repo, range(4))
    before = sorted(repo.plumbing.store.list(""))
    r = repo.gc(keep_last=1, grace_period_s=0, dry_run=True)
    assert len(r.pruned) == 3 and r.dry_run
    assert sorted(repo.plumbing.store.list("")) == before


def test_cli_gc(repo):
    commit(repo, range(4))
    import contextlib
    import io
    import sys

    from ckptrepo.cli.main import main
    out = io.StringIO()
    argv = sys.argv
    try:
        sys.argv = ["ckptrepo", "--repo", repo.url, "gc", "--keep-last", "2", "--grace", "0"]
        with contextlib.redirect_stdout(out):
            main()
    finally:
        sys.argv = argv
    assert "pruned 2" in out.getvalue()
    assert [v.pruned for v in ckptrepo.open(repo.url).log()] == [False, False, True, True]


LOSSES = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0, 1.0, 8.0]   # step 3 and step 6 tie for the best


def test_keep_best_keeps_the_best_versions_by_a_metric(repo):
    """Orbax's best_fn: the N versions with the lowest loss (or highest accuracy) stay loadable; ties go to the
    newer version; the branch head is kept as always."""
    for s, loss in enumerate(LOSSES):
        repo.snapshot(state_at(s), step=s, metrics={"loss": loss, "acc": -loss, "note": "text"})
    r = repo.gc(keep_best=2, best_metric="loss", grace_period_s=0, dry_run=True)
    assert {repo.version(v).step for v in r.kept} == {6, 3, 7}
    r = repo.gc(keep_best=1, best_metric="acc", best_mode="max", grace_period_s=0)
    assert {repo.version(v).step for v in r.kept} == {6, 7}, "the newer of the tied best, and the head"
    for s in (6, 7):
        assert_bit_exact(state_at(s), repo.load(f"@{s}"))
    assert {v.step for v in repo.log() if v.pruned} == {0, 1, 2, 3, 4, 5}
    # ranked among the versions that still have data: the next best now is step 4 (loss 2)
    r = repo.gc(keep_best=2, best_metric="loss", grace_period_s=0)
    assert {repo.version(v).step for v in r.kept} == {6, 7} and r.pruned == []
    assert repo.fsck().ok


@pytest.mark.parametrize("kwargs, fragment", [
    ({"keep_best": 2, "best_metric": "los"}, "no version with data records metric 'los'; recorded: acc, loss"),
    ({"keep_best": 2}, "needs a metric"),
    ({"keep_best": 2, "best_metric": "loss", "best_mode": "lowest"}, "a mode of min or max"),
])
def test_keep_best_refuses_what_it_cannot_rank_and_deletes_nothing(repo, kwargs, fragment):
    for s, loss in enumerate(LOSSES[:3]):
        repo.snapshot(state_at(s), step=s, metrics={"loss": loss, "acc": -loss})
    before = sorted(repo.plumbing.store.list(""))
    with pytest.raises(ckptrepo.RetentionError) as info:
        repo.gc(grace_period_s=0, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert sorted(repo.plumbing.store.list("")) == before


def test_a_snapshotter_keeps_the_best_versions_in_the_background(repo):
    policy = ckptrepo.RetentionPolicy(keep_best=2, best_metric="loss", grace_period_s=0)
    with repo.snapshotter(retention=policy) as snap:
        for s, loss in enumerate(LOSSES):
            snap.snapshot(state_at(s), step=s, metrics={"loss": loss})
            snap.wait()
    # each pass ranks the versions that still have data, so the best ones so far survive every pass
    assert {v.step for v in repo.log() if not v.pruned} == {3, 6, 7}
    assert_bit_exact(state_at(3), repo.load("@3"))


def test_a_snapshotter_retention_policy_prunes_in_the_background(repo):
    policy = ckptrepo.RetentionPolicy(keep_last=2, keep_every=5, grace_period_s=0)
    with repo.snapshotter(retention=policy) as snap:
        for s in range(8):
            snap.snapshot(state_at(s), step=s)
            snap.wait()
    log = repo.log()
    assert [v.step for v in log] == list(range(7, -1, -1))
    assert {v.step for v in log if not v.pruned} == {7, 6, 5, 0}
    for s in (7, 6, 5, 0):
        assert_bit_exact(state_at(s), repo.load(f"@{s}"))
    assert repo.fsck().ok


def test_a_failing_background_retention_is_raised_at_the_next_call(repo, monkeypatch):
    def broken(self, _repo, protect_since=None, known=None, keep_also=()):
        raise ckptrepo.StorageError("disk on fire")
    monkeypatch.setattr(ckptrepo.RetentionPolicy, "apply", broken)
    snap = repo.snapshotter(retention=ckptrepo.RetentionPolicy(keep_last=1))
    snap.snapshot(state_at(0), step=0)
    with pytest.raises(ckptrepo.CkptRepoError, match="retention.*disk on fire"):
        snap.wait()
    assert [v.step for v in repo.log()] == [0], "the snapshot itself is committed"
    snap.close()


def test_background_retention_reads_each_manifest_once_over_a_long_run(repo, monkeypatch):
    """Retention after every commit looks at every version each pass; it keeps what it needs of each manifest
    between passes, so a long run does not re-read (and decode) the whole history after every snapshot."""
    from ckptrepo.core._manifest_reads import MANIFEST_CACHE_SIZE
    reads = count_manifest_reads(monkeypatch, repo.plumbing.store)
    n = 2 * MANIFEST_CACHE_SIZE + 8          # more versions than the handle keeps manifests of
    policy = ckptrepo.RetentionPolicy(keep_last=3, keep_every=10, grace_period_s=0)
    with repo.snapshotter(retention=policy) as snap:
        for s in range(n):
            snap.snapshot(state_at(s), step=s)
            snap.wait()
    assert max(reads.values(), default=0) <= 1, f"manifests read again by later passes: {reads}"
    log = repo.log()
    assert {v.step for v in log if not v.pruned} == {n - 1, n - 2, n - 3} | set(range(0, n, 10))
    assert_bit_exact(state_at(n - 3), repo.load(f"@{n - 3}"))
    assert repo.fsck().ok


def test_diff_stats_and_trajectory_know_what_gc_pruned(repo):
    """`diff` and `stats` of a pruned version say so in one line, as `load` does (they failed on TensorStore's
    missing zarr.json); `trajectory` walks past pruned versions, a delta spanning the gap."""
    for step in range(4):
        repo.snapshot({"x": torch.full((3,), float(step))}, step=step)
    repo.gc(keep_every=2, keep_tagged=False, grace_period_s=0)    # steps 1 and 3 pruned, except the head (3)
    kept = {v.step for v in repo.log() if not v.pruned}
    assert kept == {0, 2, 3}
    assert repo.version("@1").pruned and not repo.version("@2").pruned   # as log says (it said False always)
    for call in (lambda: repo.stats("@1"), lambda: repo.diff("@0", "@1")):
        with pytest.raises(RevisionError, match=r"\(step 1\) was pruned by gc"):
            call()
    assert [(p.step, p.value) for p in repo.trajectory("x")] == [(0, 0.0), (2, 2 * 3 ** 0.5), (3, 3 * 3 ** 0.5)]
    deltas = [(p.step, round(p.value, 6)) for p in repo.trajectory("x", metric="delta")]
    assert deltas == [(2, round(2 * 3 ** 0.5, 6)), (3, round(3 ** 0.5, 6))]


def _six_versions_and_a_gc_killed_after_its_markers(tmp_path, monkeypatch) -> list[str]:
    """A repository at tmp_path/r of six versions, and a gc (keep_last=3, no grace) killed after writing its
    pruned markers, before any delete; the ids, oldest first."""
    repo = ckptrepo.init(str(tmp_path / "r"))
    ids = [repo.snapshot({"w": torch.full((1000,), float(s))}, step=s).id for s in range(6)]

    def killed(prefix):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(repo.plumbing.store, "delete_prefix", killed)
    with pytest.raises(KeyboardInterrupt):
        repo.gc(keep_last=3, grace_period_s=0)
    monkeypatch.undo()
    return ids


@pytest.mark.parametrize("plain", [False, True], ids=["with rules", "plain"])
def test_a_gc_killed_after_its_markers_is_finished_by_the_next_and_leaves_no_empty_folders(tmp_path, monkeypatch,
                                                                                           plain):
    """The markers are written before any delete; the next pass skipped versions already marked, so the data a
    killed pass had not deleted yet stayed for good (and fsck found nothing to say). A plain gc (no rules: every
    reachable version kept) left it too, unloadable; fsck now says so, and any pass finishes the deletes."""
    import os
    ids = _six_versions_and_a_gc_killed_after_its_markers(tmp_path, monkeypatch)
    assert sorted(os.listdir(tmp_path / "r" / "pruned")) == sorted(ids[:3])   # marked, no data deleted yet
    repo = ckptrepo.open(str(tmp_path / "r"))
    fsck = repo.fsck()
    assert fsck.ok and any("3 version(s) marked pruned still hold data" in w and "`ckptrepo gc` finishes" in w
                           for w in fsck.warnings), fsck.warnings
    # a marker on a tagged version whose data is stored is stray or unfinished: no gc deletes that data on its
    # word (issue 27); once the tag is gone, any pass finishes the deletes
    repo.tag("keepme", ids[0])
    with pytest.raises(ckptrepo.errors.CorruptionError, match=f"gc stopped before deleting anything: pruned/{ids[0]}"):
        repo.gc(grace_period_s=0) if plain else repo.gc(keep_last=3, grace_period_s=0)
    assert not repo.fsck().ok
    repo.delete_tag("keepme")
    report = repo.gc(grace_period_s=0) if plain else repo.gc(keep_last=3, grace_period_s=0)
    assert report.pruned == [] and report.bytes_freed == 3 * 4000
    assert sorted(os.listdir(tmp_path / "r" / "data")) == sorted(ids[3:])    # and no empty folders left
    assert all(repo.load(v)["w"][0] == s for s, v in enumerate(ids) if s >= 3)


@pytest.mark.parametrize("replacement", ["folder", "broken link"])
def test_a_folder_in_place_of_heads_branch_ref_stops_gc(tmp_path, replacement):
    """The branch's ref gone, its whole history looked unreachable: gc collected it and fsck said ok (a
    broken symbolic link, say to refs kept on a volume that is not mounted, reads as no ref at all)."""
    import os
    repo = ckptrepo.init(str(tmp_path / "r"))
    ids = [repo.snapshot({"w": torch.full((10,), float(s))}, step=s).id for s in range(3)]
    ref = tmp_path / "r" / "refs" / "heads" / "main"
    ref.unlink()
    if replacement == "folder":
        ref.mkdir()
    else:
        ref.symlink_to(tmp_path / "elsewhere" / "main")
    with pytest.raises(ckptrepo.errors.CorruptionError, match="gc stopped before deleting anything: HEAD is on "
                                                             "branch 'main', whose ref is replaced by a folder"):
        ckptrepo.open(str(tmp_path / "r")).gc(grace_period_s=0)
    assert sorted(os.listdir(tmp_path / "r" / "versions")) == sorted(ids)
    assert [e for e in ckptrepo.open(str(tmp_path / "r")).fsck().errors if "replaced by a folder" in e]
    with pytest.raises(ckptrepo.errors.CorruptionError, match="replaced by a folder or a broken link"):
        ckptrepo.open(str(tmp_path / "r")).log()   # was "no versions yet"


def test_a_load_or_fsck_that_races_a_pruning_gc_says_pruned_not_corrupt(tmp_path, monkeypatch):
    """An eval process loading a version while training's retention prunes it was told the repository is
    corrupt ("run ckptrepo fsck"), and an fsck running beside a pruning gc reported damage and exited 1; an fsck
    right after said ok. The gc runs between each one's check of the pruned/ marker and its reads."""
    import ckptrepo.loading._device_load as reader  # Repository.load calls read_tensors_to from here
    import ckptrepo.maintenance._fsck as fsck_module
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    for i in range(3):
        repo.snapshot({"w": torch.full((1000,), float(i))}, step=i)
    real_read, real_check = reader.read_tensors_to, fsck_module._check_version_data

    def read_after_gc(*args, **kwargs):
        ckptrepo.open(url).gc(keep_last=1, grace_period_s=0)   # another process
        return real_read(*args, **kwargs)
    monkeypatch.setattr(reader, "read_tensors_to", read_after_gc)
    with pytest.raises(ckptrepo.errors.RevisionError, match=r"\(step 1\) was pruned by gc"):
        ckptrepo.open(url).load("@1")
    monkeypatch.setattr(reader, "read_tensors_to", real_read)
    repo.snapshot({"w": torch.full((1000,), 3.0)}, step=3)
    repo.snapshot({"w": torch.full((1000,), 4.0)}, step=4)
    ran = []

    def check_after_gc(*args, **kwargs):
        if not ran:
            ran.append(ckptrepo.open(url).gc(keep_last=1, grace_period_s=0))
        return real_check(*args, **kwargs)
    monkeypatch.setattr(fsck_module, "_check_version_data", check_after_gc)
    report = ckptrepo.open(url).fsck()
    assert ran and ran[0].pruned and report.ok, report.errors


def test_gc_frees_space_on_a_full_disk(tmp_path, monkeypatch):
    """gc writes a pruned/ marker before it deletes a version's data; the marker held a timestamp, which a full
    disk refused (RESOURCE_EXHAUSTED), so gc, what a user runs to free space, freed nothing. The marker is empty
    now: a file system with no free block still takes an empty file (checked on a full tmpfs)."""
    from ckptrepo.errors import StorageError
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    for step in range(3):
        repo.snapshot({"w": torch.full((1000,), float(step))}, step=step)
    repo = ckptrepo.open(url)
    real_put = repo.plumbing.store.put

    def full_disk_put(key, value):
        if len(value):
            raise StorageError(f"writing {key} failed: RESOURCE_EXHAUSTED: No space left on device")
        return real_put(key, value)
    monkeypatch.setattr(repo.plumbing.store, "put", full_disk_put)
    report = repo.gc(keep_last=1, grace_period_s=0)
    assert len(report.pruned) == 2 and report.bytes_freed > 0
    assert [v.pruned for v in ckptrepo.open(url).log()] == [False, True, True]


def test_a_pruned_version_whose_array_newer_versions_share_is_no_interrupted_gc(repo):
    """Dedup: unchanged tensors point into the array of the version that wrote them, which stays when that
    version is pruned. fsck warned for ever that "a gc was interrupted" about such a version, and gc refused
    to run once a tag named it ("marks ... as pruned, but its data is still stored")."""
    frozen = torch.randn(5000)
    with repo.snapshotter() as snap:
        for s in range(3):
            snap.snapshot({"frozen": frozen, "x": torch.full((100,), float(s))}, step=s)
            snap.wait()
    first = repo.resolve("@0")
    r = repo.gc(keep_last=1, grace_period_s=0)
    assert first in r.pruned and repo.plumbing.store.list(f"data/{first}/"), "the shared array stays"
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)
    repo.tag("start", first)   # a tag on a pruned version does not bring its data back; nor is it damage
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)
    again = repo.gc(keep_last=1, grace_period_s=0)
    assert again.pruned == [] and again.bytes_freed == 0
    assert_bit_exact({"frozen": frozen, "x": torch.full((100,), 2.0)}, repo.load("HEAD"))


def test_fsck_tells_an_interrupted_gc_from_a_pruned_version_whose_array_is_shared(repo, monkeypatch):
    """Both leave a pruned version with data stored: only the array no other version uses is an interrupted
    gc's leftover, which fsck names and the next gc deletes."""
    frozen = torch.randn(5000)
    with repo.snapshotter() as snap:
        for s in range(3):   # steps 1 and 2 point into step 0's array for "frozen"
            snap.snapshot({"frozen": frozen, "x": torch.full((100,), float(s))}, step=s)
            snap.wait()
    ids = [repo.resolve(f"@{s}") for s in range(3)]

    def killed(prefix):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(repo.plumbing.store, "delete_prefix", killed)
    with pytest.raises(KeyboardInterrupt):
        repo.gc(keep_last=1, grace_period_s=0)   # marks steps 0 and 1 pruned, deletes nothing
    monkeypatch.undo()
    repo = ckptrepo.open(repo.url)
    warned = [w for w in repo.fsck().warnings if "a gc was interrupted" in w]
    # step 0's array holds the "frozen" that the kept step 2 uses; step 1's holds only its own "x"
    assert len(warned) == 1 and warned[0].startswith(f"1 version(s) marked pruned still hold data ({ids[1][:12]})")
    r = repo.gc(keep_last=1, grace_period_s=0)
    assert r.pruned == [] and r.bytes_freed == 400
    assert not repo.plumbing.store.list(f"data/{ids[1]}/") and repo.plumbing.store.list(f"data/{ids[0]}/")
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)
    assert_bit_exact({"frozen": frozen, "x": torch.full((100,), 2.0)}, repo.load("HEAD"))


def test_a_dry_runs_list_adds_up_to_what_it_would_free_and_a_real_pass_lists_nothing(tmp_path, monkeypatch):
    """The list covers every byte of "would free": pruned versions, leftover data and versions a killed pass
    marked but did not empty. Only a dry run lists: a pass that deletes may rescue a version it would list
    (committed meanwhile), and ``gc --json`` must not show a kept version among what went."""
    import os
    import shutil

    from ckptrepo.core import new_version_id
    ids = _six_versions_and_a_gc_killed_after_its_markers(tmp_path, monkeypatch)
    leftover = new_version_id()
    shutil.copytree(tmp_path / "r" / "data" / ids[5], tmp_path / "r" / "data" / leftover)
    repo = ckptrepo.open(str(tmp_path / "r"))
    dry = repo.gc(keep_last=2, grace_period_s=0, dry_run=True)
    assert dry.pruned == [ids[3]] and dry.orphan_data == [leftover]
    assert set(dry.details) == {*ids[:4], leftover}
    assert sum(d["stored_bytes"] for d in dry.details.values()) == dry.stored_bytes_freed > 4 * 4000
    from click.testing import CliRunner

    from ckptrepo.cli.main import cli
    res = CliRunner().invoke(cli, ["--repo", repo.url, "gc", "--keep-last", "2", "--grace", "0", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert sum(line.startswith("would finish pruning") for line in res.output.splitlines()) == 3, res.output
    done = repo.gc(keep_last=2, grace_period_s=0)
    assert done.stored_bytes_freed == dry.stored_bytes_freed and done.details == {}
    assert sorted(os.listdir(tmp_path / "r" / "data")) == sorted(ids[4:])
