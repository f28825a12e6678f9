"""The storage protocol: what a repository needs from the key-value store under it.

A repository is a set of keys (``HEAD``, ``refs/heads/main``, ``versions/ID``,
``data/ID/...``) relative to its root. Everything above this layer talks to a
:class:`Store`; a backend (TensorStore's drivers, or a second tier in front of
them) implements it, and ``ckptrepo.testing.StoreTests`` checks that it does.

Three things are outside plain key-value access:

* Commits and ref updates need a write that happens only if a key is still what
  the writer last read: :meth:`Store.compare_and_swap` on a *generation*, an
  opaque token from :meth:`Store.get_with_generation`. :data:`NO_VALUE` is the
  generation of an absent key.
* Tensor data lives in zarr v3 arrays that TensorStore's ``zarr3`` driver opens
  itself. A store reaches them through :meth:`Store.child_spec` (the kvstore
  spec of a sub-prefix) and :attr:`Store.context` (the TensorStore context the
  store's own requests share, so a ``memory://`` array lands in the same memory).
* A store whose keys are plain files under a local directory says so in its
  :class:`StoreCapabilities` (``local_root``); the direct read and write paths
  (``_localread``, ``_localwrite``) and local housekeeping (empty folders after
  deletes) use the files only when it does.

Reads of whole values are bounded: ``get`` and its kin refuse a value over
``max_bytes`` (default :data:`MAX_VALUE_BYTES`) with a CorruptionError naming the
key, and a store of local files refuses any file that is not a regular file
(a FIFO, socket or device, which would block or never end) the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["MAX_VALUE_BYTES", "NO_VALUE", "Store", "StoreCapabilities"]

# The generation of an absent key: what ``get_with_generation`` returns for one, and what ``compare_and_swap``
# takes to mean "only if absent". TensorStore's StorageGeneration::NoValue(), so its generations pass unchanged.
NO_VALUE = b"\x02"

# The largest value ``get``, ``get_many`` and ``get_with_generation`` read unless told a smaller bound: the
# format's largest object read whole, a manifest (docs/format.md, "Size limits"). Anything bigger is damage,
# refused before it is read where the store can tell its size first (a local file).
MAX_VALUE_BYTES = 1 << 30


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store offers beyond the protocol's operations, decided once when the store is opened.

    Callers branch on these flags, never on a store's class, URL or driver, so a
    new backend gets the right treatment by declaring what it is.
    """

    # The directory whose files are the store's keys (``root + key``, "/" separated, ending in "/"), for direct
    # local I/O; None where keys are not plain files this process may read and write itself.
    local_root: str | None = None
    # Whether compare_and_swap and put_if_absent are atomic across processes and machines by the store's own
    # making: of racing writers with the same expected generation, at most one succeeds. Commits and ref
    # updates rely on it. False where a server decides (an object store, whose server or gateway may ignore
    # the conditions): a repository then probes the server once before its first ref write (_store_check).
    atomic_conditional_writes: bool = True
    # Whether the store may keep a reference to the buffer passed to ``put`` as the stored value (an in-memory
    # store) instead of copying it before ``put`` returns: a caller that reuses the buffer must pass a copy.
    keeps_written_buffers: bool = False
    # Key endings the store uses for itself (a file store's lock files): such keys are never listed, and are
    # not the caller's to read or write.
    reserved_suffixes: tuple[str, ...] = ()
    # The directory whose files are the store's keys even where its I/O is left to TensorStore (a file store
    # with options): what the store looks at before TensorStore opens a file, which a FIFO would block.
    # ``local_root`` implies it.
    file_root: str | None = None

    def file_path(self, key: str) -> str | None:
        """The file that holds ``key`` under ``file_root`` (or ``local_root``), as ``local_path`` maps keys."""
        return _key_path(self.file_root or self.local_root, key, self.reserved_suffixes)

    def local_path(self, key: str) -> str | None:
        """The file holding ``key`` under ``local_root``, for keys that map plainly onto a path; None otherwise
        (no local root, or a key with empty, ``.`` or ``..`` parts, a NUL or a reserved ending, which the
        store's own operations handle and report)."""
        return _key_path(self.local_root, key, self.reserved_suffixes)


def _key_path(root: str | None, key: str, reserved: tuple[str, ...]) -> str | None:
    if root is None or not key or "\0" in key or key.endswith(reserved):
        return None
    if key[0] == "/" or key[-1] == "/" or "//" in key or ("." in key and any(p in (".", "..") for p in key.split("/"))):
        return None
    return os.path.join(root, key)


@runtime_checkable
class Store(Protocol):
    """A repository's key-value store; every key is relative to the repository root.

    Values are bytes. Absent keys read as None, never as an error; failures of the
    storage itself raise :class:`ckptrepo.errors.StorageError` with a one-line message.
    """

    url: str

    @property
    def capabilities(self) -> StoreCapabilities:
        """What this store offers beyond the operations below (see :class:`StoreCapabilities`)."""
        ...

    @property
    def context(self) -> "ts.Context":
        """The TensorStore context zarr arrays under this store are opened in (with :meth:`child_spec`)."""
        ...

    def describe(self) -> str:
        """One line naming the store for messages and logs."""
        ...

    # ---- reads ----------------------------------------------------------
    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        """The value at ``key``, or None when absent; a value over ``max_bytes`` raises CorruptionError."""
        ...

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """Up to ``length`` bytes of the value at ``key`` from byte ``offset``: fewer where the value ends
        first, empty from or past its end; None when absent. Negative numbers raise ValueError."""
        ...

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        """The values at ``keys`` in their order (None where absent), requested together so that a remote store
        pays one round trip's latency rather than one per key; each bounded by ``max_bytes`` as in :meth:`get`."""
        ...

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        """The value at ``key`` (bounded by ``max_bytes`` as in :meth:`get`) and its generation
        (:data:`NO_VALUE` when absent), the token for :meth:`compare_and_swap`."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (an empty value counts, and so does a file that cannot be one, such
        as a FIFO: something is there, which reading it reports)."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix``, sorted; a prefix is a string, so pass a trailing "/" to list
        one folder and not its siblings (``a/b/`` leaves out ``a/bc``)."""
        ...

    # ---- writes ---------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key``, replacing what is there, durably once this returns."""
        ...

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Create ``key`` unless it holds a value; whether this call created it."""
        ...

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        """Write ``value`` (delete, for None) only if ``key`` is still at ``expected_generation``
        (:data:`NO_VALUE`: only if absent); the new generation when it happened, None when the condition
        failed."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; no error when it is absent."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key that starts with ``prefix`` (a string prefix, as in :meth:`list`)."""
        ...

    # ---- arrays ---------------------------------------------------------
    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        """The TensorStore kvstore spec (JSON) of the keys under ``key_prefix`` + "/": how a zarr array stored
        there is opened, by TensorStore's ``zarr3`` driver in :attr:`context`."""
        ...
