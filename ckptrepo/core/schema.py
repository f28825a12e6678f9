"""The version manifest's schema: typed records for what ``versions/<id>`` holds, and its one encoder and decoder.

docs/format.md describes the format; these classes are its shape in code. A manifest is decoded into them
once (and cached by the handle that read it), every field checked on the way ("validation on decode"
below), and everything above reads attributes, never string keys, and trusts their types.

Byte compatibility: ``encode_manifest(decode_manifest(blob))`` gives back ``blob``. msgpack keeps map keys in
insertion order, and the two writers order the top-level keys differently (a single-process snapshot
writes the header first, a merged distributed one its layout first), so a manifest remembers the order of
the keys it was decoded from (``key_order``) and any key this release does not know (``extra``), and the
encoder writes them back in that order. Tuples and lists encode alike, so records hold tuples.

The records of a version's tensor table (``TensorEntry``, ``Piece``) are NamedTuples: a load decodes
thousands of them, and a NamedTuple is built by ``tuple.__new__``, where a frozen dataclass sets each field
through ``object.__setattr__``, several times slower. Array records are ``ArrayInfo`` (storage/_arrays.py),
the one definition the storage layer reads and writes arrays with; storage cannot import core.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptrepo.core._boxes import Box, intersect, volume
from ckptrepo.core._manifest import BULKY_FIELDS, VERSIONS_PREFIX, Version, seal, unseal, unseal_header
from ckptrepo.core._moments import Moments
from ckptrepo.errors import CorruptionError, UnsupportedValueError
from ckptrepo.storage._arrays import ArrayInfo, array_problem
from ckptrepo.storage.protocol import MAX_VALUE_BYTES

Tree = Any   # a state skeleton: an opaque msgpack node (docs/format.md, state/_skeleton.py)

# The top-level key order each writer produces: a single-process snapshot's manifest, and one merged from
# the ranks of a distributed snapshot (the merged parts, then the header). ``stats`` comes last in both.
SINGLE_PROCESS_ORDER = ("format_version", "id", "parents", "step", "time", "message", "metrics", "host",
                        "layout", "size", "arrays", "tensors", "tree")
MERGED_ORDER = ("layout", "arrays", "tensors", "size", "tree",
                "format_version", "id", "parents", "step", "time", "message", "metrics", "host")


class Piece(NamedTuple):
    """A part of a tensor: the elements of ``box`` (global coordinates), stored contiguous and row-major in
    array ``array`` from element ``offset`` on. ``digest``: the content digest of those bytes (an algorithm
    byte and 16 bytes, saving/_content_hash.py), which a later snapshot compares to reuse them; None where
    they were not hashed."""

    box: Box
    array: str
    offset: int
    digest: bytes | None = None

    def to_raw(self) -> dict[str, Any]:
        raw = {"box": self.box, "array": self.array, "offset": self.offset}
        if self.digest is not None:
            raw["digest"] = self.digest
        return raw


DIGEST_BYTES = 17   # what this release writes; a reader takes any algorithm byte and hash up to 64 bytes


def _piece(p: dict[str, Any]) -> Piece:
    offs, sizes = p["box"]
    return Piece((tuple(offs), tuple(sizes)), p["array"], p["offset"], _digest(p.get("digest"), "a piece"))


def _digest(raw: Any, what: str) -> bytes | None:
    """A piece's ``digest`` field, checked (raises FieldError)."""
    if raw is None or type(raw) is bytes and 2 <= len(raw) <= 65:
        return raw
    raise FieldError(f"{what} has the digest {_short(raw)}, not an algorithm byte and a hash")


