"""The version manifest's schema: typed records for what ``versions/<id>`` holds, and its one encoder and decoder.

docs/format.md describes the format; these classes are its shape in code. A manifest is decoded into them
once (and cached by the handle that read it), and everything above reads attributes, never string keys.

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
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptrepo.core._boxes import Box, volume
from ckptrepo.core._manifest import BULKY_FIELDS, VERSIONS_PREFIX, Version, seal, unseal, unseal_header
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
    array ``array`` from element ``offset`` on."""

    box: Box
    array: str
    offset: int

    def to_raw(self) -> dict[str, Any]:
        return {"box": self.box, "array": self.array, "offset": self.offset}


def _piece(p: dict[str, Any]) -> Piece:
    offs, sizes = p["box"]
    return Piece((tuple(offs), tuple(sizes)), p["array"], p["offset"])


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

    @classmethod
    def from_raw(cls, t: dict[str, Any]) -> "TensorEntry":
        return cls(t["name"], t["dtype"], tuple(t["shape"]), tuple(map(_piece, t["pieces"])))


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

    @classmethod
    def from_raw(cls, r: dict[str, Any]) -> "RankRecord":
        names = r.get("leaf_names")
        return cls(r["rank"], r.get("coords"), r.get("tree"), None if names is None else tuple(names))


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

    @classmethod
    def from_raw(cls, d: dict[str, Any]) -> "LayoutRecord":
        return cls(d.get("world_size", 1), tuple(RankRecord.from_raw(r) for r in d.get("ranks", ())),
                   d.get("tp"), d.get("pp"), d.get("dp"), d.get("zero"), d.get("rules"))


SINGLE_PROCESS_LAYOUT = LayoutRecord(1, (RankRecord(0),))


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

    @classmethod
    def of(cls, header: ManifestHeader, *, size: int, layout: LayoutRecord | None, arrays: dict[str, ArrayInfo],
           tensors: tuple[TensorEntry, ...], tree: Tree, key_order: tuple[str, ...] = SINGLE_PROCESS_ORDER
           ) -> "Manifest":
        """A new version's manifest: ``header``'s fields with the bulky ones and ``size``, whose keys the
        encoder writes in ``key_order`` (the writer's)."""
        fields = _header_values(header)
        fields.update(size=size, key_order=key_order)
        return cls(**fields, layout=layout, arrays=arrays, tensors=tensors, tree=tree)

    def with_stats(self, stats: dict[str, Any]) -> "Manifest":
        order = self.key_order if "stats" in self.key_order else (*self.key_order, "stats")
        return dataclasses.replace(self, stats=stats, key_order=order)


# the top-level keys this release reads into fields; any other key is kept in ``extra`` and written back
_KNOWN_KEYS = frozenset(f.name for f in dataclasses.fields(Manifest)) - {"key_order", "extra"}


def version_from_manifest(m: ManifestHeader, refs: tuple[str, ...] = (), pruned: bool = False) -> Version:
    """The ``Version`` that ``log`` lists for manifest (or header) ``m``."""
    return Version(id=m.id, parents=m.parents, step=m.step, time=m.time, message=m.message,
                   metrics=dict(m.metrics), size=0 if pruned else m.size, refs=refs, pruned=pruned)


