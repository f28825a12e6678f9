"""The version manifest's schema: typed records for what ``versions/<id>`` holds, and its one encoder and decoder.

docs/format.md describes the format; these classes are its shape in code. A manifest is decoded into them
once (and cached by the handle that read it), every field checked on the way (core/_schema_fields.py),
and everything above reads attributes, never string keys, and trusts their types.

Byte compatibility: ``encode_manifest(decode_manifest(blob))`` gives back ``blob``. msgpack keeps map keys in
insertion order, and the two writers order the top-level keys differently (a single-process snapshot
writes the header first, a merged distributed one its layout first), so a manifest remembers the order of
the keys it was decoded from (``key_order``) and any key this release does not know (``extra``), and the
encoder writes them back in that order. Tuples and lists encode alike, so records hold tuples.

The records of the bulky fields live in core/_schema_records.py, the checks each raw field passes in
core/_schema_fields.py, and a distributed snapshot's per-rank staging objects in core/_rank_parts.py; this
module is the public home of all of them. Array records are ``ArrayInfo`` (storage/_arrays.py), the one
definition the storage layer reads and writes arrays with; storage cannot import core.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ckptrepo.core._boxes import volume
from ckptrepo.core._manifest import BULKY_FIELDS, VERSIONS_PREFIX, Version, seal, unseal, unseal_header
from ckptrepo.core._rank_parts import RankFailure, RankPart, decode_rank_part, encode_rank_part
from ckptrepo.core._schema_fields import (
    FieldError,
    _required,
    arrays_problem,
    check_array_types,
    check_header_fields,
    layout_record,
    tensor_stats_record,
    tensor_table,
)
from ckptrepo.core._schema_records import (
    SINGLE_PROCESS_LAYOUT,
    STAT_COLUMNS,
    LayoutRecord,
    Piece,
    RankRecord,
    TensorEntry,
    TensorStatsRecord,
    Tree,
)
from ckptrepo.errors import CorruptionError, UnsupportedValueError
from ckptrepo.storage import ArrayInfo
from ckptrepo.storage.protocol import MAX_VALUE_BYTES

# The top-level key order each writer produces: a single-process snapshot's manifest, and one merged from
# the ranks of a distributed snapshot (the merged parts, then the header). ``stats`` comes last in both.
SINGLE_PROCESS_ORDER = ("format_version", "id", "parents", "step", "time", "message", "metrics", "host",
                        "layout", "size", "arrays", "tensors", "tree")
MERGED_ORDER = ("layout", "arrays", "tensors", "size", "tree",
                "format_version", "id", "parents", "step", "time", "message", "metrics", "host")


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


__all__ = ["MERGED_ORDER", "SINGLE_PROCESS_LAYOUT", "SINGLE_PROCESS_ORDER", "STAT_COLUMNS", "LayoutRecord", "Manifest",
           "ManifestHeader", "Piece", "RankFailure", "RankPart", "RankRecord", "TensorEntry", "TensorStatsRecord",
           "Tree", "decode_header", "decode_header_and_stats", "decode_manifest", "decode_rank_part",
           "encode_manifest", "encode_rank_part", "manifest_raw", "table_problem", "version_from_manifest"]
