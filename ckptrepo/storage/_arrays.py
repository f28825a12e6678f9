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
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptrepo.errors import ArgumentError
from ckptrepo.storage._localfs import file_kind, look
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:   # imported where used: history commands never open an array (see ckptrepo.cli)
    import numpy as np
    import tensorstore as ts

SHARD_BYTES = 64 << 20
INNER_BYTES = 64 << 10
MISSING_CHUNK = (1 << 64) - 1   # a shard index entry (offset and size) of an absent inner chunk

_BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}

# The lossless compressions an array may be stored with (``ArrayInfo.compression``; docs/format.md). "zstd": each
# inner chunk through zarr v3's standard ``blosc`` codec (zstd after a byte shuffle), which TensorStore and
# zarr-python both read (docs/decisions/035-zstd-compression.md).
COMPRESSIONS = ("zstd",)
BLOSC_CLEVEL = 1            # blosc's level 1 is zstd's level 1: most of the ratio at the highest speed
BLOSC_HEADER_BYTES = 16     # the least a blosc frame takes (its header): what a compressed chunk holds at least


def blosc_codec(itemsize: int) -> dict[str, Any]:
    """The inner-chunk codec of a "zstd" array: shuffling each element's bytes first groups the floating-point
    exponents, which compress, apart from the mantissas, which barely do."""
    return {"name": "blosc", "configuration": {"cname": "zstd", "clevel": BLOSC_CLEVEL, "shuffle": "shuffle",
                                               "typesize": itemsize, "blocksize": 0}}


