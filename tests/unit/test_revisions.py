"""Revision syntax (``ckptrepo.core._revisions``): every form a user may type, and every way it can fail.

Resolution runs against a small in-memory RevisionSource whose ids are chosen by hand, so that ambiguous
prefixes and exact ancestor counts can be set up directly; a few tests then check the same rules through a
real ``memory://`` repository (``@STEP`` follows the current branch, stray spaces, ``checkout`` of a padded
branch name). Every failure must be a RevisionError of one line that tells the user what to do next.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
import torch

import ckptrepo
from ckptrepo import RevisionError
from ckptrepo.core._revisions import parse, resolve

A0 = "a0" + "0" * 30          # root
A1 = "a1b2" + "1" * 28        # shares the prefix "a1b2" with A2
A2 = "a1b2" + "2" * 28
B1 = "b1" + "3" * 30
C1 = "c0ffee" + "4" * 26


@dataclass
class FakeSource:
    """A RevisionSource: versions as ``id -> (parent, step)``, refs as dicts, HEAD as a branch or a version."""

    versions: dict[str, tuple[str | None, int | None]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    head_branch: str | None = "main"
    detached: str | None = None
    pruned: set[str] = field(default_factory=set)

    def head_version(self) -> str | None:
        return self.branches.get(self.head_branch) if self.head_branch else self.detached

    def head_description(self) -> str:
        return f"branch {self.head_branch!r}" if self.head_branch else f"detached HEAD {str(self.detached)[:12]}"

    def branch_tip(self, name: str) -> str | None:
        return self.branches.get(name)

    def tag_target(self, name: str) -> str | None:
        return self.tags.get(name)

    def ids_with_prefix(self, prefix: str) -> list[str]:
        return sorted(v for v in self.versions if v.startswith(prefix))

    def first_parent(self, version: str) -> str | None:
        return self.versions[version][0]

    def step_of(self, version: str) -> int | None:
        return self.versions[version][1]

    def is_pruned(self, version: str) -> bool:
        return version in self.pruned


@pytest.fixture
def src() -> FakeSource:
    """main: A0 (step 10) <- A1 (20) <- A2 (30); dev: A0 <- B1 (20); C1 (step 20) a lone root; tag v1 -> A1."""
    return FakeSource(
        versions={A0: (None, 10), A1: (A0, 20), A2: (A1, 30), B1: (A0, 20), C1: (None, None)},
        branches={"main": A2, "dev": B1}, tags={"v1": A1, "lone": C1})


def one_line_error(src: FakeSource, rev: str) -> str:
    """Resolve ``rev``, expecting a RevisionError; its message, checked to be one line."""
    with pytest.raises(RevisionError) as info:
        resolve(src, rev)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


# ---- parse ---------------------------------------------------------------------

@pytest.mark.parametrize("rev, expected", [
    ("HEAD", ("HEAD", 0)), ("main", ("main", 0)), ("HEAD~", ("HEAD", 1)), ("HEAD~3", ("HEAD", 3)),
    ("main~~", ("main", 2)), ("main~2~3", ("main", 5)), ("v1~0", ("v1", 0)), ("@100~1", ("@100", 1)),
    ("  dev~2  ", ("dev", 2)), ("a1b2", ("a1b2", 0)), ("feature/x~1", ("feature/x", 1)),
])
def test_parse_splits_base_and_generations(rev: str, expected: tuple[str, int]) -> None:
    """``~`` alone is one generation, ``~N`` is N, several add up; surrounding spaces are dropped."""
    assert parse(rev) == expected


@pytest.mark.parametrize("rev", ["", "   ", "\t\n"])
def test_parse_refuses_an_empty_revision(rev: str) -> None:
    """An empty (or all-space) revision is refused with the list of forms to use."""
    with pytest.raises(RevisionError, match=r"^empty or malformed revision '';.*use HEAD, a branch, a tag"):
        parse(rev)


# ---- every form ----------------------------------------------------------------

@pytest.mark.parametrize("rev, expected", [
    ("HEAD", A2), ("main", A2), ("dev", B1), ("v1", A1), ("lone", C1),
    (A1, A1), (A0, A0), ("a0" + "0" * 10, A0), ("b1" + "33", B1), ("c0ff", C1), ("C0FFEE", C1),
    ("HEAD~", A1), ("HEAD~2", A0), ("main~1~1", A0), ("dev~1", A0), ("v1~1", A0), ("c0ffee~0", C1),
    ("@30", A2), ("@20", A1), ("@10", A0), ("@20~1", A0), ("@30~2", A0),
    (" main ", A2), ("\tv1~1\n", A0), (" @20 ", A1),
])
def test_every_revision_form_resolves(src: FakeSource, rev: str, expected: str) -> None:
    """HEAD, branches, tags, full ids, unique 4+ digit prefixes (any case), ``~N`` and ``@STEP`` on HEAD's branch."""
    assert resolve(src, rev) == expected


