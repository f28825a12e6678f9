"""How the CLI reports an error: one line on stderr, escaped, and the exit code.

Every message passes through ``escape``, so text an argument carried into it (a path with a BEL, a backspace
or a carriage return, a name with ESC) is shown as ``\\xNN`` and can neither ring, rewrite the line nor drive
the terminal; a newline is escaped too, so the error stays one line. An OS error that no command turned into
a message of its own is worded here: what failed, on which path, and what to do.
"""
from __future__ import annotations

import io
import os
import re

import click

from ckptrepo.errors import CkptRepoError, first_line, os_error_line

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
DEBUG_HINT = "(set CKPTREPO_DEBUG=1 for a traceback)"


def escape(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1; tab and newline too) as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def message(err: BaseException) -> str:
    """The one line that reports ``err`` (before escaping)."""
    if isinstance(err, CkptRepoError):
        return str(err)
    if isinstance(err, OSError) and err.strerror:
        return os_error_line(err)
    return f"{type(err).__name__}: {first_line(err)} {DEBUG_HINT}"


def report(err: BaseException) -> None:
    """Print ``err`` as ``ckptrepo: error: ...`` on stderr, on one line."""
    click.echo(f"ckptrepo: error: {escape(message(err))}", err=True)


def show_usage_error(err: click.ClickException) -> None:
    """click's own report (usage and the error), each of its lines escaped as every other message."""
    text = io.StringIO()
    err.show(file=text)
    for line in text.getvalue().splitlines():
        click.echo(escape(line), err=True)


def debugging() -> bool:
    """Whether an unexpected error shows its traceback (CKPTREPO_DEBUG set)."""
    return bool(os.environ.get("CKPTREPO_DEBUG"))


__all__ = ["DEBUG_HINT", "debugging", "escape", "message", "report", "show_usage_error"]