class TensorEntry(NamedTuple):
    """A tensor of a version: its logical name, dtype name, global shape, and the pieces that cover it exactly
    once (none for a zero-element tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return volume(self.shape)

    @property
    def array(self) -> str | None:
        """The array of a tensor stored whole (one piece), as a single-process snapshot stores every tensor;
        None for a zero-element tensor."""
        return self.pieces[0].array if self.pieces else None

    @property
    def offset(self) -> int:
        """The element offset of a tensor stored whole (see ``array``); 0 for a zero-element tensor."""
        return self.pieces[0].offset if self.pieces else 0

    def to_raw(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape,
                "pieces": [p.to_raw() for p in self.pieces]}


@dataclass(frozen=True, slots=True)
class RankRecord:
    """One saved rank of a version's layout. A single-process version's only record is ``{rank: 0}``
    (``leaf_names`` None); a distributed one keeps each rank's coordinates, tree and tensor leaves' names."""

    rank: int
    coords: dict[str, int] | None = None   # {tp, pp, dp}; None when saved without a ParallelLayout
    tree: Tree = None
    leaf_names: tuple[str, ...] | None = None   # the stored name of each of ``tree``'s tensor leaves

    def to_raw(self) -> dict[str, Any]:
        if self.leaf_names is None:
            return {"rank": self.rank}
        return {"rank": self.rank, "coords": self.coords, "tree": self.tree, "leaf_names": self.leaf_names}


@dataclass(frozen=True, slots=True)
class LayoutRecord:
    """The layout a version was saved from: its world size and ranks, and for a ParallelLayout its degrees
    and rules (``Rules.to_json()``); ``tp`` is None for a version saved without one."""

    world_size: int
    ranks: tuple[RankRecord, ...]
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    rules: dict[str, Any] | None = None

    def to_raw(self) -> dict[str, Any]:
        ranks = [r.to_raw() for r in self.ranks]
        if self.tp is None:
            return {"world_size": self.world_size, "ranks": ranks}
        d: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero": self.zero,
                             "world_size": self.world_size}
        if self.rules is not None:
            d["rules"] = self.rules
        d["ranks"] = ranks
        return d


SINGLE_PROCESS_LAYOUT = LayoutRecord(1, (RankRecord(0),))


# The per-tensor statistics a snapshot records while it captures (``Manifest.tensor_stats``): the
# summary of its values, then the change from the parent version (NaN where it was not measured).
STAT_COLUMNS = ("norm", "mean", "std", "min", "max", "absmax", "nan", "inf", "delta", "relative-change")


@dataclass(frozen=True, slots=True)
class TensorStatsRecord:
    """Statistics of a version's tensors taken at capture time: one row of ``columns`` per name, as
    little-endian float64 (``values``). NaN marks a value that was not measured. Names are repeated here,
    apart from the tensor table, so a trajectory over thousands of versions decodes only this field."""

    names: tuple[str, ...]
    columns: tuple[str, ...]
    values: bytes

    def to_raw(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "names": list(self.names), "values": self.values}

    def column(self, name: str) -> list[float]:
        """Every tensor's value of column ``name`` (all NaN when this record has no such column)."""
        if name not in self.columns:
            return [math.nan] * len(self.names)
        k, width = self.columns.index(name), len(self.columns)
        return list(struct.unpack_from(f"<{len(self.names) * width}d", self.values)[k::width])

    def rows(self) -> dict[str, dict[str, float]]:
        """Per tensor name: its recorded columns."""
        flat = struct.unpack_from(f"<{len(self.names) * len(self.columns)}d", self.values)
        width = len(self.columns)
        return {n: dict(zip(self.columns, flat[i * width:(i + 1) * width])) for i, n in enumerate(self.names)}

    @classmethod
    def of_rows(cls, names: list[str], rows: list[tuple[float, ...]],
                columns: tuple[str, ...] = STAT_COLUMNS) -> "TensorStatsRecord":
        flat = [v for r in rows for v in r]
        return cls(tuple(names), columns, struct.pack(f"<{len(flat)}d", *flat))


def tensor_stats_record(raw: Any) -> TensorStatsRecord | None:
    """The ``tensor_stats`` field, checked (raises FieldError)."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise FieldError(f"field 'tensor_stats' is {type(raw).__name__}, not a map")
    columns, names, values = raw.get("columns"), raw.get("names"), raw.get("values")
    if type(columns) is not list or not all(type(c) is str for c in columns):
        raise FieldError("field 'tensor_stats' has no list of column names")
    if type(names) is not list or not all(type(n) is str for n in names):
        raise FieldError("field 'tensor_stats' has no list of tensor names")
    if type(values) is not bytes or len(values) != 8 * len(columns) * len(names):
        raise FieldError(f"field 'tensor_stats' holds {len(values) if type(values) is bytes else 'no'} bytes of "
                         f"values, not 8 per column of each of its {len(names)} tensors")
    return TensorStatsRecord(tuple(names), tuple(columns), values)


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestHeader:
    """A version manifest's small fields: all that ``log``, revision walks and gc's age checks read, decoded
    without the bulky tensor table, arrays, tree and layout (``unseal_header``)."""

    format_version: int | None
    id: str
    parents: tuple[str, ...]
    step: int | None
    time: float
    message: str
    metrics: dict[str, Any]
    host: str | None
    size: int
    stats: dict[str, Any] | None = None   # the snapshotter's timings; absent from some versions
    meta: dict[str, str] | None = None    # free text the snapshot was given (a tracker's run id, a file name)
    key_order: tuple[str, ...] = field(default=SINGLE_PROCESS_ORDER, compare=False, repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)   # keys this release does not know

    def header(self) -> "ManifestHeader":
        """This manifest's header alone: what a handle caches of a version it committed, as ``decode_header``
        reads it (the bulky keys left out of ``key_order`` too)."""
        fields = _header_values(self)
        fields["key_order"] = tuple(k for k in self.key_order if k not in BULKY_FIELDS)
        return ManifestHeader(**fields)


def _header_values(h: ManifestHeader) -> dict[str, Any]:
    return {f.name: getattr(h, f.name) for f in dataclasses.fields(ManifestHeader)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest(ManifestHeader):
    """A whole version manifest (docs/format.md): the header, the layout, the arrays its pieces point into
    (by array key), the tensor table and the state's skeleton, whose tensor leaves index ``tensors``."""

    layout: LayoutRecord | None
    arrays: dict[str, ArrayInfo]
    tensors: tuple[TensorEntry, ...]
    tree: Tree
    tensor_stats: TensorStatsRecord | None = None   # taken at capture; absent from versions written without

    @classmethod
    def of(cls, header: ManifestHeader, *, size: int, layout: LayoutRecord | None, arrays: dict[str, ArrayInfo],
           tensors: tuple[TensorEntry, ...], tree: Tree, key_order: tuple[str, ...] = SINGLE_PROCESS_ORDER,
           tensor_stats: TensorStatsRecord | None = None) -> "Manifest":
        """A new version's manifest: ``header``'s fields with the bulky ones and ``size``, whose keys the
        encoder writes in ``key_order`` (the writer's)."""
        fields = _header_values(header)
        if header.meta is not None and "meta" not in key_order:
            key_order = (*key_order, "meta")
        if tensor_stats is not None and "tensor_stats" not in key_order:
            key_order = (*key_order, "tensor_stats")
        fields.update(size=size, key_order=key_order)
        return cls(**fields, layout=layout, arrays=arrays, tensors=tensors, tree=tree, tensor_stats=tensor_stats)

    def with_stats(self, stats: dict[str, Any]) -> "Manifest":
        order = self.key_order if "stats" in self.key_order else (*self.key_order, "stats")
        return dataclasses.replace(self, stats=stats, key_order=order)


