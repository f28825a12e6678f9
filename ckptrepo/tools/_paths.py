"""Local paths the CLI and exports write or read: checked before any work, and never inside a repository.

Kept apart from the export code so that ``ckptrepo metrics --png`` and other history commands check their
output file without importing torch.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ckptrepo.errors import ExchangeError


def local_path(where: str | os.PathLike[str], doing: str) -> Path:
    """``where`` as a local path; a URL is refused (``s3://bucket/x`` would be written to ``./s3:/bucket/x``,
    and the export would report success)."""
    text = os.fspath(where)
    if not text.strip() or "\0" in text:   # the OS refuses a NUL with a bare ValueError
        raise ExchangeError(f"cannot {doing} {text!r}: it is not a file path")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise ExchangeError(f"cannot {doing} {text}: exports and imports are local files and folders; write it "
                            f"to a local path, and copy it from there (or keep it as a version, which any store "
                            f"holds)")
    return Path(text)


def output_file(out: str | os.PathLike[str], force: bool = False, repo_root: str | None = None,
                what: str = "the output") -> Path:
    """The local file a command writes besides its output (``--csv``, ``--png``), checked before anything is
    computed: not a URL, not a folder or a device, not inside the repository at ``repo_root``, in a folder
    that exists or can be made, and not an existing file unless ``force``."""
    path = local_path(out, f"write {what} to")
    refuse_inside(path, repo_root, f"write {what} to")
    if path.is_dir():
        raise ExchangeError(f"{path} is a folder; write {what} to a file path")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise ExchangeError(f"{path} is not a regular file (a device, a FIFO, a broken link); write {what} "
                                f"to a file path")
        if not force:
            raise ExchangeError(f"{path} already exists; pass --force to overwrite it, or write to a new path")
    check_parent(path)
    return path


def output_folder(out: str | os.PathLike[str], repo_root: str | None = None, what: str = "the output") -> Path:
    """The local folder a command writes files into (``--tensorboard``), checked before anything is computed:
    not a URL, not inside the repository at ``repo_root``, a folder or a path where one can be made, and
    writable."""
    path = local_path(out, f"write {what} to")
    refuse_inside(path, repo_root, f"write {what} to")
    if path.exists() and not path.is_dir():
        raise ExchangeError(f"cannot write {what} to {path}: it is a file, not a folder; name a folder")
    check_parent(path / "*", f"write {what} to {path}")
    return path


def refuse_inside(path: Path, repo_root: str | None, doing: str) -> None:
    """Refuse a path inside a local repository's folder (links followed): a file written there could replace
    HEAD, a ref or a manifest, and break the repository."""
    if repo_root is None:
        return
    root = os.path.realpath(repo_root)
    target = os.path.realpath(path)
    if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
        raise ExchangeError(f"cannot {doing} {path}: it is inside the repository {repo_root}; write it outside")


def check_parent(path: Path, doing: str | None = None) -> None:
    """The folder of ``path`` exists or can be made there: checked before the work, not after it."""
    doing = doing or f"write {path}"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ExchangeError(f"cannot {doing}: {parent} is not a folder; write to another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExchangeError(f"cannot {doing}: no permission to write in {parent}; write to another path")


__all__ = ["check_parent", "local_path", "output_file", "output_folder", "refuse_inside"]
