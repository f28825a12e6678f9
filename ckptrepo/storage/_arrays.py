"""Flat 1-D zarr v3 arrays, one per (version, rank, dtype), written through TensorStore.

Each array is cut into shards (one storage object each, ``c/<i>``) of
``shard_elems`` elements; inside a shard, inner chunks of ``inner_elems``
elements each carry a crc32c, so a partial read fetches and verifies only the
inner chunks it touches. Missing chunks are an error, never silently zeros.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ckptrepo.storage.protocol import Store

SHARD_BYTES = 64 << 20
INNER_BYTES = 64 << 10
MISSING_CHUNK = (1 << 64) - 1   # a shard index entry (offset and size) of an absent inner chunk

_BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


@dataclass(frozen=True)
class ArrayInfo:
    """What the manifest records about one flat array."""

    key: str            # e.g. "data/<version>/0/float32"
    dtype: str
    numel: int
    shard_elems: int
    inner_elems: int
    digest: int | None = None   # xxh3-64 of the chunk table (storage/_chunktable.py); None: written before format 2

    def with_digest(self, digest: int) -> "ArrayInfo":
        return dataclasses.replace(self, digest=digest)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def inner_bytes(self) -> int:
        """Bytes of one inner chunk (the unit every crc32c covers)."""
        return self.inner_elems * self.itemsize

    def shard_key(self, index: int) -> str:
        return f"{self.key}/c/{index}"

    def shards(self) -> range:
        return range((self.numel + self.shard_elems - 1) // self.shard_elems)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "numel": self.numel, "shard_elems": self.shard_elems,
                             "inner_elems": self.inner_elems}
        if self.digest is not None:
            d["digest"] = self.digest
        return d

    @classmethod
    def from_json(cls, key: str, d: dict[str, Any]) -> "ArrayInfo":
        return cls(key=key, dtype=d["dtype"], numel=d["numel"], shard_elems=d["shard_elems"],
                   inner_elems=d["inner_elems"], digest=d.get("digest"))


INDEX_ENTRY_BYTES = 16   # a shard index's (offset, length) per inner chunk, uint64 each


def layout_bytes(info: ArrayInfo) -> int:
    """The sharded layout's size of array ``info``: every inner chunk whole with its crc32c (the last one
    padded) and each shard's index. Its tensor bytes alone (``nbytes``) leave out the padding of small arrays'
    last chunks, so ``du`` would report less than the repository holds."""
    chunks = -(-info.numel // info.inner_elems)
    per_shard = info.shard_elems // info.inner_elems
    return chunks * (info.inner_bytes + 4) + len(info.shards()) * (per_shard * INDEX_ENTRY_BYTES + 4)


def stored_bytes(store: Store, key: str, estimate: int) -> int:
    """What array ``key`` takes in ``store``: its objects' sizes on a local store (chunks written from memory
    sit in 512 or 4096-byte slots there), else ``estimate`` (``layout_bytes``: object stores are not asked)."""
    path = store.capabilities.local_path(key)
    if path is not None and os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return estimate


@functools.cache
def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype TensorStore uses for a zarr data type (ml_dtypes for bfloat16 and float8).

    Cached: read planning asks once per piece, and TensorStore's lookup is not free.
    """
    return ts.dtype(dtype).numpy_dtype


def itemsize(dtype: str) -> int:
    """Bytes per element of a zarr data type."""
    return numpy_dtype(dtype).itemsize


def choose_geometry(dtype: str, numel: int, shard_bytes: int = SHARD_BYTES,
                    inner_bytes: int = INNER_BYTES) -> tuple[int, int]:
    """Shard and inner-chunk sizes in elements; neither exceeds what the array needs, in whole pages for the
    inner chunk (a 16-element array in a 64 KiB chunk would take 64 KiB of storage for 64 bytes, so a tiny
    state would cost ~1000x its size on disk; pages, because chunks written from memory sit in page-aligned slots)."""
    item = itemsize(dtype)
    page = max(1, 4096 // item)
    inner = max(1, min(inner_bytes // item, -(-numel // page) * page))
    shard = max(inner, (shard_bytes // item) // inner * inner)
    needed = max(inner, -(-numel // inner) * inner)
    return min(shard, needed), inner


def zarr_metadata(info: ArrayInfo) -> dict[str, Any]:
    return {
        "shape": [info.numel],
        "data_type": info.dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [info.shard_elems]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [info.inner_elems],
            "codecs": [_BYTES_CODEC, _CRC],
            "index_codecs": [_BYTES_CODEC, _CRC],
            "index_location": "end",
        }}],
    }


_PLAIN_METADATA_KEYS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                                  "fill_value", "codecs", "attributes", "dimension_names", "storage_transformers"})


def _zero_fill(value: Any) -> bool:
    """Whether a ``fill_value`` is zero (complex types: a pair of zeros)."""
    if isinstance(value, list):
        return len(value) == 2 and all(_zero_fill(v) for v in value)
    return isinstance(value, (int, float)) and value == 0


def metadata_matches(info: ArrayInfo, stored: Any) -> bool:
    """Whether a parsed ``zarr.json`` describes exactly the array the manifest says (defaults filled in).

    The direct local read path checks this instead of opening the array
    through TensorStore, which is slow per array on a cold load; anything that
    does not match is left to TensorStore to judge.
    """
    if not isinstance(stored, dict) or stored.get("zarr_format") != 3 or stored.get("node_type") != "array":
        return False
    # anything else TensorStore would have to understand (storage transformers, extensions), or a fill value
    # other than the zeros create_array leaves, is TensorStore's to judge: it refuses what it cannot read
    if set(stored) - _PLAIN_METADATA_KEYS or stored.get("storage_transformers", []) != [] \
            or not _zero_fill(stored.get("fill_value")):
        return False
    want = zarr_metadata(info)
    try:
        got_cfg = dict(stored["codecs"][0]["configuration"])
        got_cfg.setdefault("index_location", "end")
        if info.itemsize == 1:   # TensorStore leaves out the byte order of one-byte types (int8, bool, ...)
            got_cfg["codecs"] = [_BYTES_CODEC if c == {"name": "bytes"} else c for c in got_cfg.get("codecs", [])]
        return (stored["shape"] == want["shape"] and stored["data_type"] == want["data_type"]
                and stored["chunk_grid"] == want["chunk_grid"]
                and stored["chunk_key_encoding"].get("name") == "default"
                and stored["chunk_key_encoding"].get("configuration", {}).get("separator", "/") == "/"
                and len(stored["codecs"]) == 1 and stored["codecs"][0]["name"] == "sharding_indexed"
                and got_cfg == want["codecs"][0]["configuration"])
    except (KeyError, IndexError, TypeError, AttributeError):
        return False


def create_array(store: Store, info: ArrayInfo) -> ts.TensorStore:
    """Create the array (writes its ``zarr.json``) and return a handle for writing."""
    spec = {"driver": "zarr3", "kvstore": store.child_spec(info.key), "metadata": zarr_metadata(info),
            "create": True, "store_data_equal_to_fill_value": True}
    return ts.open(spec, context=store.context).result()


def open_array(store: Store, info: ArrayInfo) -> ts.TensorStore:
    """Open an existing array for reading; its metadata must match the manifest's."""
    spec = {"driver": "zarr3", "kvstore": store.child_spec(info.key), "metadata": zarr_metadata(info),
            "open": True, "fill_missing_data_reads": False, "recheck_cached_data": False}
    return ts.open(spec, context=store.context, read=True).result()