def test_a_branch_wins_over_a_tag_and_a_prefix(src: FakeSource) -> None:
    """A name that is both a branch and a tag names the branch; a branch named like an id prefix wins too."""
    src.tags["dev"] = A0
    src.branches["c0ffee"] = A0
    assert resolve(src, "dev") == B1
    assert resolve(src, "c0ffee") == A0


def test_at_step_follows_the_current_branch_and_takes_the_newest(src: FakeSource) -> None:
    """``@20`` is A1 on main, B1 on dev, and on a detached HEAD it walks from that version; a step saved twice
    on one line (a resumed run) names the newer version."""
    assert resolve(src, "@20") == A1
    src.head_branch = "dev"
    assert resolve(src, "@20") == B1 and resolve(src, "@10") == A0
    src.head_branch, src.detached = None, A1
    assert resolve(src, "@20") == A1 and resolve(src, "HEAD") == A1
    a3 = "a3" + "5" * 30
    src.versions[a3] = (A2, 20)
    src.head_branch, src.branches["main"] = "main", a3
    assert resolve(src, "@20") == a3 and resolve(src, "@20~2") == A1


def test_at_step_prefers_a_kept_version_to_a_newer_pruned_one(src: FakeSource) -> None:
    """A step saved twice on one line, the newer one pruned by retention: ``@20`` names the kept one, whose data
    still loads; when both are pruned it names the newer, and the load says it was pruned."""
    a3 = "a3" + "5" * 30
    src.versions[a3] = (A2, 20)
    src.branches["main"] = a3
    src.pruned.add(a3)
    assert resolve(src, "@20") == A1
    src.pruned.add(A1)
    assert resolve(src, "@20") == a3


# ---- failures --------------------------------------------------------------------

def test_an_ambiguous_prefix_names_the_candidates(src: FakeSource) -> None:
    """Two versions start with ``a1b2``: the error says how many, shows their short ids, and asks for more digits."""
    msg = one_line_error(src, "a1b2")
    assert msg.startswith("revision 'a1b2' is ambiguous: 2 versions start with it (")
    assert A1[:12] in msg and A2[:12] in msg and msg.endswith("type more digits")
    assert resolve(src, "a1b21") == A1 and resolve(src, "a1b22") == A2
    msg = one_line_error(src, "A1B2~1")          # upper case and with ~N: ambiguous likewise
    assert "is ambiguous" in msg and "'A1B2'" in msg


@pytest.mark.parametrize("rev", ["a", "a0", "a0a", "C0F"])
def test_a_prefix_shorter_than_four_digits_is_refused_with_a_hint(src: FakeSource, rev: str) -> None:
    """1-3 hex digits never resolve, even when unique, and the error says that a prefix needs 4 digits."""
    msg = one_line_error(src, rev)
    assert msg == (f"unknown revision {rev!r} (an id prefix needs at least 4 digits): not a branch, tag, version "
                   f"id or @STEP; see `ckptrepo log`")


@pytest.mark.parametrize("rev", ["nosuch", "dead", "f" * 32, "a" * 33, "main/", "../tags/v1", "HEAD ~1", "~1",
                                 "main~x", "ma in"])
def test_unknown_names_say_where_to_look(src: FakeSource, rev: str) -> None:
    """Unknown names, unknown or over-long ids, names that cannot be refs and stray inner spaces are all one
    "unknown revision" line pointing at ``ckptrepo log``."""
    msg = one_line_error(src, rev)
    assert msg.startswith("unknown revision ") and msg.endswith("not a branch, tag, version id or @STEP; "
                                                                  "see `ckptrepo log`")


@pytest.mark.parametrize("rev, base, back, ancestors", [
    ("HEAD~3", "HEAD", 3, 2), ("main~2~2", "main", 4, 2), ("dev~2", "dev", 2, 1), ("lone~", "lone", 1, 0),
    ("@20~5", "@20", 5, 1),
])
def test_going_back_past_the_root(src: FakeSource, rev: str, base: str, back: int, ancestors: int) -> None:
    """``~N`` past the root says how many versions the history holds, which ``~N`` reach them, and where to
    look."""
    count = f"{ancestors + 1} version{'s' if ancestors else ''}"
    what = f"name {base}" if ancestors == 0 else f"name one of {base} to {base}~{ancestors}"
    assert one_line_error(src, rev) == (f"{rev!r} goes back {back} versions but {base!r} has only {ancestors} "
                                        f"ancestors ({count} in its history): {what}, or see `ckptrepo log`")


