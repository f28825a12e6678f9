"""Validation on decode: the checks every field of a raw decoded manifest map passes before it becomes a
record (core/schema.py's decoders call them).

The crc32c proves a manifest's bytes are as sealed, not that what sealed them was a writer of this format: a
hand-edited or foreign manifest re-sealed with a valid trailer must not leak TypeErrors from `log`, load the
wrong shape, or pass fsck. So every field is checked once, here, and everything above trusts the records.
"""
from __future__ import annotations

from typing import Any

from ckptrepo.core._boxes import Box, overlapping_pieces
from ckptrepo.core._schema_records import LayoutRecord, Piece, RankRecord, TensorEntry, TensorStatsRecord
from ckptrepo.storage import ArrayInfo, array_problem


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


def _digest(raw: Any, what: str) -> bytes | None:
    """A piece's ``digest`` field, checked (raises FieldError)."""
    if raw is None or type(raw) is bytes and 2 <= len(raw) <= 65:
        return raw
    raise FieldError(f"{what} has the digest {_short(raw)}, not an algorithm byte and a hash")


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


def arrays_problem(arrays: dict[str, ArrayInfo]) -> str | None:
    """The first array record whose key or geometry is unsafe to read (``array_problem``), or None: checked
    once here, so that every read path, direct or through TensorStore, only meets keys and sizes it can
    trust."""
    return next(filter(None, map(array_problem, arrays.values())), None)
