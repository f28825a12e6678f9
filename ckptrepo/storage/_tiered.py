"""A store that reads tensor data missing here from a second store: a local repository in front of its remote.

A lazy clone, and a local tier whose older versions were evicted once pushed, hold every manifest and ref
but not every data object. Readers open a version's arrays through this store instead of the local one: each
data key is read here when it is here, and from the remote otherwise, so a load fetches from the remote only
the byte ranges it needs (TensorStore's zarr3 driver, over the remote's kvstore, reads inner chunks by range).
Everything else (refs, manifests, writes) is the local store's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.storage.protocol import MAX_VALUE_BYTES, StoreCapabilities

if TYPE_CHECKING:
    import tensorstore as ts

    from ckptrepo.storage.protocol import Store

DATA_PREFIX = "data/"


@dataclass
class TieredStore:
    """``local``, with reads of ``data/`` keys it lacks served by ``remote`` (see the module docstring)."""

    local: "Store"
    remote: "Store"
    url: str = field(init=False)
    capabilities: StoreCapabilities = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.local.url
        # no local root: an array may be on either side, so reads go through TensorStore, which opens each
        # array where child_spec says it is
        self.capabilities = StoreCapabilities(
            atomic_conditional_writes=self.local.capabilities.atomic_conditional_writes,
            reserved_suffixes=self.local.capabilities.reserved_suffixes)

    @property
    def context(self) -> "ts.Context":
        # the remote's context carries its request limits and retries; a local file array opens in it too
        return self.remote.context

    def describe(self) -> str:
        return f"{self.local.describe()} with data from {self.remote.describe()}"

    def _source(self, key: str) -> "Store":
        if key.startswith(DATA_PREFIX) and not self.local.exists(key):
            return self.remote
        return self.local

    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        return self._source(key).get(key, max_bytes)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self._source(key).get_range(key, offset, length)

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        return [self.get(k, max_bytes) for k in keys]

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        return self._source(key).get_with_generation(key, max_bytes)

    def exists(self, key: str) -> bool:
        return self.local.exists(key) or (key.startswith(DATA_PREFIX) and self.remote.exists(key))

    def list(self, prefix: str = "") -> list[str]:
        here = self.local.list(prefix)
        if not (prefix.startswith(DATA_PREFIX) or DATA_PREFIX.startswith(prefix)):
            return here
        there = [k for k in self.remote.list(prefix) if k.startswith(DATA_PREFIX)]
        return sorted(set(here) | set(there))

    def put(self, key: str, value: bytes) -> None:
        self.local.put(key, value)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self.local.put_if_absent(key, value)

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        return self.local.compare_and_swap(key, value, expected_generation)

    def delete(self, key: str) -> None:
        self.local.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.local.delete_prefix(prefix)

    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        """The array at ``key_prefix`` where its metadata is: here, or else on the remote."""
        return self._source(key_prefix.rstrip("/") + "/zarr.json").child_spec(key_prefix)