def _header_fields(d: dict[str, Any]) -> dict[str, Any]:
    return {"format_version": d.get("format_version"), "id": d["id"], "parents": tuple(d["parents"]),
            "step": d["step"], "time": d["time"], "message": d["message"], "metrics": d["metrics"],
            "host": d.get("host"), "size": d["size"], "stats": d.get("stats"), "key_order": tuple(d),
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


def _header_of(d: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        return _header_fields(d)
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptionError(f"{what}: its header is malformed ({type(err).__name__}: {err}); the manifest is "
                              f"damaged, run `ckptrepo fsck`") from None


def decode_header(blob: bytes, vid: str) -> ManifestHeader:
    """The header of the sealed manifest ``blob`` stored under ``versions/<vid>``, which must be ``vid``'s own;
    the bulky fields are skipped by the parser, never built."""
    what = f"manifest {VERSIONS_PREFIX}{vid}"
    return ManifestHeader(**_header_of(_checked_raw(unseal_header(blob, what), vid, what), what))


def decode_manifest(blob: bytes, vid: str) -> Manifest:
    """The sealed manifest ``blob`` stored under ``versions/<vid>``, which must be ``vid``'s own, with a tensor
    table that fits its arrays (``table_problem``)."""
    what = f"manifest {VERSIONS_PREFIX}{vid}"
    d = _checked_raw(unseal(blob, what), vid, what)
    header = _header_of(d, what)
    try:
        arrays = {k: ArrayInfo.from_json(k, a) for k, a in d["arrays"].items()}
        tensors = tuple(map(TensorEntry.from_raw, d["tensors"]))
        lay = d.get("layout")
        m = Manifest(**header, layout=None if lay is None else LayoutRecord.from_raw(lay), arrays=arrays,
                     tensors=tensors, tree=d.get("tree"))
        problem = arrays_problem(arrays) or table_problem(m)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        problem = f"its tensor table is malformed ({type(err).__name__}: {err})"
    if problem:
        raise CorruptionError(f"{what}: {problem}; the manifest is damaged, run `ckptrepo fsck`")
    return m


def manifest_raw(m: Manifest) -> dict[str, Any]:
    """The msgpack map of ``m``: its keys in ``m.key_order``, values as the writers produce them."""
    values: dict[str, Any] = {
        "format_version": m.format_version, "id": m.id, "parents": m.parents, "step": m.step, "time": m.time,
        "message": m.message, "metrics": m.metrics, "host": m.host, "size": m.size, "stats": m.stats,
        "layout": None if m.layout is None else m.layout.to_raw(),
        "arrays": {k: a.to_json() for k, a in m.arrays.items()},
        "tensors": [t.to_raw() for t in m.tensors], "tree": m.tree}
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

    def to_raw(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "tree": self.tree, "leaf_names": self.leaf_names,
                "names": self.names, "coords": self.coords,
                "tensors": [{"name": n, "pieces": [p.to_raw() for p in ps]} for n, ps in self.tensors],
                "arrays": {k: a.to_json() for k, a in self.arrays.items()}, "fingerprints": self.fingerprints}

    @classmethod
    def from_raw(cls, d: dict[str, Any]) -> "RankPart":
        part = cls(d["rank"], d.get("step"), d["tree"], tuple(d["leaf_names"]),
                   tuple((n, dtype, tuple(shape)) for n, dtype, shape in d["names"]), d.get("coords"),
                   tuple((t["name"], tuple(map(_piece, t["pieces"]))) for t in d["tensors"]),
                   {k: ArrayInfo.from_json(k, a) for k, a in d["arrays"].items()}, tuple(d.get("fingerprints", ())))
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
    """What is wrong with the tensor table's pieces against the arrays they point into, or None.

    The crc32c proves the bytes are as written, not that a writer wrote them right (or that a hand-edited
    manifest was re-sealed consistently): a tensor of another dtype than its array, or a piece past its
    array's end, would load uninitialised memory on one path and fail with an IndexError on another."""
    arrays = m.arrays
    for t in m.tensors:
        covered = 0
        rank = len(t.shape)
        for p in t.pieces:
            a = arrays.get(p.array)
            offs, sizes = p.box
            n = volume(sizes)
            if a is None:
                return f"tensor {t.name} points into array {p.array}, which it does not list"
            if a.dtype != t.dtype:
                return f"tensor {t.name} is {t.dtype} but its array {p.array} holds {a.dtype}"
            if len(offs) != rank or len(sizes) != rank or min(sizes, default=0) < 0 \
                    or p.offset < 0 or p.offset + n > a.numel:
                return f"a piece of tensor {t.name} lies outside its box or array {p.array}"
            covered += n
        total = volume(t.shape)
        if covered != total:
            return f"the pieces of tensor {t.name} hold {covered} of its {total} elements"
    return _shared_storage(m)


def _shared_storage(m: Manifest) -> str | None:
    """Two pieces of a version whose elements overlap in an array, or None.

    Every piece is stored once (dedup points a tensor at bytes no other tensor of the version uses), so an
    overlap means a piece was moved: a re-sealed manifest that points a tensor some elements further on would
    load its neighbour's bytes, every checksum valid."""
    spans = sorted((p.array, p.offset, p.offset + volume(p.box[1]), t.name)
                   for t in m.tensors for p in t.pieces if volume(p.box[1]))
    for (a0, _, end0, name0), (a1, start1, _, name1) in zip(spans, spans[1:]):
        if a0 == a1 and start1 < end0:
            return f"tensors {name0} and {name1} overlap in array {a0}"
    return None


__all__ = ["MERGED_ORDER", "SINGLE_PROCESS_LAYOUT", "SINGLE_PROCESS_ORDER", "LayoutRecord", "Manifest",
           "ManifestHeader", "Piece", "RankFailure", "RankPart", "RankRecord", "TensorEntry", "Tree",
           "decode_header", "decode_manifest", "decode_rank_part", "encode_manifest", "encode_rank_part",
           "manifest_raw", "table_problem", "version_from_manifest"]