@dataclass(frozen=True)
class ArrayInfo:
    """What the manifest records about one flat array."""

    key: str            # e.g. "data/<version>/0/float32"
    dtype: str
    numel: int
    shard_elems: int
    inner_elems: int
    digest: int | None = None   # xxh3-64 of the chunk table (storage/_chunktable.py); None: written before format 2
    compression: str | None = None   # one of COMPRESSIONS, or None: inner chunks stored as their bytes

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

    @property
    def chunks(self) -> int:
        """How many inner chunks the array has (the last one padded)."""
        return -(-self.numel // self.inner_elems)

    def shard_key(self, index: int) -> str:
        return f"{self.key}/c/{index}"

    def shards(self) -> range:
        return range((self.numel + self.shard_elems - 1) // self.shard_elems)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "numel": self.numel, "shard_elems": self.shard_elems,
                             "inner_elems": self.inner_elems}
        if self.digest is not None:
            d["digest"] = self.digest
        if self.compression is not None:   # absent for plain arrays: their records stay as older releases wrote them
            d["compression"] = self.compression
        return d

    @classmethod
    def from_json(cls, key: str, d: dict[str, Any]) -> "ArrayInfo":
        return cls(key=key, dtype=d["dtype"], numel=d["numel"], shard_elems=d["shard_elems"],
                   inner_elems=d["inner_elems"], digest=d.get("digest"), compression=d.get("compression"))


INDEX_ENTRY_BYTES = 16   # a shard index's (offset, length) per inner chunk, uint64 each
ZARR_JSON = "zarr.json"
ZARR_JSON_MAX_BYTES = 1 << 20   # an array's metadata is a few hundred bytes; a bigger one is damage

# What a manifest may declare of an array: generous beside what this release writes (shards of at most
# SHARD_BYTES in inner chunks of 4 to 64 KiB), so that other geometries still read, and tight enough that a
# declared size cannot make a reader allocate what no store holds (docs/format.md, "Size limits").
MAX_SHARD_BYTES = 4 << 30        # one shard object's data
MAX_INDEX_ENTRIES = 1 << 20      # inner chunks per shard: a shard index of at most 16 MiB
MAX_SHARDS = 1 << 24             # shard objects per array
MAX_ARRAY_BYTES = 1 << 50        # one array's data (one rank's tensors of one dtype)
_ARRAY_KEY = re.compile(r"data/[0-9a-f]{32}/(?:0|[1-9][0-9]{0,8})/([a-z][a-z0-9_]{0,31})")


def shard_index(raw: bytes, per_shard: int) -> "np.ndarray | None":
    """A shard's index as read from the object's end (``per_shard`` pairs of little-endian uint64 offset and
    size, then their crc32c): an ``[per_shard, 2]`` array when it is whole and its crc32c holds, else None."""
    import numpy as np

    from ckptrepo.storage._crc import crc32c
    if len(raw) != per_shard * INDEX_ENTRY_BYTES + 4 or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        return None
    return np.frombuffer(raw, dtype="<u8", count=2 * per_shard).reshape(per_shard, 2)


def _count(value: Any) -> bool:
    return type(value) is int


def array_problem(info: ArrayInfo) -> str | None:
    """What makes an array record unsafe to read, or None: a key that is not ``data/<id>/<rank>/<dtype>``
    (``..`` or an absolute path would make a local read open files outside the repository), or a geometry
    that is not positive whole numbers within the bounds above (a declared 16 GiB shard index would be
    allocated before a byte of it is read).

    A crc32c proves a manifest's bytes are as sealed, not that whoever sealed them was this writer."""
    match = _ARRAY_KEY.fullmatch(info.key) if isinstance(info.key, str) else None
    if match is None:
        return f"array key {str(info.key)[:80]!r} is not data/<id>/<rank>/<dtype>"
    if info.dtype != match.group(1):
        return f"array {info.key} is said to hold {str(info.dtype)[:20]!r}, not the dtype its key names"
    if info.compression is not None and info.compression not in COMPRESSIONS:
        return f"array {info.key} is stored with compression {str(info.compression)[:20]!r}, which this ckptrepo " \
               f"does not read; upgrade ckptrepo (pip install -U ckptrepo)"
    try:
        item = itemsize(info.dtype)
    except Exception:  # noqa: BLE001 - TensorStore raises ValueError and friends for a name it does not know
        return f"array {info.key} has dtype {info.dtype!r}, which is no zarr data type"
    numel, shard, inner = info.numel, info.shard_elems, info.inner_elems
    if not (_count(numel) and _count(shard) and _count(inner)) or numel < 0 or shard < 1 or inner < 1:
        return f"array {info.key} has a geometry of no whole sizes (numel {numel!r}, shard_elems {shard!r}, " \
               f"inner_elems {inner!r})"
    if shard % inner:
        return f"array {info.key} has shards of {shard} elements, not a whole number of {inner}-element chunks"
    index_bound = MAX_INDEX_ENTRIES * INDEX_ENTRY_BYTES
    for what, value, bound in (("shards of", shard * item, MAX_SHARD_BYTES),
                               ("a shard index of", shard // inner * INDEX_ENTRY_BYTES, index_bound),
                               ("a size of", numel * item, MAX_ARRAY_BYTES)):
        if value > bound:
            return f"array {info.key} declares {what} {value} bytes, more than the {bound} the format allows"
    if -(-numel // shard) > MAX_SHARDS:
        return f"array {info.key} declares {-(-numel // shard)} shards, more than the {MAX_SHARDS} the format allows"
    return None


def shard_floor(info: ArrayInfo, index: int) -> int:
    """The fewest bytes shard object ``index`` holds when whole: each of its inner chunks (the last one padded;
    compressed, at least a blosc header) with its crc32c, then the index of every chunk the shard can hold, with
    its crc32c. Chunks written from memory may sit further apart (localwrite), never closer."""
    lo = index * info.shard_elems
    chunks = -(-(min(info.numel, lo + info.shard_elems) - lo) // info.inner_elems)
    chunk = BLOSC_HEADER_BYTES if info.compression is not None else info.inner_bytes
    return chunks * (chunk + 4) + info.shard_elems // info.inner_elems * INDEX_ENTRY_BYTES + 4


class StoredShards:
    """What a store holds of an array's shard objects, looked at without reading them, so that sizes a
    manifest declares are checked against the objects before anyone allocates for them.

    On a store of local files each shard's file is looked at (a missing, short or non-regular file is
    named); elsewhere the array's shards are listed once (a missing object is named; a short one is left
    to its read, which fails on it)."""

    def __init__(self, store: Store, info: ArrayInfo) -> None:
        self.store, self.info = store, info
        self._present: set[int] | None = None
        self._seen: dict[int, str | None] = {}

    def present(self) -> set[int]:
        """The indices of the shard objects the store lists (listed once: what is stored, whatever the
        manifest declares)."""
        if self._present is None:
            prefix = f"{self.info.key}/c/"
            names = (key[len(prefix):] for key in self.store.list(prefix))
            self._present = {int(n) for n in names if n.isascii() and n.isdigit() and len(n) < 10}
        return self._present

    def problem(self, index: int) -> str | None:
        """What is wrong with shard object ``index`` as stored, or None: "missing", or why it cannot hold
        the declared shard (each shard looked at once)."""
        if index not in self._seen:
            self._seen[index] = self._look(index)
        return self._seen[index]

    def _look(self, index: int) -> str | None:
        key = self.info.shard_key(index)
        path = self.store.capabilities.file_path(key)
        if path is None:
            return None if index in self.present() else "missing"
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        except OSError:
            return None   # its read reports it
        if not stat.S_ISREG(st.st_mode):
            return f"{file_kind(st.st_mode)}, not a file"
        want = shard_floor(self.info, index)
        if st.st_size < want:
            return f"{st.st_size} bytes, fewer than the {want} its declared chunks and index take"
        return None


def layout_bytes(info: ArrayInfo) -> int:
    """The sharded layout's size of array ``info``: every inner chunk whole with its crc32c (the last one
    padded) and each shard's index. Its tensor bytes alone (``nbytes``) leave out the padding of small arrays'
    last chunks, so ``du`` would report less than the repository holds. For a compressed array it is the
    most it takes, as if nothing compressed (what it holds is known only from its objects' sizes)."""
    per_shard = info.shard_elems // info.inner_elems
    return info.chunks * (info.inner_bytes + 4) + len(info.shards()) * (per_shard * INDEX_ENTRY_BYTES + 4)


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
    import tensorstore as ts
    return ts.dtype(dtype).numpy_dtype


# bytes per element of the zarr data types the writers store, known without TensorStore (``show`` and ``du``
# size tensors from their manifests; asking TensorStore would import it, and numpy, for a table)
ITEMSIZES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
             "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of a zarr data type."""
    size = ITEMSIZES.get(dtype)
    return size if size is not None else numpy_dtype(dtype).itemsize


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
            "codecs": [_BYTES_CODEC, _CRC] if info.compression is None
            else [_BYTES_CODEC, blosc_codec(info.itemsize), _CRC],
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


def check_compression(value: Any, what: str = "compression") -> str | None:
    """``value`` as an ``ArrayInfo.compression`` (None: off); ArgumentError for anything but the accepted values."""
    if value is None or value is False or value == "none":
        return None
    if isinstance(value, str) and value in COMPRESSIONS:
        return value
    accepted = ", ".join(repr(c) for c in COMPRESSIONS)
    raise ArgumentError(f"{what} must be {accepted}, 'none' or None, not {value!r:.40}")


def create_array(store: Store, info: ArrayInfo) -> ts.TensorStore:
    """Create the array (writes its ``zarr.json``) and return a handle for writing."""
    spec = {"driver": "zarr3", "kvstore": store.child_spec(info.key), "metadata": zarr_metadata(info),
            "create": True, "store_data_equal_to_fill_value": True}
    import tensorstore as ts
    return ts.open(spec, context=store.context).result()


def open_array(store: Store, info: ArrayInfo) -> ts.TensorStore:
    """Open an existing array for reading; its metadata must match the manifest's. On a file store its
    ``zarr.json`` is looked at first: TensorStore would block on a FIFO, or read a huge file whole."""
    key = f"{info.key}/{ZARR_JSON}"
    look(store.capabilities.file_path(key), key, ZARR_JSON_MAX_BYTES)
    spec = {"driver": "zarr3", "kvstore": store.child_spec(info.key), "metadata": zarr_metadata(info),
            "open": True, "fill_missing_data_reads": False, "recheck_cached_data": False}
    import tensorstore as ts
    return ts.open(spec, context=store.context, read=True).result()
