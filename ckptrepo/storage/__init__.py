"""Storage: the Store protocol, the TensorStore store behind every URL, zarr array geometry, and direct local I/O.

The lowest layer: it knows keys, bytes and arrays, nothing of versions or tensors. ``open_store`` lives here,
beside both the protocol and its implementation, so that neither module imports the other's importer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptrepo._lazy import lazy_exports
from ckptrepo.storage._newfolder import check_new_folder
from ckptrepo.storage._tensorstore import TensorStoreStore
from ckptrepo.storage.protocol import NO_VALUE, Store, StoreCapabilities

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.storage._arrays import (
        COMPRESSIONS,
        INDEX_ENTRY_BYTES,
        INNER_BYTES,
        SHARD_BYTES,
        ZARR_JSON,
        ZARR_JSON_MAX_BYTES,
        ArrayInfo,
        StoredShards,
        array_problem,
        check_compression,
        choose_geometry,
        create_array,
        itemsize,
        layout_bytes,
        numpy_dtype,
        open_array,
        stored_bytes,
    )
    from ckptrepo.storage._atomic_file import fsync_path, replace_file, sync_file
    from ckptrepo.storage._chunktable import (
        chunk_crcs,
        first_mismatch,
        foreign_chunk_error,
        read_table,
        table_key,
        write_table,
    )
    from ckptrepo.storage._crc import crc32c
    from ckptrepo.storage._frames import FrameCheck
    from ckptrepo.storage._localfs import LOCK_SUFFIX, remove_empty_parents
    from ckptrepo.storage._localread import DirectReader, Unexpected, bytes_read, release_reader_threads
    from ckptrepo.storage._localwrite import DIRECT_ALIGN, DirectWriter, LiveShard
    from ckptrepo.storage._piece_digest import (
        M1,
        M2,
        M3,
        POS,
        U64,
        WORDSUM,
        XXH3,
        PieceHasher,
        checkable,
        finish_wordsum,
        mismatch_error,
        mismatch_text,
        piece_digest,
    )
    from ckptrepo.storage._store_check import needs_check, probe_conditional_writes, refusal, store_identity
    from ckptrepo.storage._tensorstore import kvstore_spec_from_url, local_bytes_read
    from ckptrepo.storage._tiered import TieredStore
    from ckptrepo.storage._untrusted import ProbedStore, refuse_past, untrusted

_LAZY = {
    "ckptrepo.storage._arrays": ("ArrayInfo", "COMPRESSIONS", "INDEX_ENTRY_BYTES", "INNER_BYTES", "SHARD_BYTES",
                                 "StoredShards", "ZARR_JSON", "ZARR_JSON_MAX_BYTES", "array_problem",
                                 "check_compression", "choose_geometry", "create_array", "itemsize", "layout_bytes",
                                 "numpy_dtype", "open_array", "stored_bytes"),
    "ckptrepo.storage._atomic_file": ("fsync_path", "replace_file", "sync_file"),
    "ckptrepo.storage._chunktable": ("chunk_crcs", "first_mismatch", "foreign_chunk_error", "read_table", "table_key",
                                     "write_table"),
    "ckptrepo.storage._crc": ("crc32c",),
    "ckptrepo.storage._frames": ("FrameCheck",),
    "ckptrepo.storage._localfs": ("LOCK_SUFFIX", "remove_empty_parents"),
    "ckptrepo.storage._localread": ("DirectReader", "Unexpected", "bytes_read", "release_reader_threads"),
    "ckptrepo.storage._localwrite": ("DIRECT_ALIGN", "DirectWriter", "LiveShard"),
    "ckptrepo.storage._piece_digest": ("M1", "M2", "M3", "POS", "PieceHasher", "U64", "WORDSUM", "XXH3", "checkable",
                                       "finish_wordsum", "mismatch_error", "mismatch_text", "piece_digest"),
    "ckptrepo.storage._store_check": ("needs_check", "probe_conditional_writes", "refusal", "store_identity"),
    "ckptrepo.storage._tensorstore": ("kvstore_spec_from_url", "local_bytes_read"),
    "ckptrepo.storage._tiered": ("TieredStore",),
    "ckptrepo.storage._untrusted": ("ProbedStore", "refuse_past", "untrusted"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["ArrayInfo", "COMPRESSIONS", "DIRECT_ALIGN", "DirectReader", "DirectWriter", "FrameCheck",
           "INDEX_ENTRY_BYTES", "INNER_BYTES", "LOCK_SUFFIX", "LiveShard", "M1", "M2", "M3", "NO_VALUE", "POS",
           "PieceHasher", "ProbedStore", "SHARD_BYTES", "Store", "StoreCapabilities", "StoredShards",
           "TensorStoreStore", "TieredStore", "U64", "Unexpected", "WORDSUM", "XXH3", "ZARR_JSON",
           "ZARR_JSON_MAX_BYTES", "array_problem", "bytes_read", "check_compression", "checkable", "choose_geometry",
           "chunk_crcs", "crc32c", "create_array", "finish_wordsum", "first_mismatch", "foreign_chunk_error",
           "fsync_path", "itemsize", "kvstore_spec_from_url", "layout_bytes", "local_bytes_read", "mismatch_error",
           "mismatch_text", "needs_check", "numpy_dtype", "open_array", "open_store", "piece_digest",
           "probe_conditional_writes", "read_table", "refusal", "refuse_past", "release_reader_threads",
           "remove_empty_parents", "replace_file", "store_identity", "stored_bytes", "sync_file", "table_key",
           "untrusted", "write_table"]
# End of facade.


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