# the top-level keys this release reads into fields; any other key is kept in ``extra`` and written back
_KNOWN_KEYS = frozenset(f.name for f in dataclasses.fields(Manifest)) - {"key_order", "extra"}


def version_from_manifest(m: ManifestHeader, refs: tuple[str, ...] = (), pruned: bool = False,
                          evicted: bool = False, remotes: tuple[str, ...] = ()) -> Version:
    """The ``Version`` that ``log`` lists for manifest (or header) ``m``; ``evicted``: its data is read from a
    remote (not local-durable), ``remotes``: those holding it."""
    return Version(id=m.id, parents=m.parents, step=m.step, time=m.time, message=m.message,
                   metrics=dict(m.metrics), size=0 if pruned else m.size, refs=refs, pruned=pruned,
                   local=not (pruned or evicted), remotes=remotes, meta=dict(m.meta or {}))


def _header_fields(d: dict[str, Any]) -> dict[str, Any]:
    return {"format_version": d.get("format_version"), "id": d["id"], "parents": tuple(d["parents"]),
            "step": d["step"], "time": d["time"], "message": d["message"], "metrics": d["metrics"],
            "host": d.get("host"), "size": d["size"], "stats": d.get("stats"), "meta": d.get("meta"),
            "key_order": tuple(d),
            "extra": {k: v for k, v in d.items() if k not in _KNOWN_KEYS}}


def _checked_raw(d: Any, vid: str, what: str) -> dict[str, Any]:
    """``d`` if it is a manifest map of version ``vid``.

    Why the id check: the crc32c proves the bytes are a manifest, not whose. One copied over another
    version's key would make `load` of that version return the other's data, `log` list a version twice and
    gc collect the real one as unreachable, with fsck saying ok.
    """
    if not isinstance(d, dict) or d.get("id") != vid:
        held = d.get("id") if isinstance(d, dict) else None
        raise CorruptionError(f"{what} holds the manifest of {'version ' + str(held)[:12] if held else 'no version'}"
                              f", not its own; run `ckptrepo fsck`")
    return d


def _damaged(what: str, problem: str) -> CorruptionError:
    return CorruptionError(f"{what}: {problem}; the manifest is damaged, run `ckptrepo fsck`")


