"""How the commands print: the width, tables, colour, sizes, times, JSON and progress bars.

rich is loaded only where a line takes colour (a terminal, or FORCE_COLOR) or a progress bar shows, so that
a quick command such as ``log -n 10`` starts without it (tests/integration/test_startup.py).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import click

import ckptrepo
from ckptrepo.tools import fit, table_lines, terminal_width

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


@cache
def err_console() -> Console:
    """The console on stderr (progress bars, "aborted")."""
    from rich.console import Console
    return Console(stderr=True, highlight=False, soft_wrap=True)


def width() -> int | None:
    """The columns stdout may use now (COLUMNS, else the terminal's; None for a pipe or a file)."""
    return terminal_width(sys.stdout)


def _out() -> Console:
    """A console on the current stdout (tests and pipes swap it), colouring only a terminal; lines are laid
    out by the commands to ``width()``, so rich never wraps them again."""
    from rich.console import Console
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def _may_colour() -> bool:
    """Whether stdout may get colour: a terminal, or FORCE_COLOR or TTY_COMPATIBLE=1 set, as rich decides (rich
    then also honours NO_COLOR and TERM=dumb). Otherwise text is printed as it is, without loading rich."""
    return sys.stdout.isatty() or bool(os.environ.get("FORCE_COLOR")) or os.environ.get("TTY_COMPATIBLE") == "1"


def print_marked(line: str, start: int, end: int, style: str) -> None:
    """``line`` (printable, already fitted) with ``line[start:end]`` in ``style`` where stdout takes colour."""
    if not _may_colour():
        click.echo(line)
        return
    from rich.markup import escape
    if end > start:
        _out().print(escape(line[:start]) + f"[{style}]{escape(line[start:end])}[/]" + escape(line[end:]), markup=True)
    else:
        _out().print(escape(line), markup=True)


def echo_fit(text: str) -> None:
    """One line of output, cut to the width with an ellipsis (as git's and rich's truncation)."""
    click.echo(fit(text, width()))


def print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], fold: int = 1,
                whole_names: bool = False) -> None:
    """Print a table that fits the width: the first ``fold`` columns (names, values) fold onto more lines
    first, the others (numbers, sizes) only if nothing else fits; ``whole_names``: a name is never folded, it
    takes a line of its own instead. Piped output with no COLUMNS keeps every cell on one line, whole (see
    ckptrepo.tools.table_lines)."""
    cols = width()
    click.echo(fit(printable(title), cols))
    for line in table_lines(headers, [[printable(c) for c in r] for r in rows], cols, fold=fold,
                            whole_names=whole_names):
        click.echo(line)


def size(n: float) -> str:
    """A size in binary units (KiB, MiB, GiB: powers of 1024), as everywhere in ckptrepo's output."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def when(t: float, seconds: bool = True) -> str:
    """A time as a local date and time (to the minute where ``seconds`` is false)."""
    try:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):   # a time no calendar holds: shown as the number it is
        return f"time {t!r}"


def metrics_text(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def num(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.4g}"


def step(v: ckptrepo.Version) -> str:
    return step_of(v.step)


def step_of(step: int | None) -> str:
    return f"step {step}" if step is not None else "step -"


def number(value: Any) -> float:
    """A time from a failure record, which is whatever a damaged record holds: 0 when it is not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def failed_what(record: dict[str, Any]) -> str:
    """What a failure record is about, before its version id: nothing for a snapshot (most are), ``push of
    BRANCH to REMOTE at`` for a local tier's background push."""
    if record.get("remote"):
        return f"push of {record.get('branch')} to {record.get('remote')} at "
    return ""


def durability(v: ckptrepo.Version) -> str:
    """Where a version's data is durable, as ``log`` marks it: ``[local origin]`` (here, and on remote origin),
    ``[origin]`` (evicted here, or cloned lazily: read from origin), ``[local]`` (not pushed yet), ``[-]``
    (pruned, and on no remote)."""
    return f"[{' '.join((['local'] if v.local else []) + list(v.remotes)) or '-'}]"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every terminal control code (ESC included: a message could clear the screen, hide text
    or set the window title; rich's strip_control_codes leaves ESC) shown as ``\\xNN``; tabs and newlines kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def emit_json(data: Any) -> None:
    """Strict JSON: NaN and infinities (a diverged loss, a relative change from zero) are null, as ``jq`` and
    other parsers reject Python's NaN and Infinity."""
    data = _finite(data)
    if isinstance(data, list) and len(data) > 1 and all(_flat_record(r) for r in data):
        # a long list of flat records (a trajectory of 10,000 versions): one record per line, each encoded by
        # json's C encoder, which an indented dump never uses; still one JSON document
        lines = [json.dumps(r, default=str, allow_nan=False) for r in data]
        click.echo("[\n  " + ",\n  ".join(lines) + "\n]")
        return
    click.echo(json.dumps(data, indent=2, default=str, allow_nan=False))


def _flat_record(r: Any) -> bool:
    return isinstance(r, dict) and not any(isinstance(v, (dict, list, tuple)) for v in r.values())


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def progress() -> Progress | None:
    """A byte progress bar, only when stderr is a terminal."""
    if not err_console().is_terminal:
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=err_console(), transient=True)


def transfer(what: str, call: Callable[[Callable[[int, int], None] | None], Any]) -> Any:
    """``call(progress)``: with a byte progress bar on a terminal (stderr), quietly otherwise."""
    bar = progress()
    if bar is None:
        return call(None)
    with bar:
        task = bar.add_task(what, total=None)
        return call(lambda done, total: bar.update(task, completed=done, total=total or None))
