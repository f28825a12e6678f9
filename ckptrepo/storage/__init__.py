"""Storage: the Store protocol, the TensorStore store behind every URL, zarr array geometry, and direct local I/O.

The lowest layer: it knows keys, bytes and arrays, nothing of versions or tensors. ``open_store`` lives here,
beside both the protocol and its implementation, so that neither module imports the other's importer.
"""
from __future__ import annotations

from typing import Any

from ckptrepo.storage._newfolder import check_new_folder
from ckptrepo.storage._tensorstore import TensorStoreStore
from ckptrepo.storage.protocol import NO_VALUE, Store, StoreCapabilities

__all__ = ["NO_VALUE", "Store", "StoreCapabilities", "open_store"]


def open_store(url: str, options: dict[str, Any] | None = None, create: bool = False) -> Store:
    """The store named by ``url`` (a path, ``file://``, ``memory://``, ``s3://`` or ``gs://``), opened without
    touching storage; ``options`` are merged into its TensorStore kvstore spec (e.g. ``{"endpoint": ...}``).
    ``create``: a repository is to be made there, so a local folder is checked to be one that can be made
    (no file in the way), with a one-line StorageError that says what to do.

    TensorStore serves every scheme.
    """
    store = TensorStoreStore.open(url, options)
    if create and store.capabilities.local_root is not None:
        check_new_folder(store.capabilities.local_root, url)
    return store
