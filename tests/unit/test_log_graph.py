"""log --graph: forks after a rollback drawn like `git log --graph --oneline --all`."""
from __future__ import annotations

import pytest
import torch
from support.helpers import run

from ckptrepo.core._manifest import Version
from ckptrepo.tools._graph import graph


def version(vid: str, *parents: str) -> Version:
    return Version(vid, parents, None, 0.0, "", {}, 0)


def draw(versions: list[Version]) -> list[str]:
    return [r.prefix + (r.version.id if r.version else "") for r in graph(versions)]


@pytest.fixture
def forked(repo, tmp_path):
    """main: steps 0..4; then a rollback to step 2 and a branch `fix` with steps 3, 4 of its own."""
    for step in range(5):
        repo.snapshot({"w": torch.full((2,), float(step))}, step=step)
    repo.checkout("@2", branch="fix")
    for step in (3, 4):
        repo.snapshot({"w": torch.full((2,), -float(step))}, step=step)
    return str(tmp_path / "repo"), repo


def test_cli_graph_shows_the_fork(forked):
    url, repo = forked
    p = run("log", "--graph", "--all", repo=url)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    fork = repo.resolve("main~2")[:12]
    assert len(lines) == 8 and p.stdout.count(fork) == 1
    assert lines[0].startswith("* ") and "HEAD -> fix" in lines[0] and "step 4" in lines[0]
    assert lines[1].startswith("* ") and "step 3" in lines[1]
    assert lines[2].startswith("| * ") and "(main)" in lines[2] and "step 4" in lines[2]
    assert lines[3].startswith("| * ") and "step 3" in lines[3]
    assert lines[4] == "|/"
    assert lines[5].startswith(f"* {fork}") and "step 2" in lines[5]
    assert all(line.startswith("* ") for line in lines[6:])

    linear = run("log", "--graph", repo=url).stdout.splitlines()   # HEAD's history alone has no fork
    assert len(linear) == 5 and all(line.startswith("* ") for line in linear)
    p = run("log", "--graph", "--json", repo=url)
    assert p.returncode == 2 and "--graph cannot be combined" in p.stderr


def test_interleaved_branches_keep_their_columns():
    assert draw([version("f12", "f11"), version("m30", "m20"), version("f11", "m10"), version("m20", "m10"),
                 version("m10", "m0"), version("m0")]) == [
        "* f12", "| * m30", "* | f11", "| * m20", "|/", "* m10", "* m0"]


def test_three_branches_from_one_version_join_one_by_one():
    assert draw([version("c2", "c1"), version("b2", "b1"), version("a2", "a1"), version("c1", "x"),
                 version("b1", "x"), version("a1", "x"), version("x")]) == [
        "* c2", "| * b2", "| | * a2", "* | | c1", "| * | b1", "|/ /", "| * a1", "|/", "* x"]


def test_join_across_a_column_and_merges_and_roots():
    assert draw([version("a1", "x"), version("b1", "y"), version("c1", "x"), version("y", "x"), version("x")]) == [
        "* a1", "| * b1", "| | * c1", "|_|/", "| * y", "|/", "* x"]
    assert draw([version("m", "p1", "p2"), version("p2", "r"), version("p1", "r"), version("r")]) == [
        "* m", "|\\", "| * p2", "* | p1", "|/", "* r"]
    assert draw([version("b2", "b1"), version("a2", "a1"), version("b1"), version("a1")]) == [
        "* b2", "| * a2", "* | b1", " /", "* a1"]


def test_parents_cut_off_keep_their_columns():
    """With -n or --since, a version whose parent is not listed is not drawn as the parent of the next one."""
    assert draw([version("a2", "a1"), version("b1")]) == ["* a2", "| * b1"]
    assert draw([version("f3", "x"), version("m3", "x")]) == ["* f3", "| * m3", "|/"]


def test_children_are_drawn_before_parents_whatever_the_times():
    """A parent listed before its child (clock skew) is held back until the child is drawn."""
    assert draw([version("p"), version("c", "p")]) == ["* c", "* p"]
