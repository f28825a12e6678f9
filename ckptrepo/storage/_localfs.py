"""Helpers for stores whose keys are files under a local directory (``StoreCapabilities.local_root``).

Shared by the TensorStore store's file driver, the direct read and write paths
and the refs, none of which should need the others to count bytes or tidy folders.
"""
from __future__ import annotations

import errno
import os
import stat
import threading

from ckptrepo.errors import CorruptionError

# TensorStore's file kvstore writes a value to <key>.__lock, then renames it; such keys are never values
LOCK_SUFFIX = ".__lock"

# O_NONBLOCK: opening a FIFO that took an object's place returns at once (a plain open waits for a writer
# forever); for a regular file it changes nothing. O_NOCTTY: a terminal device never becomes ours.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class ByteCounter:
    """A running total of bytes, safe across threads: what a direct local I/O path (localread,
    localwrite, the store's plain reads) moved, the counterpart of TensorStore's own kvstore metrics."""

    def __init__(self) -> None:
        self._total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    def total(self) -> int:
        return self._total


def remove_empty_folders(root: str, prefix: str) -> None:
    """The empty folders under ``prefix`` (a folder when it ends in "/"), then its parents while they are empty,
    stopping below its top-level folder (``data/``, ``staging/``)."""
    path = os.path.join(root, prefix.rstrip("/"))
    folder = path if prefix.endswith("/") else os.path.dirname(path)
    for sub, _, _ in os.walk(folder, topdown=False):
        try:
            os.rmdir(sub)   # only when empty
        except OSError:
            pass
    remove_empty_parents(os.path.dirname(folder), os.path.join(root, prefix.split("/", 1)[0]))


def remove_empty_parents(folder: str, top: str) -> None:
    """Remove ``folder``, then its parents, while they are empty, stopping below ``top`` (a local store's
    folders: a deleted key's leftovers)."""
    while folder.startswith(top + os.sep):
        try:
            os.rmdir(folder)   # only when empty
        except OSError:
            return
        folder = os.path.dirname(folder)


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for messages."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def not_a_file(key: str, mode: int) -> CorruptionError:
    """The error for an object whose file is a FIFO, socket or device: reading one blocks forever or never
    ends (a symbolic link to /dev/zero), so such a file is damage, never a value."""
    return CorruptionError(f"object {key} is {file_kind(mode)}, not a file; ckptrepo reads only regular files: move it "
                           f"away, then run `ckptrepo fsck`")


def too_big(key: str, size: int, max_bytes: int) -> CorruptionError:
    return CorruptionError(f"object {key} is {size} bytes, more than the {max_bytes} such an object can hold "
                           f"(docs/format.md); it is damaged: move it away, then run `ckptrepo fsck`")


def file_size(path: str, key: str, max_bytes: int | None = None) -> int | None:
    """The size of the regular file at ``path`` holding ``key``; None where no file holds it (absent, a
    folder, a broken link), as the store itself reads those. Anything else there (FIFO, socket, device)
    raises CorruptionError without being opened, as does a file over ``max_bytes``. Other failures to look
    (permissions) raise OSError, for the store's own read to report."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise not_a_file(key, st.st_mode)
    if max_bytes is not None and st.st_size > max_bytes:
        raise too_big(key, st.st_size, max_bytes)
    return st.st_size


def look(path: str | None, key: str, max_bytes: int | None = None) -> None:
    """Before TensorStore opens ``key`` from a file store (``path``: its file; None elsewhere), refuse with
    CorruptionError what it must not open: a FIFO blocks its read forever, and a file over ``max_bytes`` would
    be read whole. A failure to look is left to TensorStore's own read, which reports it."""
    if path is not None:
        try:
            file_size(path, key, max_bytes)
        except OSError:
            pass


def open_regular(path: str, key: str) -> int | None:
    """A read-only descriptor of the regular file at ``path`` holding ``key`` (None: no file holds it; see
    ``file_size``). Looked at before it is opened, so a device is never opened, and checked again once
    open, so a FIFO swapped in meanwhile cannot block the open or the reads."""
    opened = _open_regular_sized(path, key)
    return None if opened is None else opened[0]


def _open_regular_sized(path: str, key: str) -> tuple[int, int] | None:
    """``open_regular``'s descriptor with the size its check saw."""
    if file_size(path, key) is None:
        return None
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        if err.errno == errno.ENXIO:   # a socket, swapped in since the look
            raise CorruptionError(f"object {key} is a socket, not a file; move it away, then run "
                                  f"`ckptrepo fsck`") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_a_file(key, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str, key: str, max_bytes: int) -> bytes | None:
    """The bytes of the regular file at ``path`` holding ``key``, None where no file holds it; a file over
    ``max_bytes`` is refused before it is read, and one growing meanwhile after ``max_bytes + 1`` bytes."""
    opened = _open_regular_sized(path, key)
    if opened is None:
        return None
    fd, size = opened
    try:
        if size > max_bytes:
            raise too_big(key, size, max_bytes)
        parts, got, ask = [], 0, size + 1   # the size and one more: a short read says the file ends there
        while got <= max_bytes:
            want = min(ask, max_bytes + 1 - got)
            part = os.read(fd, want)
            if not part:
                break
            parts.append(part)
            got += len(part)
            if len(part) < want:   # a regular file reads short only at its end
                break
            ask = 1 << 20   # it grew since fstat: on in steps, never a buffer of the whole cap at once
        if got > max_bytes:
            raise too_big(key, got, max_bytes)
        return b"".join(parts)
    finally:
        os.close(fd)


def check_lock_file(path: str, key: str) -> None:
    """Refuse to write ``key`` when its lock file (``<path>.__lock``, which TensorStore's file store opens for
    writing, then renames over the value) is anything but a regular file: a FIFO blocks the write forever, and
    a symbolic link would be renamed into the value's place."""
    try:
        st = os.lstat(path + LOCK_SUFFIX)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(st.st_mode):
        raise CorruptionError(f"the lock file of object {key} ({key}{LOCK_SUFFIX}) is {file_kind(st.st_mode)}, "
                              f"not a file, so {key} cannot be written; remove it (no writer leaves one)")