def _header_of(d: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        check_header_fields(d)
    except FieldError as err:
        raise _damaged(what, str(err)) from None
    return _header_fields(d)


def decode_header(blob: bytes, vid: str) -> ManifestHeader:
    """The header of the sealed manifest ``blob`` stored under ``versions/<vid>``, which must be ``vid``'s own;
    the bulky fields are skipped by the parser, never built. Every field is checked (``check_header_fields``)."""
    what = f"manifest {VERSIONS_PREFIX}{vid}"
    return ManifestHeader(**_header_of(_checked_raw(unseal_header(blob, what), vid, what), what))


def decode_header_and_stats(blob: bytes, vid: str) -> tuple[ManifestHeader, TensorStatsRecord | None]:
    """The header and the capture-time tensor statistics of a sealed manifest, the tensor table, arrays and
    tree skipped: what a trajectory over a long history reads of each version."""
    what = f"manifest {VERSIONS_PREFIX}{vid}"
    d = _checked_raw(unseal_header(blob, what, also=frozenset({"tensor_stats"})), vid, what)
    header = _header_of(d, what)
    try:
        record = tensor_stats_record(d.get("tensor_stats"))
    except FieldError as err:
        raise _damaged(what, str(err)) from None
    header["key_order"] = tuple(k for k in header["key_order"] if k != "tensor_stats")
    return ManifestHeader(**header), record


def decode_manifest(blob: bytes, vid: str) -> Manifest:
    """The sealed manifest ``blob`` stored under ``versions/<vid>``, which must be ``vid``'s own: every field of
    the right type (``check_header_fields``, ``tensor_table``, ``layout_record``), with a tensor table that
    fits its arrays (``table_problem``)."""
    what = f"manifest {VERSIONS_PREFIX}{vid}"
    d = _checked_raw(unseal(blob, what), vid, what)
    header = _header_of(d, what)
    try:
        check_array_types(_required(d, "arrays"))
        arrays = {k: ArrayInfo.from_json(k, a) for k, a in d["arrays"].items()}
        tensors = tensor_table(_required(d, "tensors"))
        m = Manifest(**header, layout=layout_record(d.get("layout")), arrays=arrays, tensors=tensors,
                     tree=d.get("tree"), tensor_stats=tensor_stats_record(d.get("tensor_stats")))
        problem = arrays_problem(arrays) or table_problem(m)
    except FieldError as err:
        problem = str(err)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        problem = f"its tensor table is malformed ({type(err).__name__}: {err})"
    if problem:
        raise _damaged(what, problem)
    return m


# ---- validation on decode ------------------------------------------------------------------------------------
# The crc32c proves a manifest's bytes are as sealed, not that what sealed them was a writer of this format: a
# hand-edited or foreign manifest re-sealed with a valid trailer must not leak TypeErrors from `log`, load the
# wrong shape, or pass fsck. So every field is checked once, here, and everything above trusts the records.

class FieldError(ValueError):
    """A manifest field of the wrong type or out of range; its message names the field."""


# the zarr v3 data types the writers store (torch's dtypes, state/_providers.py's DTYPE_NAMES)
ZARR_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                         "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                         "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})
# a commit time between the epoch and the end of year 9999, the last that `log` can print as a date
LATEST_TIME = 253402300800.0
_INT64 = 1 << 63
_HEX = frozenset("0123456789abcdef")


