"""Whether a repository can be made in a local folder, asked of the OS before TensorStore writes there.

TensorStore reports a file in the way, a name too long or a link loop in its own words, with a status code
and the errno; asked first, the OS's answer becomes a one-line error that says what to do.
"""
from __future__ import annotations

import os

from ckptrepo.errors import StorageError, os_error_hint


def check_new_folder(root: str, url: str) -> None:
    """The folder ``root`` exists or can be made: its nearest existing ancestor (itself included) is a folder,
    and every name on the way can be looked up."""
    path = os.path.abspath(root)
    while True:
        try:
            os.stat(path)
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent
        except OSError as err:
            raise StorageError(f"cannot create a repository at {url}: {err.strerror}; {os_error_hint(err)}") from None
    if not os.path.isdir(path):
        where = "it is" if path == os.path.abspath(root) else f"{path} is"
        raise StorageError(f"cannot create a repository at {url}: {where} a file, not a folder; name a new or "
                           f"empty folder")


__all__ = ["check_new_folder"]
