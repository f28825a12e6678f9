"""Files replaced whole, and fsync of what was written: the adapters' small files beside a framework's checkpoints
(pointers, stubs, ``latest``) and the folders an export writes.

Each is written under a temporary name in its own folder (the same file system, so the rename is atomic),
made durable, renamed over its path, and the folder's entry made durable too: a reader, or a machine that
lost power, finds the old file or the new one, never half of one, and never a rename without its bytes.
"""
from __future__ import annotations

import contextlib
import os
import threading


def replace_file(path: str | os.PathLike[str], data: str | bytes, sync: bool = True) -> None:
    """Replace the local file at ``path`` by ``data`` (text is written as UTF-8), atomically.

    ``sync=False`` leaves the fsyncs to :func:`sync_file` (a caller that writes on the training thread and
    makes the file durable later, together with what it names). On failure the temporary file is removed and
    the old file, if any, is left as it was.
    """
    path = os.fspath(path)
    # per process and thread: two writers of one path never share a temporary file
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:   # noqa: PTH123
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        sync_folder(path)


def sync_file(path: str | os.PathLike[str]) -> None:
    """fsync the file at ``path`` and its folder's entry."""
    fsync_path(path)
    sync_folder(path)


def sync_folder(path: str | os.PathLike[str]) -> None:
    """fsync the folder that holds ``path``: a rename or a new file there is durable only then."""
    fsync_path(os.path.dirname(os.path.abspath(os.fspath(path))))


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the file or folder at ``path`` (a folder: the names in it)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["fsync_path", "replace_file", "sync_file", "sync_folder"]