def test_at_step_failures(src: FakeSource) -> None:
    """A step not on the current branch names the branch (C1's step is on no branch's line); a non-number after
    '@' shows the form to use."""
    assert one_line_error(src, "@40") == "no version with step 40 on branch 'main'; see `ckptrepo log`"
    src.head_branch = "dev"
    assert one_line_error(src, "@30") == "no version with step 30 on branch 'dev'; see `ckptrepo log`"
    for rev in ("@", "@abc", "@1.5"):
        assert one_line_error(src, rev) == f"{rev!r}: after '@' comes a step number, e.g. @1000"


def test_an_empty_branch_says_to_snapshot_first() -> None:
    """On a branch without versions, HEAD, the branch by name and ``@STEP`` all say to take a snapshot first."""
    src = FakeSource(head_branch="main")
    assert one_line_error(src, "HEAD") == "HEAD (branch 'main') has no versions yet; take a snapshot first"
    assert one_line_error(src, "HEAD~1") == "HEAD (branch 'main') has no versions yet; take a snapshot first"
    assert one_line_error(src, "main") == "branch 'main' has no versions yet; take a snapshot first"
    assert one_line_error(src, "@0") == "no version with step 0 on branch 'main'; see `ckptrepo log`"
    assert one_line_error(src, "other").startswith("unknown revision 'other':")


def test_every_revision_error_is_a_ckptrepo_error(src: FakeSource) -> None:
    """Callers catch CkptRepoError for every library failure: RevisionError must be one."""
    with pytest.raises(ckptrepo.CkptRepoError):
        resolve(src, "nosuch")


# ---- through a repository --------------------------------------------------------

@pytest.fixture
def mem_repo() -> ckptrepo.Repository:
    return ckptrepo.init(f"memory://{uuid.uuid4().hex}")


def test_repository_at_step_is_relative_to_the_checked_out_branch(mem_repo: ckptrepo.Repository) -> None:
    """The same step on two branches: ``@2`` follows whichever branch is checked out, and ``checkout`` of a
    branch name with stray spaces attaches HEAD to that branch instead of detaching."""
    repo = mem_repo
    ids = [repo.snapshot({"w": torch.full((3,), float(s))}, step=s).id for s in (1, 2, 3)]
    repo.checkout("@1", branch="fix")
    fix2 = repo.snapshot({"w": torch.full((3,), -2.0)}, step=2).id
    assert repo.current_branch() == "fix" and repo.resolve("@2") == fix2 and repo.resolve("@2~1") == ids[0]
    repo.checkout("  main ")
    assert repo.current_branch() == "main"
    assert repo.resolve("@2") == ids[1] and repo.resolve(" HEAD~2 ") == ids[0]
    assert repo.resolve(ids[2].upper()) == ids[2] and repo.resolve(ids[0][:16]) == ids[0]
    with pytest.raises(RevisionError, match=r"^'HEAD~3' goes back 3 versions but 'HEAD' has only 2 ancestors"):
        repo.resolve("HEAD~3")
    with pytest.raises(RevisionError, match=r"^no version with step 9 on branch 'main'"):
        repo.resolve("@9")


def test_repository_at_step_names_the_kept_version_of_a_step_saved_twice(mem_repo: ckptrepo.Repository) -> None:
    """A resumed run saves step 2 again; retention prunes that newer copy: ``@2`` loads the kept one."""
    repo = mem_repo
    ids = [repo.snapshot({"w": torch.full((3,), float(s))}, step=s).id for s in (1, 2)]
    again = repo.snapshot({"w": torch.full((3,), 20.0)}, step=2).id
    repo.snapshot({"w": torch.full((3,), 3.0)}, step=3)
    repo.prune(again)
    assert repo.resolve("@2") == ids[1]
    assert torch.equal(repo.load("@2")["w"], torch.full((3,), 2.0))


def test_repository_empty_and_unknown_revisions(mem_repo: ckptrepo.Repository) -> None:
    """A fresh repository: HEAD and ``main`` say to snapshot first; checkout of an unknown name changes nothing."""
    repo = mem_repo
    with pytest.raises(RevisionError, match=r"^HEAD \(branch 'main'\) has no versions yet; take a snapshot first$"):
        repo.resolve("HEAD")
    with pytest.raises(RevisionError, match=r"^branch 'main' has no versions yet; take a snapshot first$"):
        repo.resolve("main")
    repo.snapshot({"w": torch.zeros(2)}, step=0)
    with pytest.raises(RevisionError, match=r"^unknown revision 'nosuch'"):
        repo.checkout("nosuch")
    assert repo.current_branch() == "main"
