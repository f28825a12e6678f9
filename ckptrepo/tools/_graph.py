"""The text graph of ``log --graph``: one column per line of development, as ``git log --graph`` draws it.

After a rollback (``checkout @10 -b fix``) the history forks; this shows both
lines and where they join, so one can see which versions a branch shares::

    * 5f1c… (HEAD -> fix)  step 12
    * 9a0e…  step 11
    | * 77d2… (main)  step 30
    | * 1b4f…  step 20
    |/
    * c3e8…  step 10

Each column waits for the version it will draw next (a parent of the row above).
A version is drawn in its column with ``*``; a column whose version another
column already waits for joins it with ``/`` (``_`` bridges columns in between);
a merge opens a column with ``\\``. Versions come in time order, adjusted so
that a version always comes after every child of it (children before parents).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ckptrepo.core import Version, children_first


@dataclass(frozen=True)
class GraphRow:
    """One line of the graph: the drawing on the left, and the version on it (None for a connecting line)."""

    prefix: str
    version: Version | None


def graph(versions: Sequence[Version]) -> list[GraphRow]:
    """Lay out ``versions`` (newest first, as ``Repository.log`` returns them) as graph rows.

    A parent outside ``versions`` (cut off by ``-n`` or ``--since``) keeps its
    column open to the end, as in git, so that the next version drawn there
    is not mistaken for that parent.
    """
    columns: list[str] = []
    rows: list[GraphRow] = []
    by_id = {v.id: v for v in versions}
    for vid in children_first(list(by_id), {v.id: v.parents for v in versions}):
        v = by_id[vid]
        if v.id not in columns:
            columns.append(v.id)
        col = columns.index(v.id)
        rows.append(GraphRow(" ".join("*" if k == col else "|" for k in range(len(columns))) + " ", v))
        parents = list(dict.fromkeys(v.parents))
        if not parents:
            rows.extend(_close(columns, col))
            continue
        columns[col] = parents[0]
        for i, extra in enumerate(parents[1:], start=1):
            rows.append(_open(columns, col + i - 1))
            columns.insert(col + i, extra)
        rows.extend(_join_duplicates(columns))
    return rows


def _line(chars: list[str]) -> GraphRow:
    return GraphRow("".join(chars).rstrip(), None)


def _close(columns: list[str], col: int) -> list[GraphRow]:
    """End column ``col`` (a root); the columns right of it move one place left."""
    columns.pop(col)
    if col == len(columns):
        return []
    chars = [" "] * (2 * len(columns) + 2)
    for k in range(col):
        chars[2 * k] = "|"
    for k in range(col, len(columns)):
        chars[2 * k + 1] = "/"
    return [_line(chars)]


def _open(columns: list[str], col: int) -> GraphRow:
    """Draw a new column branching off ``col`` to its right (a merge's next parent); columns right of it move right."""
    chars = [" "] * (2 * len(columns) + 2)
    for k in range(col + 1):
        chars[2 * k] = "|"
    chars[2 * col + 1] = "\\"
    for k in range(col + 1, len(columns)):
        chars[2 * k + 1] = "\\"
    return _line(chars)


def _join_duplicates(columns: list[str]) -> list[GraphRow]:
    """Join every column that waits for a version an earlier column already waits for (a fork point)."""
    rows = []
    j = 1
    while j < len(columns):
        i = columns.index(columns[j])
        if i == j:
            j += 1
            continue
        chars = [" "] * (2 * len(columns))
        for k in range(j):
            chars[2 * k] = "|"
        for k in range(i + 1, j):
            chars[2 * k - 1] = "_"
        for k in range(j, len(columns)):
            chars[2 * k - 1] = "/"
        rows.append(_line(chars))
        columns.pop(j)
    return rows
