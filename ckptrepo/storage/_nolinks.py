"""A local store reached only through its own folders: no key is read or written through a symbolic link.

A repository's own files are the user's, but a remote's (or a clone's source) are whoever wrote them: a link
in its ``data/`` or ``versions/`` folder, or in an object's place, would make a push write, or a clone read,
files outside the location the user named. Every key's path under the root is looked at (``lstat``, each part)
before the key is handed on; the root itself is what the user named and may be a link.
"""
from __future__ import annotations

import os
import stat

from ckptrepo.errors import CorruptionError
from ckptrepo.storage._wrapped import WrappedStore
from ckptrepo.storage.protocol import Store


class NoLinkStore(WrappedStore):
    """``inner`` (a store of local files under ``root``), refusing every key whose path under ``root`` passes
    through, or ends at, a symbolic link. Its capabilities are ``inner``'s: what a remote's store is used for
    (copies, refs, reads of single objects) goes through these methods, not through direct file I/O."""

    def __init__(self, inner: Store, root: str) -> None:
        super().__init__(inner)
        self.root = root

    def _key(self, key: str) -> str:
        path = self.root
        for part in key.split("/"):
            if part in ("", ".", ".."):
                break   # not a plain path: the store's own operations refuse it
            path = os.path.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break   # nothing there yet: no link to pass through
            if stat.S_ISLNK(mode):
                rel = os.path.relpath(path, self.root)
                raise CorruptionError(f"{rel} in {self.url} is a symbolic link, which ckptrepo never follows inside "
                                      f"a remote; remove the link (or put what it points at in its place)")
        return key

    def _folder(self, prefix: str) -> None:
        folder = prefix.rpartition("/")[0]
        if folder:
            self._key(folder)
