"""How wide the CLI may print, how to cut a line to that width, and the order names are listed in.

The width follows git: ``COLUMNS`` when it is set (in a pipe too, so that
``COLUMNS=80 ckptrepo log | less`` fits), else the terminal's width, else no
limit, so that output written to a file or a pipe keeps every name and number
whole. Widths are counted in terminal cells: a CJK character takes two.
"""
from __future__ import annotations

import os
import re
import shutil
import unicodedata
from typing import IO, Any, Sequence

MIN_WIDTH = 20   # narrower than this, nothing readable fits; a COLUMNS of 5 is taken as this
ELLIPSIS = "…"


def terminal_width(stream: IO[Any]) -> int | None:
    """The columns output to ``stream`` must fit: ``COLUMNS`` if set, the terminal's width if ``stream`` is a
    terminal, None (no limit) otherwise."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(MIN_WIDTH, int(columns))
    try:
        is_terminal = stream.isatty()
    except (AttributeError, ValueError):   # a closed or unusual stream
        is_terminal = False
    if not is_terminal:
        return None
    return max(MIN_WIDTH, shutil.get_terminal_size().columns)


def cell_width(text: str) -> int:
    """The number of terminal cells ``text`` takes (wide characters two, combining marks none)."""
    return sum(_char_width(c) for c in text)


def _char_width(c: str) -> int:
    if unicodedata.combining(c):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def fit(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` cells, ending in an ellipsis where it was cut (as git's ``%<(N,trunc)`` and
    rich's ``overflow="ellipsis"`` do); unchanged when ``width`` is None or it fits."""
    if width is None or cell_width(text) <= width:
        return text
    out, used = [], 0
    for c in text:
        w = _char_width(c)
        if used + w > width - 1:
            break
        out.append(c)
        used += w
    return "".join(out) + ELLIPSIS


def fit_middle(text: str, width: int | None) -> str:
    """``text`` in ``width`` cells with its middle cut to an ellipsis where it is wider: a long tensor name keeps
    its start (the module) and its end (the parameter), as git's ``diff --stat`` shortens a path."""
    if width is None or cell_width(text) <= width:
        return text
    if width < 3:
        return fit(text, width)
    head_room = width // 2
    tail_room = width - 1 - head_room
    head, used = [], 0
    for c in text:
        if used + _char_width(c) > head_room:
            break
        head.append(c)
        used += _char_width(c)
    tail: list[str] = []
    used = 0
    for c in reversed(text):
        if used + _char_width(c) > tail_room:
            break
        tail.append(c)
        used += _char_width(c)
    return "".join(head) + ELLIPSIS + "".join(reversed(tail))


def keep_last(text: str, width: int | None) -> str:
    """The end of ``text`` in ``width`` cells, an ellipsis first where the start was cut: for a sparkline, whose
    newest values are the ones to see."""
    if width is None or len(text) <= width:
        return text
    return ELLIPSIS + text[len(text) - width + 1:]


