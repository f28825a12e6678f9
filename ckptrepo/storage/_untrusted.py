"""Stores of repositories the user does not control (a remote, a clone's source): every read bounded before it
downloads, no key reached through a link.

A whole-value read on an object store learns the value's size only once it has it all (TensorStore tells no size
first), so a bound checked after the read bounds nothing: an object of 20 GB under a ref's key is downloaded
whole first. Reads from such a store first ask for the one byte just past the bound, which a store that honours
byte ranges answers with nothing for a value within it, and only then read the value. A local store looks at a
file's size before reading it, and is guarded against links instead (``_nolinks``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.errors import CorruptionError
from ckptrepo.storage._nolinks import NoLinkStore
from ckptrepo.storage.protocol import MAX_VALUE_BYTES, Store

if TYPE_CHECKING:
    import tensorstore as ts

PROBES_AT_ONCE = 16   # a batch's probes in flight together: one round trip's latency for a batch of manifests


def untrusted(store: Store) -> Store:
    """``store`` guarded as a store of someone else's repository (see the module docstring)."""
    root = store.capabilities.file_root or store.capabilities.local_root
    return NoLinkStore(store, root) if root is not None else ProbedStore(store)


class ProbedStore:
    """``inner`` (an object store), each whole-value read refused, before the value is downloaded, when it holds
    more than its bound."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url, self.capabilities = inner, inner.url, inner.capabilities

    def _probe(self, key: str, max_bytes: int) -> str:
        if self.inner.get_range(key, max_bytes, 1):
            raise CorruptionError(f"object {key} in {self.url} holds more than the {max_bytes} bytes such an object "
                                  f"can hold (docs/format.md): the repository is damaged or hostile; run `ckptrepo "
                                  f"fsck` on it")
        return key

    @property
    def context(self) -> "ts.Context":
        return self.inner.context

    def describe(self) -> str:
        return self.inner.describe()

    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        return self.inner.get(self._probe(key, max_bytes), max_bytes)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self.inner.get_range(key, offset, length)

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        if len(keys) > 1:
            with ThreadPoolExecutor(min(PROBES_AT_ONCE, len(keys))) as pool:
                list(pool.map(lambda k: self._probe(k, max_bytes), keys))
        elif keys:
            self._probe(keys[0], max_bytes)
        return self.inner.get_many(keys, max_bytes)

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        return self.inner.get_with_generation(self._probe(key, max_bytes), max_bytes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(key, value)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self.inner.put_if_absent(key, value)

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        return self.inner.compare_and_swap(key, value, expected_generation)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        return self.inner.child_spec(key_prefix)
