"""Diff and statistics between versions, streamed chunk by chunk.

Nothing here loads a whole version: every tensor is read in bounded chunks of
its flat array (``CHUNK_BYTES`` at a time, per side), and each statistic is an
accumulation over chunks in float64. So memory stays bounded whatever the
checkpoint size. Pieces that point at the same stored bytes (dedup) are known
to be equal without reading them.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ckptrepo.core._boxes import flat_boxes, volume
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core.schema import Manifest, TensorEntry
from ckptrepo.core.schema import Piece as SavedPiece
from ckptrepo.loading._engine import Engine
from ckptrepo.loading._reader import read_tensors
from ckptrepo.loading._reshard import VersionReader
from ckptrepo.parallel._sharding import Piece
from ckptrepo.state._providers import TORCH_DTYPES
from ckptrepo.state._skeleton import plain_values, short_text
from ckptrepo.storage._arrays import ArrayInfo

CHUNK_BYTES = 2 << 20  # per side, as float64; a few such temporaries are alive at once


@dataclass
class TensorDiff:
    """How one tensor differs between two versions."""

    name: str
    status: str                      # "changed", "unchanged", "added", "removed", "reshaped", "retyped"
    dtype: str | None = None
    shape: list[int] | None = None
    l2: float = 0.0                  # ||B - A||
    relative: float = 0.0            # ||B - A|| / ||A||
    max_abs: float = 0.0             # max |B - A|
    cosine: float = 1.0              # <A, B> / (||A|| ||B||)
    norm_a: float = math.nan         # NaN: not computed (a tensor added, removed, reshaped or retyped)
    norm_b: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


@dataclass
class ObjectDiff:
    """A plain value that changed: its path and both values (short text)."""

    path: str
    status: str                      # "changed", "added", "removed"
    a: str | None = None
    b: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class VersionDiff:
    """Everything ``diff`` reports."""

    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[ObjectDiff] = field(default_factory=list)

    def by_prefix(self, depth: int = 2) -> list[dict[str, Any]]:
        """A summary per module prefix (the first ``depth`` name components), as ``diff --stat`` prints."""
        groups: dict[str, dict[str, Any]] = {}
        for t in self.tensors:
            parts = t.name.replace("/", ".").split(".")
            key = ".".join(parts[:depth])
            g = groups.setdefault(key, {"prefix": key, "tensors": 0, "changed": 0, "l2": 0.0, "norm_a": 0.0})
            g["tensors"] += 1
            g["changed"] += t.status != "unchanged"
            g["l2"] = math.hypot(g["l2"], t.l2)     # hypot: the norm of norms, without squaring into overflow
            g["norm_a"] = math.hypot(g["norm_a"], t.norm_a)
        out = []
        for g in groups.values():
            l2, na = g["l2"], g.pop("norm_a")
            out.append(dict(g, relative=l2 / na if na else (0.0 if l2 == 0 else math.inf)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "tensors": [t.to_json() for t in self.tensors],
                "objects": [o.to_json() for o in self.objects]}


@dataclass
class TensorStats:
    """Per-tensor statistics of one version."""

    name: str
    dtype: str
    shape: list[int]
    numel: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    nan: int
    inf: int
    absmax: float = math.nan         # max |x| over the finite values (of |x| for complex tensors)

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


class _Chunks:
    """Bounded reads of tensors of one version, as float64 (or complex128) chunks."""

    def __init__(self, plumbing: Plumbing, manifest: Manifest) -> None:
        self.plumbing = plumbing
        self.manifest = manifest
        self.arrays = dict(manifest.arrays)
        self.store = plumbing.data_store(manifest)
        self.engine = Engine(self.store, self.arrays)   # for tensors saved whole: a flat range of one array
        self._pieces: VersionReader | None = None   # for tensors saved as several pieces, made on first need

    @property
    def pieces(self) -> VersionReader:
        if self._pieces is None:
            self._pieces = VersionReader(self.store, self.manifest)
        return self._pieces

    def array_info(self, key: str) -> ArrayInfo:
        info = self.arrays.get(key)
        if info is None:  # a piece that points into another version (dedup)
            vid = key.split("/")[1]
            info = self.arrays[key] = self.plumbing.manifest(vid).arrays[key]
        return info

    def read(self, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the tensor in row-major order, whichever pieces hold them."""
        pieces = entry.pieces
        if len(pieces) == 1 and pieces[0].box[1] == entry.shape:
            key, off = pieces[0].array, pieces[0].offset
            self.array_info(key)   # into self.arrays, where the engine looks: a dedup'd piece's is another version's
            n = stop - start
            entry_range = TensorEntry(entry.name, entry.dtype, (n,), (SavedPiece(((0,), (n,)), key, off + start),))
            t = read_tensors(self.store, self.arrays, [entry_range], [0], engine=self.engine)[0]
        else:  # saved by several ranks: the range is a few boxes, each filled from the pieces it meets
            shape = entry.shape
            t = torch.empty(stop - start, dtype=TORCH_DTYPES[entry.dtype])
            targets = [Piece(entry.name, entry.dtype, shape, box, t[f - start:f - start + volume(box[1])].view(box[1]))
                       for f, box in flat_boxes(shape, start, stop)]
            self.pieces.read(targets)
        return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def _chunk_elems(dtype: str) -> int:
    return max(1, CHUNK_BYTES // 8 // (2 if dtype.startswith("complex") else 1))


def _spans(n: int, step: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, step):
        yield s, min(n, s + step)


def diff_versions(plumbing: Plumbing, a: str, b: str, pattern: str | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> VersionDiff:
    """Compare versions ``a`` and ``b`` tensor by tensor (streamed) and object by object."""
    va, vb = plumbing.resolve(a), plumbing.resolve(b)
    ma, mb = plumbing.manifest(va), plumbing.manifest(vb)
    plumbing.require_data(va, ma)
    plumbing.require_data(vb, mb)
    ta = {t.name: t for t in ma.tensors}
    tb = {t.name: t for t in mb.tensors}
    ca, cb = _Chunks(plumbing, ma), _Chunks(plumbing, mb)
    result = VersionDiff(va, vb)
    names = list(ta) + [n for n in tb if n not in ta]
    for name in names:
        if pattern and not fnmatch.fnmatchcase(name, pattern):
            continue
        ea, eb = ta.get(name), tb.get(name)
        if ea is None or eb is None:
            e = ea or eb
            assert e is not None
            result.tensors.append(TensorDiff(name, "added" if ea is None else "removed", e.dtype, list(e.shape),
                                             math.nan, math.nan, math.nan, math.nan))
            continue
        if ea.shape != eb.shape or ea.dtype != eb.dtype:
            result.tensors.append(TensorDiff(name, "reshaped" if ea.shape != eb.shape else "retyped",
                                             eb.dtype, list(eb.shape), math.nan, math.nan, math.nan, math.nan))
            continue
        result.tensors.append(_diff_tensor(name, ea, eb, ca, cb, on_bytes))
    result.objects = _diff_objects(ma.tree, mb.tree)
    return result


def _diff_tensor(name: str, ea: TensorEntry, eb: TensorEntry, ca: _Chunks, cb: _Chunks,
                 on_bytes: Callable[[int], None] | None) -> TensorDiff:
    n = ea.numel
    if not ea.pieces or ea.pieces == eb.pieces:  # empty, or the very same stored bytes
        norm = _norm_only(ea, ca, n, on_bytes) if ea.pieces else 0.0
        return TensorDiff(name, "unchanged", ea.dtype, list(ea.shape), 0.0, 0.0, 0.0, 1.0, norm, norm)
    l2 = na = nb = 0.0
    max_abs = 0.0
    differs = False
    cos_terms: list[tuple[float, float, float]] = []  # per chunk: ||x||, ||y||, cosine; weighted at the end
    for s, e in _spans(n, _chunk_elems(ea.dtype)):
        x, y = ca.read(ea, s, e), cb.read(eb, s, e)
        if on_bytes is not None:
            on_bytes(2 * (e - s) * torch.empty((), dtype=TORCH_DTYPES[ea.dtype]).element_size())
        d = y - x
        differs = differs or not torch.equal(_bits(x), _bits(y))   # by bits: NaN == NaN where the bytes are equal
        cx, cy = _norm(x), _norm(y)
        l2, na, nb = math.hypot(l2, _norm(d)), math.hypot(na, cx), math.hypot(nb, cy)
        if cx and cy and math.isfinite(cx) and math.isfinite(cy):
            u, v = x / cx, y / cy
            cos_terms.append((cx, cy, float((u.conj() * v).real.sum()) if u.is_complex() else float((u * v).sum())))
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
    rel = l2 / na if na else (0.0 if l2 == 0 else math.inf)
    if na and nb and math.isfinite(na) and math.isfinite(nb):
        # the dot product as a sum of unit-norm chunk products: neither x.y nor na * nb can overflow or underflow
        cos = sum((cx / na) * (cy / nb) * c for cx, cy, c in cos_terms)
    else:
        cos = (1.0 if na == nb else 0.0) if not (na and nb) else math.nan
    return TensorDiff(name, "changed" if differs else "unchanged", ea.dtype, list(ea.shape), l2, rel, max_abs, cos,
                      na, nb)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float64/complex128 chunk as the integers of its bits: equal exactly where the stored bytes are."""
    return (torch.view_as_real(t) if t.is_complex() else t).view(torch.int64)


def _norm_only(entry: TensorEntry, chunks: _Chunks, n: int, on_bytes: Callable[[int], None] | None) -> float:
    norm = 0.0
    for s, e in _spans(n, _chunk_elems(entry.dtype)):
        norm = math.hypot(norm, _norm(chunks.read(entry, s, e)))
        if on_bytes is not None:
            on_bytes((e - s) * torch.empty((), dtype=TORCH_DTYPES[entry.dtype]).element_size())
    return norm


def _norm(x: torch.Tensor) -> float:
    """||x|| of a float64/complex128 chunk, scaled by its largest magnitude first.

    Why: squaring overflows float64 from 1.3e154 up (a tensor of 1e200s had norm inf) and underflows
    below 1e-154; scaled, only the true norm's own range limits it. Chunks combine with ``math.hypot``.
    """
    if not x.numel():
        return 0.0
    a = x.abs()
    top = float(a.max())
    if top == 0.0 or not math.isfinite(top):
        return top      # 0, inf, or nan: what the norm is then
    return top * float(torch.linalg.vector_norm(a / top))


def _diff_objects(ta: Any, tb: Any) -> list[ObjectDiff]:
    a, b = dict(plain_values(ta)), dict(plain_values(tb))
    out = []
    for path in list(a) + [p for p in b if p not in a]:
        if path not in b:
            out.append(ObjectDiff(path, "removed", short_text(a[path], 60), None))
        elif path not in a:
            out.append(ObjectDiff(path, "added", None, short_text(b[path], 60)))
        elif not _same_value(a[path], b[path]):
            out.append(ObjectDiff(path, "changed", short_text(a[path], 60), short_text(b[path], 60)))
    return out


def _same_value(x: Any, y: Any) -> bool:
    """Equal as stored: of one type (``True == 1 == 1.0`` in Python, not in a version), a float's sign too
    (``0.0 == -0.0``, which tensors already count as a change), and NaN equal to NaN."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return (x != x and y != y) or (x == y and math.copysign(1.0, x) == math.copysign(1.0, y))
    return bool(x == y)


def tensor_stats(plumbing: Plumbing, rev: str, pattern: str | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
    """Norm, mean, std, min/max and NaN/Inf counts of every tensor of ``rev`` (streamed)."""
    vid = plumbing.resolve(rev)
    m = plumbing.manifest(vid)
    plumbing.require_data(vid, m)
    chunks = _Chunks(plumbing, m)
    out = []
    for entry in m.tensors:
        if pattern and not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        out.append(_stats_of(entry, chunks, on_bytes))
    return out


def recorded_stats(plumbing: Plumbing, vid: str, names: Sequence[str]) -> dict[str, dict[str, float]] | None:
    """Version ``vid``'s capture-time statistics of ``names`` (None when it has none for all of them)."""
    record = plumbing.manifest(vid).tensor_stats
    if record is None:
        return None
    rows = record.rows()
    if not all(n in rows for n in names):
        return None
    return {n: rows[n] for n in names}


def recorded_or_read_stats(plumbing: Plumbing, rev: str, pattern: str | None = None,
                           on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
    """``tensor_stats`` answered from the statistics ``rev`` recorded at capture where it has them for every
    matching tensor (no data read), else read."""
    vid = plumbing.resolve(rev)
    m = plumbing.manifest(vid)
    entries = [e for e in m.tensors if not pattern or fnmatch.fnmatchcase(e.name, pattern)]
    recorded = recorded_stats(plumbing, vid, [e.name for e in entries])
    if recorded is None:
        return tensor_stats(plumbing, vid, pattern, on_bytes)
    plumbing.require_data(vid, m)
    out = []
    for e in entries:
        r = recorded[e.name]
        out.append(TensorStats(e.name, e.dtype, list(e.shape), e.numel, r["norm"], r["mean"], r["std"], r["min"],
                               r["max"], int(r["nan"]), int(r["inf"]), r["absmax"]))
    return out


def _stats_of(entry: TensorEntry, chunks: _Chunks, on_bytes: Callable[[int], None] | None) -> TensorStats:
    n = entry.numel if entry.pieces else 0
    count = 0
    mean = dev = norm = 0.0  # running mean and sqrt of the summed squared deviations (Chan et al.), across chunks
    lo, hi = math.inf, -math.inf
    nan = inf = 0
    for s, e in _spans(n, _chunk_elems(entry.dtype)):
        x = chunks.read(entry, s, e)
        if on_bytes is not None:
            on_bytes((e - s) * torch.empty((), dtype=TORCH_DTYPES[entry.dtype]).element_size())
        if x.is_complex():
            x = x.abs()
        isnan, isinf = torch.isnan(x), torch.isinf(x)
        nan += int(isnan.sum())
        inf += int(isinf.sum())
        finite = x[~(isnan | isinf)]
        k = finite.numel()
        if k:
            cmean = float(finite.mean())
            delta, total = cmean - mean, count + k
            mean += delta * k / total
            # m2 += cm2 + delta^2 * count * k / total, kept as its square root: no overflow past 1e154
            dev = math.hypot(dev, _norm(finite - cmean), abs(delta) * math.sqrt(count * k / total) if count else 0.0)
            count = total
            norm = math.hypot(norm, _norm(finite))
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    if not count:
        mean = lo = hi = math.nan
        if n:
            norm = math.nan     # like mean, min and max: over the finite values, and there are none
    std = dev / math.sqrt(count) if count else math.nan
    return TensorStats(entry.name, entry.dtype, list(entry.shape), entry.numel, norm,
                       mean, std, lo, hi, nan, inf, max(abs(lo), abs(hi)) if count else math.nan)
