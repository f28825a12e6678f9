"""The per-module summary of a diff, as ``diff --stat`` and ``show --stat`` print it and ``--json`` gives it.

One function orders the rows for both commands: by name, with the numbers inside names by value
(``layers.2`` before ``layers.10``), or largest first by relative change or by ||B-A||; a missing number
(an added or reshaped tensor) and NaN sort last.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ckptrepo.tools._width import natural_key

if TYPE_CHECKING:   # the diff itself needs torch; ordering its rows does not
    from ckptrepo.tools._inspect import VersionDiff

SORTS = ("name", "relative", "l2")


def _sortable(value: Any) -> float:
    """A number to sort by: no value and NaN sort below every number."""
    return value if isinstance(value, (int, float)) and value == value else -1.0


def row_key(sort_by: str) -> Callable[[dict[str, Any]], Any]:
    """How rows are ordered (a tensor's by ``name``, a prefix's by ``prefix``): ``sort_by`` is one of SORTS."""
    if sort_by == "name":
        return lambda r: natural_key(r["name"] if "name" in r else r["prefix"])
    return lambda r: -_sortable(r[sort_by])


def diff_stat(diff: VersionDiff, depth: int = 2, sort_by: str = "name") -> list[dict[str, Any]]:
    """``diff``'s summary per module prefix (the first ``depth`` name components), ordered by ``sort_by``."""
    return sorted(diff.by_prefix(depth), key=row_key(sort_by))


__all__ = ["SORTS", "diff_stat", "row_key"]
