"""Pointer files: the small JSON file at a checkpoint path that names the version holding its data.

A pointer says which repository, which version, the tag its save gave it, the step, and ``previous``: the
version the same path named before this save, if that one was committed. A pointer is written when its save
starts, so the path exists as soon as the framework's ``save`` returns (its bookkeeping checks that); its
version may then still be in flight, or, after a crash, never committed (see ``CheckpointFiles.resolve``).

A pointer is input like any file: it is read bounded, every field is checked, and a file that claims to be a
pointer but is not a valid one is a ``PointerError`` with one line, never a framework's unpickling error.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptrepo.arguments import is_whole
from ckptrepo.core import is_new_ref_name, is_version_id
from ckptrepo.errors import PointerError, StorageError, first_line
from ckptrepo.storage import replace_file, sync_file

POINTER_KIND = "ckptrepo-checkpoint"   # the "kind" of a pointer file: what tells it from a framework's own file
POINTER_MAX_BYTES = 64 * 1024          # a pointer is a few hundred bytes; anything longer is not one
_MARK = POINTER_KIND.encode()


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the repository, the version, the tag the save gave it, and the committed
    version the path named before (None for a new path)."""

    repository: str
    version: str
    tag: str | None
    step: int | None
    previous: str | None = None

    def to_json(self) -> str:
        doc: dict[str, Any] = {"kind": POINTER_KIND, "format": 1, "repository": self.repository,
                               "version": self.version, "tag": self.tag, "step": self.step}
        if self.previous is not None:
            doc["previous"] = self.previous
        return json.dumps(doc, indent=1) + "\n"


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def remote_fs(path: str) -> tuple[Any, str]:
    """fsspec's file system for a URL such as ``s3://bucket/ck/last.ckpt`` (Lightning installs fsspec), and the
    path in it."""
    import fsspec  # type: ignore[import-untyped]
    fs, where = fsspec.core.url_to_fs(path)
    return fs, where


def local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def path_key(path: str) -> str:
    """One spelling per checkpoint file, for matching a remove with the saves of that path still in flight, and a
    version with the path it was saved for."""
    return path if is_remote(path) else os.path.abspath(local(path))


def _shown(value: Any) -> str:
    """A value from a pointer, as an error message quotes it: bounded, one line."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``; None when there is no file there, or one that is not a pointer (a framework's
    own checkpoint, which its own loader reads). PointerError for a file that says it is a pointer but is not a
    valid one (oversized, cut short, a field of the wrong kind)."""
    path = os.fspath(path)
    try:
        if is_remote(path):
            fs, where = remote_fs(path)
            if not fs.isfile(where):
                return None
            with fs.open(where, "rb") as f:
                raw = f.read(POINTER_MAX_BYTES + 1)
        else:
            mode = os.stat(local(path)).st_mode
            if stat.S_ISDIR(mode):
                return None   # a framework's own sharded checkpoint
            if not stat.S_ISREG(mode):   # a pipe or a device would block the read, or never end
                raise PointerError(f"checkpoint file {path} is no regular file; delete it, or pass the path of a "
                                   f"checkpoint")
            with open(local(path), "rb") as f:   # noqa: PTH123 - a path or a file:// URL
                raw = f.read(POINTER_MAX_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as err:
        raise StorageError(f"cannot read checkpoint file {path}: {first_line(err)}") from None
    if not raw.lstrip().startswith(b"{"):
        return None   # a framework's own format (torch.save writes a zip or a pickle)
    damaged = (f"checkpoint file {path} is a damaged ckptrepo pointer ({{}}); delete it, or load the version by "
               f"its tag or id")
    if len(raw) > POINTER_MAX_BYTES:
        if _MARK in raw:
            raise PointerError(damaged.format(f"longer than {POINTER_MAX_BYTES} bytes"))
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):   # RecursionError: nested deeper than the interpreter's stack allows
        if _MARK in raw:
            raise PointerError(damaged.format("not JSON")) from None
        return None
    if not isinstance(doc, dict) or doc.get("kind") != POINTER_KIND:
        return None
    return _checked(doc, damaged)


def _checked(doc: dict[str, Any], damaged: str) -> Pointer:
    repository, version, tag = doc.get("repository"), doc.get("version"), doc.get("tag")
    step, previous = doc.get("step"), doc.get("previous")
    if not isinstance(repository, str) or not repository or len(repository) > 4096:
        raise PointerError(damaged.format(f"repository {_shown(repository)}"))
    if not isinstance(version, str) or not is_version_id(version):
        raise PointerError(damaged.format(f"version {_shown(version)} is no version id"))
    if tag is not None and not (isinstance(tag, str) and is_new_ref_name(tag)):
        raise PointerError(damaged.format(f"tag {_shown(tag)} is no tag name"))
    if step is not None and (not is_whole(step) or step < 0):
        raise PointerError(damaged.format(f"step {_shown(step)}"))
    if previous is not None and not (isinstance(previous, str) and is_version_id(previous)):
        raise PointerError(damaged.format(f"previous {_shown(previous)} is no version id"))
    return Pointer(repository, version, tag, step, previous)


def write_pointer(path: str | os.PathLike[str], pointer: Pointer, sync: bool = True) -> None:
    """Write the pointer at ``path``, creating its directory; on a local disk by rename, so a reader sees the
    old pointer or the new one, never half of one. ``sync=False`` leaves the fsync to ``sync_pointer`` (the
    training thread writes it; the commit thread makes it durable with its version)."""
    path = os.fspath(path)
    text = pointer.to_json()
    if is_remote(path):
        fs, where = remote_fs(path)
        fs.makedirs(os.path.dirname(where), exist_ok=True)
        with fs.open(where, "w") as f:
            f.write(text)
        return
    path = local(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_file(path, text, sync=sync)


def sync_pointer(path: str | os.PathLike[str]) -> None:
    """fsync the pointer at ``path`` and its directory entry (a remote store's put is durable already)."""
    path = os.fspath(path)
    if is_remote(path):
        return
    sync_file(local(path))


def delete_file(path: str | os.PathLike[str]) -> None:
    """Delete the file (or directory: a framework's own sharded checkpoint) at ``path`` if there is one."""
    path = os.fspath(path)
    if is_remote(path):
        fs, where = remote_fs(path)
        if fs.exists(where):
            fs.rm(where, recursive=True)
        return
    path = local(path)
    if os.path.isdir(path) and not os.path.islink(path):
        import shutil
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def file_exists(path: str | os.PathLike[str]) -> bool:
    path = os.fspath(path)
    if is_remote(path):
        fs, where = remote_fs(path)
        return bool(fs.exists(where))
    return os.path.exists(local(path))


__all__ = ["POINTER_KIND", "POINTER_MAX_BYTES", "Pointer", "delete_file", "file_exists", "is_remote", "local",
           "path_key", "read_pointer", "remote_fs", "sync_pointer", "write_pointer"]
