"""The chunk table that binds an array's stored bytes to the manifest that names it.

Each inner chunk of a shard carries a crc32c, which proves the chunk is as some writer wrote it, not that it
is the chunk the version wrote: a shard copied over another version's, a stale object, or a manifest
re-sealed to point at another version's array reads back with every crc32c valid. So each array has a
table: the crc32c of every inner chunk, in array order, as little-endian uint32 (4 bytes per 64 KiB
chunk), stored as the object ``<array key>/crc32c`` next to the shards. The manifest records the table's
xxh3-64 (``ArrayInfo.digest``). A reader checks the table against that digest once per array, then each
chunk's crc32c against its table entry, which costs a comparison of words it reads anyway, and works for a
partial read of any chunk (docs/decisions/020-content-binding.md).

The table lives beside the array, not in the manifest: a manifest is read whole by ``log``, and the table
of a 100 GB state is 6 MB.

zarr readers ignore the object (it is neither ``zarr.json`` nor a chunk key), so arrays stay plain zarr.
"""
from __future__ import annotations

import numpy as np
import xxhash

from ckptrepo.errors import CorruptionError, some_names
from ckptrepo.storage._arrays import ArrayInfo
from ckptrepo.storage._crc import crc32c
from ckptrepo.storage.protocol import Store

TABLE_NAME = "crc32c"


def table_key(array_key: str) -> str:
    return f"{array_key}/{TABLE_NAME}"


def table_digest(table: np.ndarray) -> int:
    """The digest the manifest records of a table (its little-endian bytes)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(table, dtype="<u4").data)


def chunk_crcs(info: ArrayInfo, raw: np.ndarray) -> np.ndarray:
    """The crc32c of each inner chunk of ``raw`` (the array's bytes from a chunk boundary on); a short last
    chunk is taken with the zeros the sharded layout pads it with, as the stored crc32c covers them."""
    raw = raw.reshape(-1).view(np.uint8)
    cb = info.inner_bytes
    n = -(-raw.nbytes // cb)
    out = np.empty(n, dtype="<u4")
    for k in range(n):
        part = raw[k * cb:(k + 1) * cb]
        crc = crc32c(part)
        if part.nbytes < cb:
            crc = crc32c(np.zeros(cb - part.nbytes, dtype=np.uint8), crc)
        out[k] = crc
    return out


def write_table(store: Store, info: ArrayInfo, table: np.ndarray) -> ArrayInfo:
    """Store the array's chunk table; returns ``info`` with the digest the manifest records."""
    if len(table) != info.chunks:
        raise ValueError(f"a chunk table of {len(table)} entries for the {info.chunks} chunks of {info.key}")
    table = np.ascontiguousarray(table, dtype="<u4")
    store.put(table_key(info.key), table.tobytes())
    return info.with_digest(table_digest(table))


def read_table(store: Store, info: ArrayInfo) -> np.ndarray | None:
    """The array's chunk table, checked against the manifest's digest; None for an array written before tables
    (format 1), which is not content-bound. Raises CorruptionError naming the array otherwise."""
    if info.digest is None:
        return None
    key = table_key(info.key)
    raw = store.get(key, 4 * info.chunks)
    if raw is None:
        raise CorruptionError(f"object {key} is missing: array {info.key} cannot be checked against the "
                              f"manifest that names it; run `ckptrepo fsck`")
    table = np.frombuffer(raw, dtype="<u4") if len(raw) % 4 == 0 else np.empty(0, dtype="<u4")
    if len(table) != info.chunks or table_digest(table) != info.digest:
        raise CorruptionError(f"object {key} does not match the manifest: array {info.key} holds another "
                              f"version's or stale data; run `ckptrepo fsck`")
    return table


def first_mismatch(table: np.ndarray, first_chunk: int, crcs: np.ndarray) -> int | None:
    """The index (into ``crcs``) of the first chunk whose crc32c is not the table's, or None."""
    want = table[first_chunk:first_chunk + len(crcs)]
    if len(want) == len(crcs) and np.array_equal(want, crcs):
        return None
    bad = np.flatnonzero(want != crcs[:len(want)]) if len(want) else np.empty(0, dtype=np.intp)
    return int(bad[0]) if len(bad) else len(want)


def foreign_chunk_error(info: ArrayInfo, chunk: int, names: list[str]) -> CorruptionError:
    """The error for a chunk whose bytes are valid but not the ones the manifest names."""
    shard = chunk // (info.shard_elems // info.inner_elems)
    return CorruptionError(f"object {info.shard_key(shard)} holds data the manifest does not name (inner chunk "
                           f"{chunk} is another version's or stale); tensors: {some_names(names)}; "
                           f"run `ckptrepo fsck`")


__all__ = ["TABLE_NAME", "chunk_crcs", "first_mismatch", "foreign_chunk_error", "read_table",
           "table_digest", "table_key", "write_table"]