def _required(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise FieldError(f"field {key!r} is missing")
    return d[key]


def _count(v: Any, what: str) -> int:
    """``v`` if it is an int in [0, 2**63): a size, offset or dimension (``type() is``: a bool is no count,
    though Python counts it as an int)."""
    if type(v) is not int or not 0 <= v < _INT64:
        raise FieldError(f"{what} is {v!r}, not a whole number of at least 0")
    return v


def _text(v: Any, what: str) -> str:
    if type(v) is not str:
        raise FieldError(f"{what} is {type(v).__name__} {_short(v)}, not text")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_parents(v: Any) -> None:
    if type(v) is not list and type(v) is not tuple:
        raise FieldError(f"field 'parents' is {type(v).__name__} {_short(v)}, not a list of version ids")
    for p in v:
        if type(p) is not str or len(p) != 32 or not _HEX.issuperset(p):
            raise FieldError(f"field 'parents' holds {_short(p)}, not a version id (32 hex digits)")
    if len(set(v)) != len(v):
        raise FieldError("field 'parents' names a version twice")


def _check_step(v: Any) -> None:
    if v is not None and (type(v) is not int or not -_INT64 <= v < _INT64):
        raise FieldError(f"field 'step' is {_short(v)}, not a 64-bit whole number or nil")


def _check_time(v: Any) -> None:
    if type(v) not in (int, float) or not 0 <= v < LATEST_TIME:   # NaN too: it compares false
        raise FieldError(f"field 'time' is {_short(v)}, not a unix time between 1970 and 9999")


def _check_metrics(v: Any) -> None:
    """Metrics as ``core._manifest.plain_metrics`` lets a snapshot record them: text keys, and numbers,
    booleans, text or nil as values (NaN too: a diverged loss is worth recording)."""
    if type(v) is not dict:
        raise FieldError(f"field 'metrics' is {type(v).__name__} {_short(v)}, not a map of names to values")
    for k, x in v.items():
        if type(k) is not str:
            raise FieldError(f"field 'metrics' has the name {_short(k)}, not text")
        if x is not None and type(x) not in (int, float, str, bool):
            raise FieldError(f"metric {k!r} is {type(x).__name__} {_short(x)}, not a number or text")


def _check_stats(v: Any) -> None:
    if v is None:
        return
    if type(v) is not dict or not all(type(k) is str and type(x) in (int, float) for k, x in v.items()):
        raise FieldError(f"field 'stats' is {_short(v)}, not a map of names to numbers")


def _check_meta(v: Any) -> None:
    if v is None:
        return
    if type(v) is not dict or not all(type(k) is str and type(x) is str for k, x in v.items()):
        raise FieldError(f"field 'meta' is {_short(v)}, not a map of names to text")


def _check_optional_text(name: str) -> Any:
    def check(v: Any) -> None:
        if v is not None:
            _text(v, f"field {name!r}")
    return check


def _check_format_version(v: Any) -> None:
    if v is not None and (type(v) is not int or v < 1):
        raise FieldError(f"field 'format_version' is {_short(v)}, not a format number")


# (field, check, required): every header field the format defines
_HEADER_CHECKS: tuple[tuple[str, Any, bool], ...] = (
    ("format_version", _check_format_version, False),
    ("parents", _check_parents, True),
    ("step", _check_step, True),
    ("time", _check_time, True),
    ("message", lambda v: _text(v, "field 'message'"), True),
    ("metrics", _check_metrics, True),
    ("host", _check_optional_text("host"), False),
    ("size", lambda v: _count(v, "field 'size'"), True),
    ("stats", _check_stats, False),
    ("meta", _check_meta, False),
)


def check_header_fields(d: dict[str, Any]) -> None:
    """Raise FieldError for the first header field of ``d`` that is missing or of the wrong type or range (the
    id is checked against the key it is stored under, by ``_checked_raw``)."""
    for name, check, required in _HEADER_CHECKS:
        if name in d:
            check(d[name])
        elif required:
            raise FieldError(f"field {name!r} is missing")


def check_array_types(arrays: Any) -> None:
    """The ``arrays`` field: a map of array keys to records with a known dtype (the keys and each array's
    geometry are checked by storage's own rules)."""
    if type(arrays) is not dict:
        raise FieldError(f"field 'arrays' is {type(arrays).__name__}, not a map of array keys to arrays")
    for key, a in arrays.items():
        if type(key) is not str or type(a) is not dict:
            raise FieldError(f"field 'arrays' has the entry {_short(key)}, not an array key with its record")
        dtype = a.get("dtype")
        if type(dtype) is not str or dtype not in ZARR_DTYPES:
            raise FieldError(f"array {key} has the data type {_short(dtype)}, not one this release knows")
        digest = a.get("digest")
        if digest is not None and (type(digest) is not int or not 0 <= digest < 1 << 64):
            raise FieldError(f"array {key} has the digest {_short(digest)}, not an unsigned 64-bit int")


def _dims(v: Any) -> tuple[int, ...] | None:
    """``v`` as a tuple of counts; None when it is not one (the caller names the field)."""
    if type(v) is not list and type(v) is not tuple:
        return None
    for x in v:
        if type(x) is not int or not 0 <= x < _INT64:
            return None
    return tuple(v)


_ZEROS = [(0,) * n for n in range(33)]   # the offsets of a piece that starts at a tensor's origin, by rank


def _box_dims(raw_offs: Any, raw_sizes: Any, shape: tuple[int, ...], name: str) -> Box:
    """A piece's box of tensor ``name``: as many offsets and sizes as ``shape`` has dimensions, whole numbers
    of at least 0 that stay inside it (one pass over the dimensions)."""
    if type(raw_offs) in (list, tuple) and type(raw_sizes) in (list, tuple) \
            and len(raw_offs) == len(raw_sizes) == len(shape):
        for o, z, dim in zip(raw_offs, raw_sizes, shape):
            if type(o) is not int or type(z) is not int or o < 0 or z < 0:
                break
            if o + z > dim:
                raise FieldError(f"a piece of tensor {name}, {_box_text((raw_offs, raw_sizes))}, lies outside its "
                                 f"shape {list(shape)}")
        else:
            return tuple(raw_offs), tuple(raw_sizes)
    raise FieldError(f"a piece of tensor {name} has the box {_short([raw_offs, raw_sizes])}, not {len(shape)} "
                     f"offsets and sizes of at least 0")


def _piece_of(p: Any, name: str, shape: tuple[int, ...], raw_shape: Any) -> Piece:
    """A piece of tensor ``name`` (of ``shape``, stored as ``raw_shape``), checked: a box of its rank inside it,
    an array key and an offset. A piece that is the whole tensor, the common case, is recognised by comparing
    its box with the stored shape, without a loop in Python."""
    if type(p) is not dict:
        raise FieldError(f"a piece of tensor {name} is {type(p).__name__} {_short(p)}, not a map")
    box = p.get("box")
    if type(box) is not list and type(box) is not tuple or len(box) != 2:
        raise FieldError(f"a piece of tensor {name} has the box {_short(box)}, not offsets and sizes")
    rank = len(shape)
    raw_offs, raw_sizes = box
    if raw_sizes == raw_shape and type(raw_offs) is list and len(raw_offs) == rank and not any(raw_offs) \
            and all(type(o) is int for o in raw_offs):
        offs, sizes = _ZEROS[rank] if rank < len(_ZEROS) else (0,) * rank, shape
    else:
        offs, sizes = _box_dims(raw_offs, raw_sizes, shape, name)
    array, offset = p.get("array"), p.get("offset")
    if type(array) is not str:
        raise FieldError(f"a piece of tensor {name} names the array {_short(array)}, not an array key")
    if type(offset) is not int or not 0 <= offset < _INT64:
        raise FieldError(f"a piece of tensor {name} starts at offset {_short(offset)}, not a whole number of at "
                         f"least 0")
    return Piece((offs, sizes), array, offset, _digest(p.get("digest"), f"a piece of tensor {name}"))


def _entry(t: Any, i: int) -> TensorEntry:
    """Tensor ``i`` of the table, checked: its name, a known dtype, a shape, and pieces whose boxes have its
    rank, lie inside its shape and do not overlap (what a piece holds of its array is ``table_problem``'s to
    check)."""
    if type(t) is not dict:
        raise FieldError(f"tensor {i} of the table is {type(t).__name__}, not a map")
    name = t.get("name")
    if type(name) is not str:
        raise FieldError(f"tensor {i} of the table has the name {_short(name)}, not text")
    dtype = t.get("dtype")
    if type(dtype) is not str or dtype not in ZARR_DTYPES:
        raise FieldError(f"tensor {name} has the data type {_short(dtype)}, not one this release knows")
    raw_shape = t.get("shape")
    shape = _dims(raw_shape)
    if shape is None:
        raise FieldError(f"tensor {name} has the shape {_short(raw_shape)}, not whole numbers of at least 0")
    raw_pieces = t.get("pieces")
    if type(raw_pieces) is not list and type(raw_pieces) is not tuple:
        raise FieldError(f"tensor {name} has the pieces {_short(raw_pieces)}, not a list")
    pieces = tuple([_piece_of(p, name, shape, raw_shape) for p in raw_pieces])
    if len(pieces) > 1:
        pair = overlapping_pieces([p.box for p in pieces])
        if pair is not None:
            raise FieldError(f"pieces {_box_text(pair[0])} and {_box_text(pair[1])} of tensor {name} overlap")
    return TensorEntry(name, dtype, shape, pieces)


def tensor_table(raw: Any) -> tuple[TensorEntry, ...]:
    """The ``tensors`` field as records, each checked (``_entry``); tensor names are unique."""
    if type(raw) is not list and type(raw) is not tuple:
        raise FieldError(f"field 'tensors' is {type(raw).__name__}, not a list of tensors")
    table = tuple(_entry(t, i) for i, t in enumerate(raw))
    if len({t.name for t in table}) != len(table):
        seen: set[str] = set()
        for t in table:
            if t.name in seen:
                raise FieldError(f"tensor {t.name} is listed twice")
            seen.add(t.name)
    return table


def overlapping_pieces(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (inside one tensor) that share an element, or None.

    A table whose pieces overlap while their volumes add up to the tensor's leaves elements no piece holds,
    which a load would return as uninitialised memory. A sweep along the dimension that tells the boxes apart
    best (the one with the most distinct offsets): boxes are sorted by their start there, and each is compared
    only with those still open at its start, which for the tilings the writers produce (slabs, column blocks,
    ZeRO's row ranges) is one or two.
    """
    boxes = [b for b in boxes if all(b[1])]   # an empty box holds no element
    if len(boxes) < 2:
        return None
    rank = len(boxes[0][0])
    if rank == 0:
        return boxes[0], boxes[1]   # both hold a scalar's one element
    d = max(range(rank), key=lambda k: len({b[0][k] for b in boxes}))
    boxes.sort(key=lambda b: b[0][d])
    end = 0
    for b in boxes:   # apart along that dimension, as a tiling mostly is: no two can share an element
        if b[0][d] < end:
            break
        end = b[0][d] + b[1][d]
    else:
        return None
    open_: list[Box] = []
    for b in boxes:
        start = b[0][d]
        open_ = [a for a in open_ if a[0][d] + a[1][d] > start]
        for a in open_:
            if intersect(a, b) is not None:
                return a, b
        open_.append(b)
    return None


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + z}" for o, z in zip(*box)) + "]"


def _rank_record(r: Any, world_size: int) -> RankRecord:
    if type(r) is not dict:
        raise FieldError(f"a rank record of the layout is {type(r).__name__} {_short(r)}, not a map")
    rank = r.get("rank")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise FieldError(f"the layout records rank {_short(rank)}, not a rank of its {world_size}")
    coords = r.get("coords")
    if coords is not None and (type(coords) is not dict or not all(
            type(k) is str and type(v) is int and v >= 0 for k, v in coords.items())):
        raise FieldError(f"rank {rank} of the layout has the coordinates {_short(coords)}, not a map of axes to "
                         f"indices")
    names = r.get("leaf_names")
    if names is not None and (type(names) not in (list, tuple) or not all(type(n) is str for n in names)):
        raise FieldError(f"rank {rank} of the layout has leaf names that are not a list of text")
    return RankRecord(rank, coords, r.get("tree"), None if names is None else tuple(names))


def layout_record(raw: Any) -> LayoutRecord | None:
    """The ``layout`` field as a record (None where a version has none), its degrees and ranks checked."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise FieldError(f"field 'layout' is {type(raw).__name__} {_short(raw)}, not a map")
    world = raw.get("world_size", 1)
    if type(world) is not int or not 1 <= world < _INT64:
        raise FieldError(f"the layout's world size is {_short(world)}, not a whole number of at least 1")
    degrees = {}
    for axis in ("tp", "pp", "dp", "zero"):
        v = raw.get(axis)
        if v is not None and (type(v) is not int or not 0 <= v < _INT64):
            raise FieldError(f"the layout's {axis} is {_short(v)}, not a whole number")
        degrees[axis] = v
    rules = raw.get("rules")
    if rules is not None and type(rules) is not dict:
        raise FieldError(f"the layout's rules are {type(rules).__name__}, not a map")
    ranks = raw.get("ranks", ())
    if type(ranks) is not list and type(ranks) is not tuple:
        raise FieldError(f"the layout's ranks are {type(ranks).__name__}, not a list")
    return LayoutRecord(world, tuple(_rank_record(r, world) for r in ranks), degrees["tp"], degrees["pp"],
                        degrees["dp"], degrees["zero"], rules)



def manifest_raw(m: Manifest) -> dict[str, Any]:
    """The msgpack map of ``m``: its keys in ``m.key_order``, values as the writers produce them."""
    values: dict[str, Any] = {
        "format_version": m.format_version, "id": m.id, "parents": m.parents, "step": m.step, "time": m.time,
        "message": m.message, "metrics": m.metrics, "host": m.host, "size": m.size, "stats": m.stats,
        "meta": m.meta, "layout": None if m.layout is None else m.layout.to_raw(),
        "arrays": {k: a.to_json() for k, a in m.arrays.items()},
        "tensors": [t.to_raw() for t in m.tensors], "tree": m.tree,
        "tensor_stats": None if m.tensor_stats is None else m.tensor_stats.to_raw()}
    return {k: values[k] if k in _KNOWN_KEYS else m.extra[k] for k in m.key_order}


def encode_manifest(m: Manifest) -> bytes:
    """The sealed bytes of ``m``, as stored under ``versions/<id>``; one bigger than a reader accepts
    (``MAX_VALUE_BYTES``) is refused here, before it is committed as a version nobody could read."""
    blob = seal(manifest_raw(m))
    if len(blob) > MAX_VALUE_BYTES:
        raise UnsupportedValueError(f"the manifest of this snapshot would be {len(blob)} bytes, more than the "
                                    f"{MAX_VALUE_BYTES} a reader accepts (docs/format.md): save fewer, larger "
                                    f"tensors, or shorter names")
    return blob


@dataclass(frozen=True, slots=True)
class RankPart:
    """One rank's part of a distributed snapshot (parallel/_distributed.py): written to
    ``staging/<id>/rank-<r>`` once its data is durable, merged by rank 0 into the version manifest."""

    rank: int
    step: int | None
    tree: Tree                                          # this rank's skeleton
    leaf_names: tuple[str, ...]                         # the stored name of each of its tensor leaves
    names: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, dtype, global shape) of each tensor it holds
    coords: dict[str, int] | None                       # {tp, pp, dp}; None without a ParallelLayout
    tensors: tuple[tuple[str, tuple[Piece, ...]], ...]  # (name, the pieces this rank wrote of it)
    arrays: dict[str, ArrayInfo]                        # the arrays it wrote
    fingerprints: tuple[Any, ...]                       # its replicated pieces' (parallel/_replicas.py)
    # (name, Moments.to_raw()) of each piece it wrote: its values' statistics, which rank 0 merges per tensor
    moments: tuple[tuple[str, Any], ...] | None = None

    def to_raw(self) -> dict[str, Any]:
        raw = {"rank": self.rank, "step": self.step, "tree": self.tree, "leaf_names": self.leaf_names,
               "names": self.names, "coords": self.coords,
               "tensors": [{"name": n, "pieces": [p.to_raw() for p in ps]} for n, ps in self.tensors],
               "arrays": {k: a.to_json() for k, a in self.arrays.items()}, "fingerprints": self.fingerprints}
        if self.moments is not None:
            raw["moments"] = [[n, m] for n, m in self.moments]
        return raw

    @classmethod
    def from_raw(cls, d: dict[str, Any]) -> "RankPart":
        part = cls(d["rank"], d.get("step"), d["tree"], tuple(d["leaf_names"]),
                   tuple((n, dtype, tuple(shape)) for n, dtype, shape in d["names"]), d.get("coords"),
                   tuple((t["name"], tuple(map(_piece, t["pieces"]))) for t in d["tensors"]),
                   {k: ArrayInfo.from_json(k, a) for k, a in d["arrays"].items()}, tuple(d.get("fingerprints", ())),
                   None if d.get("moments") is None else tuple((n, Moments.from_raw(m).to_raw())
                                                                for n, m in d["moments"]))
        problem = arrays_problem(part.arrays) or next(
            (f"a piece of {n} points into {p.array!r}, which the part does not list"
             for n, ps in part.tensors for p in ps if p.array not in part.arrays), None)
        if problem:   # merged, it would commit a version no reader accepts
            raise ValueError(problem)
        return part


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What a rank that failed its part of a distributed snapshot stages instead of its ``RankPart``."""

    rank: int
    error: str

    def to_raw(self) -> dict[str, Any]:
        return {"rank": self.rank, "error": self.error}


def encode_rank_part(part: RankPart | RankFailure) -> bytes:
    """The sealed staging object of a rank's part or failure."""
    return seal(part.to_raw())


def decode_rank_part(blob: bytes, what: str) -> RankPart | RankFailure:
    """A staged rank part, or the failure a rank staged instead; ``what`` names the object in errors."""
    d = unseal(blob, what)
    try:
        if d.get("error"):
            return RankFailure(d.get("rank", -1), d["error"])
        return RankPart.from_raw(d)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptionError(f"{what} is not a rank's part of a snapshot ({type(err).__name__}: {err})") from None


def arrays_problem(arrays: dict[str, ArrayInfo]) -> str | None:
    """The first array record whose key or geometry is unsafe to read (``array_problem``), or None: checked
    once here, so that every read path, direct or through TensorStore, only meets keys and sizes it can
    trust."""
    return next(filter(None, map(array_problem, arrays.values())), None)


def table_problem(m: Manifest) -> str | None:
    """What is wrong with the tensor table's pieces against the arrays they point into, or None (their boxes
    were checked against the tensors' shapes as they were decoded).

    The crc32c proves the bytes are as written, not that a writer wrote them right (or that a hand-edited
    manifest was re-sealed consistently): a tensor of another dtype than its array, or a piece past its
    array's end, would load uninitialised memory on one path and fail with an IndexError on another. And every
    piece is stored once (dedup points a tensor at bytes no other tensor of the version uses), so two pieces
    sharing elements of an array mean one was moved: a re-sealed manifest that points a tensor some elements
    further on would load its neighbour's bytes, every checksum valid."""
    arrays = m.arrays
    spans = []
    for t in m.tensors:
        covered = 0
        for p in t.pieces:
            a = arrays.get(p.array)
            n = volume(p.box[1])
            if a is None:
                return f"tensor {t.name} points into array {p.array}, which it does not list"
            if a.dtype != t.dtype:
                return f"tensor {t.name} is {t.dtype} but its array {p.array} holds {a.dtype}"
            if p.offset + n > a.numel:
                return f"a piece of tensor {t.name} lies outside its box or array {p.array}"
            if n:
                spans.append((p.array, p.offset, p.offset + n, t.name))
            covered += n
        total = volume(t.shape)
        if covered != total:
            return f"the pieces of tensor {t.name} hold {covered} of its {total} elements"
    spans.sort()
    for (a0, _, end0, name0), (a1, start1, _, name1) in zip(spans, spans[1:]):
        if a0 == a1 and start1 < end0:
            return f"tensors {name0} and {name1} overlap in array {a0}"
    return None


__all__ = ["MERGED_ORDER", "SINGLE_PROCESS_LAYOUT", "SINGLE_PROCESS_ORDER", "LayoutRecord", "Manifest",
           "ManifestHeader", "Piece", "RankFailure", "RankPart", "RankRecord", "TensorEntry", "Tree",
           "decode_header", "decode_manifest", "decode_rank_part", "encode_manifest", "encode_rank_part",
           "manifest_raw", "table_problem", "version_from_manifest"]
