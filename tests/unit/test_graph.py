"""The ``log --graph`` text graph (``ckptrepo.tools._graph``), compared with the exact expected rows.

Each case lists versions newest first, as ``Repository.log`` returns them, and checks every row the graph
draws: version rows (``*`` in the version's column, ``|`` for the others, then a space) and connecting rows
(``/`` joins a column into the one left of it, ``\\`` opens a merge parent's column). The last test draws a
real repository's ``log(all=True)`` after a rollback, so log's order and the graph are checked together.
"""
from __future__ import annotations

import uuid

import torch

import ckptrepo
from ckptrepo import Version
from ckptrepo.tools._graph import GraphRow, graph


def version(vid: str, *parents: str, t: float = 0.0) -> Version:
    return Version(vid, parents, None, t, "", {}, 0)


def draw(versions: list[Version]) -> list[str]:
    """Each row as text: the drawing, then the version's id on version rows."""
    return [r.prefix + (r.version.id if r.version else "") for r in graph(versions)]


def test_linear_history_is_one_column() -> None:
    """A single line of versions is a column of ``*`` rows, one per version, in the order given."""
    rows = graph([version("c", "b"), version("b", "a"), version("a")])
    assert [(r.prefix, r.version.id if r.version else None) for r in rows] == [("* ", "c"), ("* ", "b"), ("* ", "a")]
    assert all(isinstance(r, GraphRow) for r in rows)


def test_empty_and_single_version() -> None:
    assert graph([]) == []
    assert draw([version("r")]) == ["* r"]


def test_a_branch_forks_and_joins_at_its_base() -> None:
    """Two lines of two versions each from one base, interleaved by time: two columns, joined by ``|/``."""
    assert draw([version("f2", "f1"), version("m2", "m1"), version("f1", "base"), version("m1", "base"),
                 version("base")]) == ["* f2", "| * m2", "* | f1", "| * m1", "|/", "* base"]


def test_connecting_rows_carry_no_version() -> None:
    """The join row has no version, and its drawing has no trailing space (version rows keep theirs)."""
    rows = graph([version("b", "r"), version("a", "r"), version("r")])
    assert [(r.prefix, r.version is None) for r in rows] == [("* ", False), ("| * ", False), ("|/", True),
                                                             ("* ", False)]


def test_a_two_parent_version_opens_a_column() -> None:
    """A merge's second parent gets a new column (``|\\``) that joins the first at their common base."""
    assert draw([version("top", "m"), version("m", "a2", "b2"), version("b2", "b1"), version("a2", "a1"),
                 version("b1", "base"), version("a1", "base"), version("base")]) == [
        "* top", "* m", "|\\", "| * b2", "* | a2", "| * b1", "* | a1", "|/", "* base"]


def test_a_merge_parent_another_column_already_waits_for() -> None:
    """The merge's second parent ``b`` is also ``x``'s parent: ``x``'s column joins ``b``'s (``| |/``)."""
    assert draw([version("m", "a", "b"), version("x", "b"), version("a", "r"), version("b", "r"), version("r")]) == [
        "* m", "|\\", "| | * x", "| |/", "* | a", "| * b", "|/", "* r"]


def test_a_parent_named_twice_is_one_parent() -> None:
    """Duplicate parent ids draw as a single line, not a merge with itself."""
    assert draw([version("m", "p", "p"), version("p")]) == ["* m", "* p"]


def test_several_tips_at_different_depths() -> None:
    """Tips forking from different versions of one line join, each at its own fork point."""
    assert draw([version("a3", "a2"), version("b1", "a1"), version("a2", "a1"), version("a1", "r"),
                 version("c1", "r"), version("r")]) == [
        "* a3", "| * b1", "* | a2", "|/", "* a1", "| * c1", "|/", "* r"]


def test_unrelated_roots_close_their_columns() -> None:
    """Two histories without a common version: when the left root ends, the right column moves left (`` /``)."""
    assert draw([version("x2", "x1"), version("y2", "y1"), version("x1"), version("y1")]) == [
        "* x2", "| * y2", "* | x1", " /", "* y1"]


def test_a_parent_given_before_its_child_is_held_back() -> None:
    """Clock skew: a parent listed first is still drawn after its child."""
    assert draw([version("p", t=2.0), version("c", "p", t=1.0)]) == ["* c", "* p"]


def test_graph_of_a_repository_after_a_rollback() -> None:
    """main: steps 0..3; ``checkout @1 -b fix`` and two snapshots: ``log(all=True)`` draws the fork at step 1."""
    repo = ckptrepo.init(f"memory://{uuid.uuid4().hex}")
    names: dict[str, str] = {}
    for step in range(4):
        names[repo.snapshot({"w": torch.full((2,), float(step))}, step=step).id] = f"m{step}"
    repo.checkout("@1", branch="fix")
    for step in (2, 3):
        names[repo.snapshot({"w": torch.full((2,), -float(step))}, step=step).id] = f"f{step}"
    rows = [r.prefix + (names[r.version.id] if r.version else "") for r in graph(repo.log(all=True))]
    assert rows == ["* f3", "* f2", "| * m3", "| * m2", "|/", "* m1", "* m0"]
    assert repo.log(all=True)[0].refs == ("HEAD -> fix",)
