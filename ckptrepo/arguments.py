"""Argument checks shared by the public entry points: whole numbers, flags, steps, meta, text.

Every layer checks what a caller passed before anything is read or written, with ckptrepo's own exception
naming the argument and what it takes (decisions/018): a wrong type would otherwise surface as an
AttributeError deep inside (``5.strip()``), be ignored without a word, or, in a background thread, fail every
snapshot. The checks sit below every layer (they import only ``errors``), so one wording serves the porcelain,
the snapshotter, maintenance and the framework adapters. Each caller picks the exception type and how the
refused value is quoted; the words around them are the same everywhere.
"""
from __future__ import annotations

import operator
import os
from typing import Any, Callable, Mapping, TypeGuard

from ckptrepo.errors import ArgumentError, ExchangeError, RefError, RevisionError, UnsupportedValueError

MAX_META_CHARS = 64 * 1024   # a header is read by every log and history walk: meta is for ids and URLs


def short_text(value: Any, width: int) -> str:
    """``value`` as ``show`` and ``diff`` print it, cut to ``width`` characters; an int too big for ``repr``
    (over 4300 digits) by its leading hexadecimal digits and its size."""
    if isinstance(value, int) and value.bit_length() > 4 * width:
        text = f"{hex(value)[:width // 2]}... ({value.bit_length()} bits)"
    else:
        text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def shown(value: Any) -> str:
    """A refused value as the porcelain quotes it: its type, then its text, bounded."""
    return f"{type(value).__name__} {short_text(value, 40)}"


def cut(value: Any) -> str:
    """A refused value's repr, at most 40 characters (what a huge string or list would otherwise flood)."""
    return f"{value!r:.40}"


def is_whole(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or float and not a bool (a metric a view can plot)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_whole(value: Any, name: str, least: int | None = None, *, optional: bool = False,
                error: type[Exception] = ArgumentError, show: Callable[[Any], str] = repr, hint: str = "") -> None:
    """``value`` must be a whole number (not a bool), at least ``least`` when given; ``optional``: or None.
    ``error(f"{name} must be a whole number[ of at least N][ or None], not {show(value)}{hint}")`` otherwise."""
    if optional and value is None:
        return
    if not is_whole(value) or (least is not None and value < least):
        bound = "" if least is None else f" of at least {least}"
        none = " or None" if optional else ""
        raise error(f"{name} must be a whole number{bound}{none}, not {show(value)}{hint}")


def check_flag(value: Any, name: str, *, optional: bool = False, show: Callable[[Any], str] = repr) -> None:
    """``value`` must be True or False (``optional``: or None, "decide for me"): ArgumentError otherwise, where
    a truthy string or number would silently mean True."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise ArgumentError(f"{name} must be True or False, not {show(value)}")


def check_rev(rev: Any) -> str:
    """A revision is text; anything else is a RevisionError saying what one looks like."""
    if not isinstance(rev, str):
        raise RevisionError(f"a revision is text (HEAD, a branch, a tag, an id, @STEP or REV~N), not {shown(rev)}")
    return rev


def check_ref_type(name: Any, kind: str) -> str:
    """A branch or tag name (``kind``) is text; whether it is a good name is ``core._refs``'s question."""
    if not isinstance(name, str):
        raise RefError(f"a {kind} name is text, not {shown(name)}")
    return name


def check_pattern(pattern: Any, required: bool = False) -> None:
    """A tensor name pattern is a glob (text); None means every tensor unless ``required``."""
    if not isinstance(pattern, str) and (required or pattern is not None):
        raise ArgumentError(f"a tensor name pattern is text (a glob such as 'model/*'), not {shown(pattern)}")


def check_callback(fn: Any, name: str) -> None:
    """A progress callback is a function or None."""
    if fn is not None and not callable(fn):
        raise ArgumentError(f"{name} must be a function or None, not {shown(fn)}")


def check_path(path: Any, what: str) -> None:
    """A file or folder outside the repository is a ``str`` or ``os.PathLike``."""
    if not isinstance(path, (str, os.PathLike)):
        raise ExchangeError(f"the {what} is a path (a str or pathlib.Path), not {shown(path)}")


def repo_url(url: Any) -> str:
    """A repository's path or URL as text: a ``str``, or an ``os.PathLike`` such as ``pathlib.Path``."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise ArgumentError(f"a repository is a path or URL (a str or pathlib.Path), not {shown(url)}")
    return url


def checked_step(step: Any) -> int | None:
    """``step`` as an int (numpy ints too) that fits the manifest's 64 bits, or None; a float, string or bool
    is refused (1.7 would become 1, and 2**64 would kill the background commit)."""
    if step is None:
        return None
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise UnsupportedValueError(f"step must be an int or None, not {type(step).__name__} {step!r}")
    step = operator.index(step)
    if not -(1 << 63) <= step < (1 << 63):
        raise UnsupportedValueError(f"step {step} does not fit in 64 bits")
    return step


def checked_meta(meta: Any) -> dict[str, str] | None:
    """Free-text key/values for a version's header (a tracker's run id and URL, the file name a framework chose):
    text only, so that any reader can show them; None or empty records nothing."""
    if not meta:
        return None
    if not isinstance(meta, Mapping):
        raise UnsupportedValueError(f"meta must be a dict of names to text, not {type(meta).__name__}")
    out = {}
    total = sum(len(k) + len(v) for k, v in meta.items() if isinstance(k, str) and isinstance(v, str))
    if total > MAX_META_CHARS:
        raise UnsupportedValueError(f"meta holds {total} characters, more than the {MAX_META_CHARS} a header keeps "
                                    f"(every `log` reads it): keep ids, names and URLs there, and store larger "
                                    f"things in the state")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UnsupportedValueError(f"meta {k!r} = {v!r:.40} is not text; meta maps names to strings (use "
                                        f"metrics for numbers)")
        out[utf8_text(k, f"meta name {k!r}")] = utf8_text(v, f"meta {k!r}")
    return out


def checked_message(message: Any) -> str:
    """The commit message: text (``None`` is empty). Another type, once committed, breaks `ckptrepo log` for good."""
    if message is None:
        return ""
    if not isinstance(message, str):
        raise UnsupportedValueError(f"message must be a str, not {type(message).__name__}")
    return utf8_text(message, "message")


def utf8_text(value: str, what: str) -> str:
    """``value``, refused when it cannot be written as UTF-8 (a lone surrogate): ``what`` names it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UnsupportedValueError(f"{what} is not valid text ({err.reason} at position {err.start})") from None
    return value


__all__ = ["MAX_META_CHARS", "check_callback", "check_flag", "check_path", "check_pattern", "check_ref_type",
           "check_rev", "check_whole", "checked_message", "checked_meta", "checked_step", "cut", "is_number",
           "is_whole", "repo_url", "short_text", "shown", "utf8_text"]