GAP = 2          # spaces between table columns
MIN_FOLD = 12    # a folded column keeps at least this many cells while the other columns can give way
MIN_NAME = 24    # a name column narrower than this is put on lines of its own instead
MIN_NUMBER = 10  # a number column keeps this many cells ("-1.234e-05") while any column can give way
RULE = "─"


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None,
                fold: int = 1, whole_names: bool = False) -> list[str]:
    """A table as lines of at most ``width`` cells: a header, a rule, then the rows, columns ``GAP`` apart.

    Cells are never cut short: a cell wider than its column folds onto more lines (at a ``/``, ``.``, ``_`` or
    space near the end where there is one, as a path wraps). The first ``fold`` columns (names, values) give
    way first, down to ``MIN_FOLD`` cells; only then do the others (numbers), widest first. When a single name
    column would be left fewer than ``MIN_NAME`` cells, each name gets a line of its own and the other cells
    go on the line below it, indented (a table of many numbers in a narrow terminal). With no ``width`` each
    column is as wide as its widest cell.

    ``whole_names``: the first column is never folded inside a name; when the names do not fit beside the
    other cells, each takes a line of its own (its middle cut to an ellipsis only where it is wider than the
    whole line), as a tensor name read in two pieces reads as two names.
    """
    n = len(headers)
    natural = [max([cell_width(h)] + [cell_width(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if width is None or sum(natural) + GAP * (n - 1) <= width:
        return _lines(headers, rows, natural)
    if whole_names and n > 1:
        return _stacked(headers, [[fit_middle(r[0], width)] + list(r[1:]) for r in rows], natural, width)
    if fold == 1 and n > 1 and width - sum(natural[1:]) - GAP * (n - 1) < min(MIN_NAME, natural[0]):
        return _stacked(headers, rows, natural, width)
    return _lines(headers, rows, _shrink(natural, width - GAP * (n - 1), fold))


def _lines(headers: Sequence[str], rows: Sequence[Sequence[str]], widths: list[int]) -> list[str]:
    lines = _row(headers, widths) + ["  ".join(RULE * w for w in widths)]
    for r in rows:
        lines.extend(_row(r, widths))
    return lines


def _stacked(headers: Sequence[str], rows: Sequence[Sequence[str]], natural: list[int], width: int) -> list[str]:
    """Each row as its first cell on a line of its own (folded to ``width``), then the other cells indented."""
    indent = " " * GAP
    widths = _shrink(natural[1:], width - GAP * len(natural[1:]), 0)
    lines = _wrap(headers[0], width) + [indent + line for line in _row(headers[1:], widths)]
    lines.append(RULE * min(width, max(cell_width(line) for line in lines)))
    for r in rows:
        lines.extend(_wrap(r[0], width))
        lines.extend(indent + line for line in _row(r[1:], widths))
    return lines


def _shrink(natural: list[int], room: int, fold: int) -> list[int]:
    """Column widths that fit ``room`` cells (the gaps taken out): the first ``fold`` columns down to
    ``MIN_FOLD``, then the others down to ``MIN_NUMBER``, then any column, widest first."""
    widths = list(natural)
    first, rest, every = range(min(fold, len(widths))), range(min(fold, len(widths)), len(widths)), range(len(widths))
    for columns, floor in ((first, MIN_FOLD), (rest, MIN_NUMBER), (every, 1)):
        while sum(widths) > room and columns:
            wide = max(columns, key=lambda i: widths[i])
            if widths[wide] <= floor:
                break
            widths[wide] -= 1
    return widths


def _row(cells: Sequence[str], widths: list[int]) -> list[str]:
    """One table row as lines: each cell folded to its column, padded, the line's trailing spaces dropped."""
    parts = [_wrap(c, w) for c, w in zip(cells, widths)]
    height = max(len(p) for p in parts)
    return ["  ".join(_pad(p[k] if k < len(p) else "", w) for p, w in zip(parts, widths)).rstrip()
            for k in range(height)]


def _pad(text: str, width: int) -> str:
    return text + " " * (width - cell_width(text))


_BREAKS = "/._- "


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in pieces of at most ``width`` cells, each ending at a break character in its last third
    where there is one."""
    pieces: list[str] = []
    while cell_width(text) > width:
        cut, used = 0, 0
        for i, c in enumerate(text):
            used += _char_width(c)
            if used > width:
                break
            cut = i + 1
        cut = max(cut, 1)
        soft = max((i + 1 for i in range(cut) if text[i] in _BREAKS and i + 1 >= cut * 2 // 3), default=cut)
        pieces.append(text[:soft])
        text = text[soft:]
    pieces.append(text)
    return pieces


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that orders the numbers inside names by value: ``state/2`` before ``state/10``, as ``ls -v``
    does. Each part is tagged so that a number and a text never compare with each other."""
    return tuple((1, int(part)) if part.isdigit() else (0, part) for part in _DIGITS.split(name) if part)


__all__ = ["ELLIPSIS", "MIN_WIDTH", "cell_width", "fit", "fit_middle", "keep_last", "natural_key", "table_lines",
           "terminal_width"]
