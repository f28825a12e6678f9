"""A store that hands every operation on to another: the base of the guards put around someone else's store.

Each guard (``_nolinks``: no key through a link; ``_untrusted``: whole-value reads bounded before they download)
checks keys in one place, ``_key`` (and ``_read_key`` for whole-value reads, ``_folder`` for prefixes), and
inherits the rest, so that an operation added to the Store protocol is guarded once, here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.storage.protocol import MAX_VALUE_BYTES, Store

if TYPE_CHECKING:
    import tensorstore as ts


class WrappedStore:
    """``inner``'s operations, each key passed through ``_key`` first (whole-value reads through ``_read_key``,
    listing and deleting prefixes through ``_folder``); its URL and capabilities are ``inner``'s."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url, self.capabilities = inner, inner.url, inner.capabilities

    def _key(self, key: str) -> str:
        """``key`` if this store may touch it; otherwise raises."""
        return key

    def _read_key(self, key: str, max_bytes: int) -> str:
        """``key`` if its whole value may be read (of at most ``max_bytes``); otherwise raises."""
        return self._key(key)

    def _folder(self, prefix: str) -> None:
        """Raise if the keys under ``prefix`` may not be listed or deleted."""

    @property
    def context(self) -> "ts.Context":
        return self.inner.context

    def describe(self) -> str:
        return self.inner.describe()

    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        return self.inner.get(self._read_key(key, max_bytes), max_bytes)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self.inner.get_range(self._key(key), offset, length)

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        return self.inner.get_many([self._read_key(k, max_bytes) for k in keys], max_bytes)

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        return self.inner.get_with_generation(self._read_key(key, max_bytes), max_bytes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._key(key))

    def list(self, prefix: str = "") -> list[str]:
        self._folder(prefix)
        return self.inner.list(prefix)

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(self._key(key), value)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self.inner.put_if_absent(self._key(key), value)

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        return self.inner.compare_and_swap(self._key(key), value, expected_generation)

    def delete(self, key: str) -> None:
        self.inner.delete(self._key(key))

    def delete_prefix(self, prefix: str) -> None:
        self._folder(prefix)
        self.inner.delete_prefix(prefix)

    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        self._key(key_prefix.rstrip("/"))
        return self.inner.child_spec(key_prefix)
