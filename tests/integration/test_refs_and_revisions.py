"""Revisions, branches, tags, checkout (rollback) and detached HEAD, as a git user expects."""
from __future__ import annotations

import pytest
import torch

import ckptrepo
from ckptrepo.errors import DetachedHeadError, RefError, RevisionError


def commit_steps(repo, steps):
    ids = []
    for s in steps:
        ids.append(repo.snapshot({"w": torch.full((2,), float(s))}, step=s, message=f"step {s}").id)
    return ids


def test_revision_forms(repo):
    ids = commit_steps(repo, range(5))
    assert repo.resolve("HEAD") == ids[4]
    assert repo.resolve("main") == ids[4]
    assert repo.resolve("HEAD~1") == ids[3] and repo.resolve("HEAD~~") == ids[2] and repo.resolve("main~4") == ids[0]
    assert repo.resolve("@2") == ids[2] and repo.resolve("@3~1") == ids[2]
    assert repo.resolve(ids[1]) == ids[1] and repo.resolve(ids[1][:8]) == ids[1]
    repo.tag("best", "@1")
    assert repo.resolve("best") == ids[1] and repo.resolve("best~1") == ids[0]
    assert [v.step for v in repo.log()] == [4, 3, 2, 1, 0]
    assert [v.step for v in repo.log(since=1, until=3)] == [3, 2, 1]
    assert [v.step for v in repo.log(limit=2, since=2)] == [4, 3]
    assert repo.load("@2")["w"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("rev, fragment", [
    ("nope", "unknown revision 'nope'"),
    ("@99", "no version with step 99"),
    ("@x", "step number"),
    ("HEAD~9", "has only 4 ancestors"),
    ("abcd0000", "unknown revision"),
    ("abc", "an id prefix needs at least 4 digits"),
    ("main/", "unknown revision 'main/'"),            # these three were raw storage errors ("Invalid key")
    ("./exp", "unknown revision './exp'"),
    ("../tags/v1~2", "unknown revision '../tags/v1~2'"),
])
def test_bad_revisions_are_one_line_errors(repo, rev, fragment):
    commit_steps(repo, range(5))
    with pytest.raises(RevisionError) as info:
        repo.resolve(rev)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_an_upper_case_id_prefix_names_its_version(repo):
    commit_steps(repo, range(2))
    vid = repo.plumbing.head_version()
    assert repo.resolve(vid[:8].upper()) == vid and repo.resolve(vid.upper() + "~1") == repo.log()[1].id


def test_ambiguous_prefix(repo, monkeypatch):
    fake = iter(["abcd" + "0" * 27 + str(i) for i in range(3)])
    monkeypatch.setattr("ckptrepo.saving._prepare.new_version_id", lambda: next(fake))
    commit_steps(repo, range(3))
    with pytest.raises(RevisionError, match="'abcd' is ambiguous: 3 versions"):
        repo.resolve("abcd")
    assert repo.resolve("abcd" + "0" * 27 + "1") == "abcd" + "0" * 27 + "1"


def test_empty_repository(repo):
    assert repo.log() == []
    with pytest.raises(RevisionError, match="no versions yet"):
        repo.load("HEAD")
    with pytest.raises(RevisionError, match="branch 'main' has no versions yet; take a snapshot first"):
        repo.checkout("main")       # the branch HEAD is on, before its first version: not "unknown revision"
    with pytest.raises(RevisionError, match="unknown revision 'other'"):
        repo.checkout("other")


def test_rollback_branches_and_keeps_history(repo):
    ids = commit_steps(repo, range(6))
    v = repo.checkout("@3", branch="retry")
    assert v.id == ids[3] and repo.current_branch() == "retry"
    new = repo.snapshot({"w": torch.zeros(2)}, step=4, message="retry step 4")
    assert new.parents == (ids[3],)
    assert [x.step for x in repo.log()] == [4, 3, 2, 1, 0]
    assert [x.id for x in repo.log("main")] == ids[::-1], "versions after the rollback stay reachable from main"
    assert len(repo.log(all=True)) == 7
    assert repo.resolve("@4") == new.id  # @STEP searches the current branch
    repo.checkout("main")
    assert repo.current_branch() == "main" and repo.resolve("@4") == ids[4]
    repo.checkout(" retry ")   # read as resolve reads it: onto the branch, not detached at its tip
    assert repo.current_branch() == "retry"


def test_detached_head_refuses_snapshots(repo):
    ids = commit_steps(repo, range(3))
    repo.checkout("@1")
    assert repo.current_branch() is None and repo.resolve("HEAD") == ids[1]
    with pytest.raises(DetachedHeadError, match="create a branch"):
        repo.snapshot({"w": torch.zeros(1)}, step=9)
    assert [v.id for v in repo.log("main")] == ids[::-1]


def test_branch_and_tag_rules(repo):
    commit_steps(repo, range(2))
    repo.branch("exp", "@0")
    assert repo.branches()["exp"] == repo.resolve("@0")
    assert repo.current_branch() == "main"
    with pytest.raises(RefError, match="already exists"):
        repo.branch("exp")
    repo.tag("v1")
    with pytest.raises(RefError, match="already exists.*tag -f"):
        repo.tag("v1", "@0")
    for bad in ("-x", "a b", "x~1", "HEAD", "a..b", "@5"):
        with pytest.raises(RefError, match="invalid"):
            repo.tag(bad)
    assert set(repo.tags()) == {"v1"}


def test_init_and_open_errors(tmp_path):
    url = str(tmp_path / "r")
    with pytest.raises(ckptrepo.NotARepositoryError, match="ckptrepo init"):
        ckptrepo.open(url)
    ckptrepo.init(url)
    with pytest.raises(ckptrepo.RepositoryExistsError, match="exist_ok"):
        ckptrepo.init(url)
    assert ckptrepo.init(url, exist_ok=True).log() == []


def test_unknown_format_version_is_refused(tmp_path):
    url = tmp_path / "r"
    ckptrepo.init(str(url))
    cfg = (url / "ckptrepo.json").read_text().replace('"format_version": 2', '"format_version": 99')
    (url / "ckptrepo.json").write_text(cfg)
    with pytest.raises(ckptrepo.FormatVersionError, match="format 99.*upgrade"):
        ckptrepo.open(str(url))


@pytest.mark.parametrize("text", ["[1, 2]", "null", "3", '"x"'])
def test_a_config_of_json_that_is_not_an_object_is_named_as_damaged(tmp_path, text):
    """It raised AttributeError ('list' object has no attribute 'get'), a traceback's words in the CLI."""
    url = tmp_path / "r"
    ckptrepo.init(str(url))
    (url / "ckptrepo.json").write_text(text)
    with pytest.raises(ckptrepo.errors.CorruptionError, match="ckptrepo.json is not a ckptrepo config"):
        ckptrepo.open(str(url))


def test_log_of_a_long_history_reads_only_the_headers_it_lists(repo, monkeypatch):
    """`log -n N` stops after N versions, as `git log -n` does, and history walks never build a manifest's
    tensor table or tree: a run that snapshots every step has thousands of versions with big manifests."""
    from support.helpers import count_manifest_reads

    import ckptrepo.core.schema
    state = {f"layer{i}": torch.zeros(3) for i in range(50)}
    ids = []
    for step in range(20):
        state["layer0"].fill_(step)
        ids.append(repo.snapshot(state, step=step).id)
    repo.checkout("@7", branch="side")
    side = [repo.snapshot(state, step=s).id for s in (8, 9)]

    reads = count_manifest_reads(monkeypatch, repo.plumbing.store)
    monkeypatch.setattr(ckptrepo.core.schema, "unseal",
                        lambda *a: pytest.fail("a history walk decoded a whole manifest"))
    fresh = ckptrepo.open(repo.url)
    assert [v.id for v in fresh.log(limit=3)] == side[::-1] + [ids[7]]
    assert sum(reads.values()) <= 4, reads
    assert [v.id for v in fresh.log("main")] == ids[::-1]
    assert [v.id for v in fresh.log(all=True)] == side[::-1] + ids[::-1]
    assert [v.step for v in fresh.log("main", since=5, until=8)] == [8, 7, 6, 5]
    assert fresh.resolve("@3") == ids[3] and fresh.resolve("side~2") == ids[7]


def test_whole_history_passes_on_s3_read_manifests_in_batches(s3_url, monkeypatch):
    """On an object store every read is a round trip (~20-50 ms on S3): a long `log`, gc, fsck and du ask for
    the manifests they are about to need together, not one request per version, and still get them all right."""
    import collections

    from support.helpers import count_manifest_reads
    repo = ckptrepo.init(s3_url)
    ids = [repo.snapshot({"w": torch.full((4,), float(s))}, step=s).id for s in range(70)]
    calls: collections.Counter = collections.Counter()
    count_manifest_reads(monkeypatch, repo.plumbing.store, calls)
    fresh = ckptrepo.open(s3_url)
    assert [v.id for v in fresh.log()] == ids[::-1]
    assert calls["get"] == 0 and calls["get_many"] == 2 and calls["batched"] == 70, calls
    calls.clear()
    assert [v.step for v in ckptrepo.open(s3_url).log(limit=5)] == [69, 68, 67, 66, 65]
    assert calls["get"] == 5 and calls["get_many"] == 0, calls   # short: no listing, the 5 it needs
    # first-parent walks (@STEP, HEAD~N, metrics) read a few headers alone, then in batches once they prove long
    from ckptrepo.core._manifest_reads import WALK_SINGLE_READS
    long = (WALK_SINGLE_READS, 1)   # the first headers alone, then the rest in one batch
    for run, (singles, batches) in ((lambda r: r.resolve("@0") == ids[0], long),
                                    (lambda r: r.resolve("HEAD~69") == ids[0], long),
                                    (lambda r: [row["step"] for row in r.metrics()] == list(range(70)), long),
                                    (lambda r: r.resolve("HEAD~3") == ids[66], (3, 0))):   # short: nothing listed
        calls.clear()
        assert run(ckptrepo.open(s3_url))
        assert (calls["get"], calls["get_many"]) == (singles, batches), calls

    def fsck_sized(r: ckptrepo.Repository) -> bool:
        """fsck as the CLI runs it: told its total (the progress bar's size) from the manifests it reads anyway."""
        totals: list[int] = []
        report = r.fsck(on_total=totals.append)
        return report.ok and totals == [report.bytes] and report.bytes >= 70 * 16
    for run, batches in ((lambda r: r.fsck().ok, 2), (lambda r: r.gc(keep_last=10, dry_run=True).pruned, 2),
                         (lambda r: r.du().total_bytes, 4),    # du: its log --all, then the manifests
                         (fsck_sized, 2)):
        calls.clear()
        assert run(ckptrepo.open(s3_url))
        assert calls["get"] == 0 and calls["get_many"] == batches and calls["batched"] == 70 * batches // 2, calls


def test_deleting_a_branch_guards_its_versions_and_gc_then_collects_them(repo):
    """`branch -d` (git's): never the checked-out branch; a branch whose tip no other ref reaches only with
    force; once it is gone, gc deletes the versions only it held and nothing else."""
    base, main_tip = commit_steps(repo, [1, 2])
    repo.checkout(base, branch="exp")
    exp_tip = repo.snapshot({"w": torch.full((2,), 5.0)}, step=3).id
    with pytest.raises(RefError, match="'exp' is checked out"):
        repo.delete_branch("exp")
    repo.checkout("main")
    with pytest.raises(RefError, match="gc would delete the versions only it holds"):
        repo.delete_branch("exp")
    repo.branch("side", "exp")                       # another ref reaches the tip: plain -d is allowed
    assert repo.delete_branch("exp") == exp_tip
    with pytest.raises(RefError, match="no branch named 'exp'"):
        repo.delete_branch("exp")
    assert repo.delete_branch("side", force=True) == exp_tip
    assert set(repo.branches()) == {"main"}
    report = repo.gc(grace_period_s=0)
    assert report.collected == [exp_tip] and report.bytes_freed > 0, report
    assert {v.id for v in repo.log(all=True)} == {base, main_tip}
    assert (torch.equal(repo.load("main")["w"], torch.full((2,), 2.0))
            and torch.equal(repo.load(base)["w"], torch.ones(2)))


def test_deleting_a_tag_and_a_branch_that_moved_meanwhile(repo, monkeypatch):
    from ckptrepo.core._manifest import HEADS_PREFIX
    from ckptrepo.errors import ConflictError

    first, second = commit_steps(repo, [1, 2])
    repo.tag("best", first)
    assert repo.delete_tag("best") == first and repo.tags() == {}
    with pytest.raises(RefError, match="no tag named 'best'"):
        repo.delete_tag("best")
    # a snapshot lands on the branch between the read of its tip and the delete: the delete must not win
    repo.branch("exp", first)
    store = repo.plumbing.store
    read = store.get_with_generation

    def read_then_move(key, *args):
        got = read(key, *args)
        if key == HEADS_PREFIX + "exp":
            store.put(key, second.encode())
        return got

    monkeypatch.setattr(store, "get_with_generation", read_then_move)
    with pytest.raises(ConflictError, match="moved while it was being deleted"):
        repo.delete_branch("exp")
    monkeypatch.undo()
    assert repo.branches()["exp"] == second


def test_a_ref_name_cannot_also_be_a_folder_of_refs(repo):
    """git's rule; a local store made `a` beside `a/b` a raw storage error, and kept `a/` after `a/b` was deleted."""
    commit_steps(repo, [1])
    repo.branch("a/b")
    with pytest.raises(RefError, match="cannot create branch 'a': branch 'a/b' exists"):
        repo.branch("a")
    with pytest.raises(RefError, match="cannot create branch 'a/b/c': branch 'a/b' exists"):
        repo.checkout("HEAD", branch="a/b/c")
    repo.delete_branch("a/b", force=True)
    repo.branch("a")                      # the folder a/b left behind is gone with it
    repo.tag("x/y")
    with pytest.raises(RefError, match="a tag and a folder of tags"):
        repo.tag("x")
    assert set(repo.branches()) == {"main", "a"} and set(repo.tags()) == {"x/y"}


def test_a_ref_cannot_shadow_another_ref_or_a_version_id(repo):
    """A tag named like a branch could never be named (revisions resolve branches first), and a branch named
    like the start of a version id hid that version from revisions; git only warns, we refuse."""
    vid = commit_steps(repo, [1])[0]
    repo.tag("v1")
    with pytest.raises(RefError, match="a branch of that name exists"):
        repo.tag("main")
    with pytest.raises(RefError, match="a tag of that name exists"):
        repo.branch("v1")
    with pytest.raises(RefError, match="the start of a version id"):
        repo.branch(vid[:6])
    assert repo.resolve(vid[:6]) == vid and set(repo.branches()) == {"main"} and set(repo.tags()) == {"v1"}


def test_a_ref_write_whose_reply_was_lost_counts_as_done(repo, monkeypatch):
    """An object store retries a conditional write whose reply was lost, finds the ref changed by that very
    write and reports the condition as failed: the committed version was called a conflict, and a snapshotter
    kept the old generation, so every later snapshot failed too. Tags, branches and deletes likewise."""
    swap = type(repo.plumbing.store).compare_and_swap

    def reply_lost(self, key, value, expected):
        swap(self, key, value, expected)   # the write lands ...
        return None                         # ... and the retry reports the condition as failed
    ids = commit_steps(repo, range(1))
    monkeypatch.setattr(type(repo.plumbing.store), "compare_and_swap", reply_lost)
    with repo.snapshotter() as snap:
        for step in (1, 2, 3):
            snap.snapshot({"w": torch.full((3,), float(step))}, step=step)
        snap.wait()
    repo.tag("best", ids[0])
    repo.branch("exp", ids[0])
    repo.delete_branch("exp", force=True)
    monkeypatch.undo()
    assert [v.step for v in repo.log()] == [3, 2, 1, 0]
    assert repo.resolve("best") == ids[0] and "exp" not in repo.branches() and repo.fsck().ok
