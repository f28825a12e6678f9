"""A local store reached only through its own folders: no key is read or written through a symbolic link.

A repository's own files are the user's, but a remote's (or a clone's source) are whoever wrote them: a link
in its ``data/`` or ``versions/`` folder, or in an object's place, would make a push write, or a clone read,
files outside the location the user named. Every key's path under the root is looked at (``lstat``, each part)
before the key is handed on; the root itself is what the user named and may be a link.
"""
from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.errors import CorruptionError
from ckptrepo.storage.protocol import MAX_VALUE_BYTES, Store

if TYPE_CHECKING:
    import tensorstore as ts


class NoLinkStore:
    """``inner`` (a store of local files under ``root``), refusing every key whose path under ``root`` passes
    through, or ends at, a symbolic link. Its capabilities are ``inner``'s: what a remote's store is used for
    (copies, refs, reads of single objects) goes through these methods, not through direct file I/O."""

    def __init__(self, inner: Store, root: str) -> None:
        self.inner, self.root, self.url = inner, root, inner.url
        self.capabilities = inner.capabilities

    def _check(self, key: str) -> str:
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

    def _check_folder(self, prefix: str) -> None:
        folder = prefix.rpartition("/")[0]
        if folder:
            self._check(folder)

    @property
    def context(self) -> "ts.Context":
        return self.inner.context

    def describe(self) -> str:
        return self.inner.describe()

    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        return self.inner.get(self._check(key), max_bytes)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self.inner.get_range(self._check(key), offset, length)

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        return self.inner.get_many([self._check(k) for k in keys], max_bytes)

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        return self.inner.get_with_generation(self._check(key), max_bytes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._check(key))

    def list(self, prefix: str = "") -> list[str]:
        self._check_folder(prefix)
        return self.inner.list(prefix)

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(self._check(key), value)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self.inner.put_if_absent(self._check(key), value)

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        return self.inner.compare_and_swap(self._check(key), value, expected_generation)

    def delete(self, key: str) -> None:
        self.inner.delete(self._check(key))

    def delete_prefix(self, prefix: str) -> None:
        self._check_folder(prefix)
        self.inner.delete_prefix(prefix)

    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        self._check(key_prefix.rstrip("/"))
        return self.inner.child_spec(key_prefix)
