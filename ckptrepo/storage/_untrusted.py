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
from typing import Sequence

from ckptrepo.errors import CorruptionError
from ckptrepo.storage._nolinks import NoLinkStore
from ckptrepo.storage._wrapped import WrappedStore
from ckptrepo.storage.protocol import MAX_VALUE_BYTES, Store

PROBES_AT_ONCE = 16   # a batch's probes in flight together: one round trip's latency for a batch of manifests


def untrusted(store: Store) -> Store:
    """``store`` guarded as a store of someone else's repository (see the module docstring)."""
    root = store.capabilities.file_root or store.capabilities.local_root
    return NoLinkStore(store, root) if root is not None else ProbedStore(store)


def refuse_past(store: Store, key: str, bound: int) -> None:
    """Raise CorruptionError when the object at ``key`` holds more than ``bound`` bytes, asking ``store`` for the
    byte just past the bound (nothing comes back for an object within it), so that it is never downloaded."""
    if store.get_range(key, bound, 1):
        raise CorruptionError(f"object {key} in {store.url} holds more than the {bound} bytes the format allows "
                              f"there (docs/format.md): the repository is damaged or hostile; run `ckptrepo fsck` "
                              f"on it")


class ProbedStore(WrappedStore):
    """``inner`` (an object store), each whole-value read refused, before the value is downloaded, when it holds
    more than its bound."""

    def _read_key(self, key: str, max_bytes: int) -> str:
        refuse_past(self.inner, key, max_bytes)
        return key

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        if len(keys) > 1:   # the probes of a batch in flight together
            with ThreadPoolExecutor(min(PROBES_AT_ONCE, len(keys))) as pool:
                list(pool.map(lambda k: self._read_key(k, max_bytes), keys))
        elif keys:
            self._read_key(keys[0], max_bytes)
        return self.inner.get_many(keys, max_bytes)

