"""Diff and statistics between versions, over the tensor data, on every core and in bounded memory.

A call cuts the tensors it needs (those its pattern matches) into *jobs* of at
most ``CHUNK_BYTES`` stored bytes per version: a slice of a big tensor, or
several small tensors together. Worker threads (one per core) each take a job,
read exactly its bytes through the read engine (verified ``preadv`` into a
buffer the worker keeps, or TensorStore) and reduce them, ``BLOCK_ELEMS`` at a
time, to a *partial*: the moments of those elements for ``stats``, the norms,
dot product and largest difference for ``diff``. Partials are merged in element
order, pairwise (Chan et al. for mean and spread, core/_moments.py), so a result does not depend
on which thread finished first. Memory is the workers' buffers: a few
``CHUNK_BYTES`` each, whatever the checkpoint size.

Why threads and numpy: the reads (``preadv`` and crc32c) and numpy's loops let go
of the GIL, and a numpy call stays on the thread that makes it, where a torch op
would start an OpenMP team in each worker on top of the reader threads. Numpy
also keeps torch out of the process: the reads fill numpy buffers, bfloat16 and
the float8 formats are widened by their bits, and only a tensor saved as several
pieces (read through the resharding reader) imports torch, so a data command
starts in the time of its own work (docs/decisions/058).

Accuracy: every block is reduced in float64. float32, bfloat16 and float16
values cannot overflow or underflow float64 when squared, so their sums of
squares are taken as they are; float64 and complex values are scaled by their
largest magnitude first (a norm of 1e200s is 1e200s, not inf). Pieces that point
at the same stored bytes (dedup) are known to be equal without reading both.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import numpy as np

from ckptrepo.arguments import short_text
from ckptrepo.core import Plumbing, flat_boxes, merge_moments, volume
from ckptrepo.core.schema import Manifest, TensorEntry
from ckptrepo.loading import Engine, Read
from ckptrepo.state import plain_values
from ckptrepo.storage import ArrayInfo, itemsize
from ckptrepo.tools._float8 import widen_float8
from ckptrepo.tools._numeric import is_numeric

if TYPE_CHECKING:   # imported where a tensor is built: a tensor saved as several pieces
    from ckptrepo.loading import VersionReader
    from ckptrepo.parallel import Piece
from ckptrepo.tools._recorded import TensorStats

CHUNK_BYTES = 8 << 20     # stored bytes of one version that a job reads (a diff job reads as much of each side)
BLOCK_ELEMS = 1 << 17     # elements reduced at a time: float64 temporaries of a core's L2 size, calls long enough that
#                           the GIL handoffs between them cost little
MAX_WORKERS = 8           # worker threads, at most: each keeps buffers of about 2 * CHUNK_BYTES
_ALIGN = 16               # segments of a job's buffer start at multiples of this (complex128's itemsize)

# stored dtypes numpy reads as they are (bfloat16, float16 and the float8s are converted on the way)
_NUMPY: dict[str, Any] = {"float32": np.float32, "float64": np.float64, "complex64": np.complex64,
                          "complex128": np.complex128, "float16": np.float16, "bool": np.bool_,
                          "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
                          "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}
_NARROW = frozenset({"float32", "bfloat16", "float16"})   # squares fit float64 unscaled: the fast path


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return itemsize(dtype)


# ---------------------------------------------------------------- partials and their merges


@dataclass
class _Moments:
    """Statistics of a run of elements, over its finite values (of |x| for complex ones)."""

    count: int = 0            # finite values
    mean: float = 0.0
    dev: float = 0.0          # sqrt of the summed squared deviations from the mean: no overflow past 1e154
    norm: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nan: int = 0
    inf: int = 0


def _merge_moments(p: _Moments, q: _Moments) -> _Moments:
    """Two runs' moments together: count, mean and spread as core/_moments.py merges them, norms as a hypot."""
    count, mean, dev = merge_moments(p.count, p.mean, p.dev, q.count, q.mean, q.dev)
    norm = p.norm if not q.count else q.norm if not p.count else math.hypot(p.norm, q.norm)
    return _Moments(count, mean, dev, norm, min(p.lo, q.lo), max(p.hi, q.hi), p.nan + q.nan, p.inf + q.inf)


@dataclass
class _Delta:
    """How a run of elements differs between two versions. The dot product is kept in unit form, <x, y> =
    na * nb * cos, so that neither it nor na * nb overflows or underflows where the values are extreme."""

    l2: float = 0.0
    na: float = 0.0
    nb: float = 0.0
    cos: float = 0.0
    max_abs: float = 0.0
    differs: bool = False


def _merge_deltas(p: _Delta, q: _Delta) -> _Delta:
    na, nb = _hypot(p.na, q.na), _hypot(p.nb, q.nb)
    cos = 0.0   # where a norm is 0 or not finite the cosine is decided from the norms (see _tensor_diff)
    if na and nb and math.isfinite(na) and math.isfinite(nb):
        cos = (p.na / na) * (p.nb / nb) * p.cos + (q.na / na) * (q.nb / nb) * q.cos
    big = p.max_abs if p.max_abs != p.max_abs or p.max_abs >= q.max_abs else q.max_abs   # NaN wins, as in torch
    return _Delta(_hypot(p.l2, q.l2), na, nb, cos, big, p.differs or q.differs)


def _hypot(a: float, b: float) -> float:
    """The norm of two norms; NaN if either is (``math.hypot(inf, nan)`` is inf, where a norm over both is NaN)."""
    return a + b if a != a or b != b else math.hypot(a, b)


T = TypeVar("T")


def _pairwise(parts: list[T], merge: Callable[[T, T], T]) -> T:
    """Merge partials in their order as a balanced tree: rounding errors grow with the log of their number."""
    while len(parts) > 1:
        parts = [merge(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


# ---------------------------------------------------------------- reductions of one block (numpy, float64)


class _Scratch(threading.local):
    """A worker's float64 blocks (kept: no allocation and no page faults per block)."""

    def __init__(self) -> None:
        self.f64 = [np.empty(BLOCK_ELEMS) for _ in range(3)]
        self.f32 = [np.empty(BLOCK_ELEMS, dtype=np.float32) for _ in range(2)]   # per side: A's and B's block
        self.raw = np.empty(0, dtype=np.uint8)


_scratch = _Scratch()


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum: numpy's own loop, on this thread (np.dot's BLAS would start threads of its own)
    return float(np.einsum("i,i", a, b))


def _norm(x: np.ndarray) -> float:
    """||x|| of a float64/complex128 block, scaled by its largest magnitude first.

    Why: squaring overflows float64 from 1.3e154 up (a tensor of 1e200s had norm inf) and underflows
    below 1e-154; scaled, only the true norm's own range limits it. NaN if any value is NaN.
    """
    if not x.size:
        return 0.0
    a = np.abs(x)
    top = float(a.max())
    if top == 0.0 or not math.isfinite(top):
        return top      # 0, inf, or nan: what the norm is then
    a /= top
    return top * math.sqrt(_dot(a, a))


def _moments_wide(x: np.ndarray) -> _Moments:
    """Moments of a float64 (or complex128: of |x|) block, overflow-safe."""
    if x.dtype.kind == "c":
        x = np.abs(x)
    isnan, isinf = np.isnan(x), np.isinf(x)
    nan, inf = int(np.count_nonzero(isnan)), int(np.count_nonzero(isinf))
    finite = x[~(isnan | isinf)] if nan or inf else x
    k = finite.size
    if not k:
        return _Moments(nan=nan, inf=inf)
    mean = float(finite.mean())
    if not math.isfinite(mean):   # the sum overflowed: the mean of the values scaled down
        top = float(np.abs(finite).max())
        mean = top * float((finite / top).mean())
    return _Moments(k, mean, _norm(finite - mean), _norm(finite), float(finite.min()), float(finite.max()), nan, inf)


def _moments_narrow(x: np.ndarray) -> _Moments:
    """Moments of a float32 block: squares in float64 need no scaling."""
    lo, hi = float(x.min()), float(x.max())
    x64 = _scratch.f64[0][:x.size]
    np.copyto(x64, x)
    if not (math.isfinite(lo) and math.isfinite(hi)):   # NaN (min/max propagate it) or Inf in the block
        return _moments_wide(x64)
    n = x.size
    total, squares = float(np.add.reduce(x64)), _dot(x64, x64)
    mean = total / n
    m2 = squares - total * mean
    # the sum of squares less n * mean^2 cancels to noise where the mean dwarfs the spread: then center first
    if m2 * 1024 < squares:
        x64 -= mean
        m2 = _dot(x64, x64)
    return _Moments(n, mean, math.sqrt(max(m2, 0.0)), math.sqrt(squares), lo, hi)


def _delta_wide(x: np.ndarray, y: np.ndarray) -> _Delta:
    """How a float64/complex128 block differs, overflow-safe."""
    d = y - x
    cx, cy = _norm(x), _norm(y)
    cos = 0.0
    if cx and cy and math.isfinite(cx) and math.isfinite(cy):
        u, v = x / cx, y / cy
        cos = float(np.vdot(u, v).real) if u.dtype.kind == "c" else _dot(u, v)
    return _Delta(_norm(d), cx, cy, cos, float(np.abs(d).max()) if d.size else 0.0)


def _delta_narrow(x: np.ndarray, y: np.ndarray) -> _Delta:
    """How a float32 block differs: float64 squares, no scaling."""
    n = x.size
    x64, y64, d = (b[:n] for b in _scratch.f64)
    np.copyto(x64, x)
    np.copyto(y64, y)
    xx, yy = _dot(x64, x64), _dot(y64, y64)
    if not (math.isfinite(xx) and math.isfinite(yy)):   # NaN or Inf in the block
        return _delta_wide(x64, y64)
    np.subtract(y64, x64, out=d)   # exact: float32 operands, float64 result
    dd = _dot(d, d)
    na, nb = math.sqrt(xx), math.sqrt(yy)
    # <x, y> from the three sums of squares (a pass saved): its error is eps * (xx + yy), which is eps
    # relative to na * nb, so the cosine is as exact as with a product of its own
    cos = (xx + yy - dd) / 2 / (na * nb) if na and nb else 0.0
    np.abs(d, out=d)
    return _Delta(math.sqrt(dd), na, nb, cos, float(d.max()) if n else 0.0)


def _norm_block(x: np.ndarray) -> _Delta:
    """A block both versions hold as the same bytes: its norm, no difference."""
    if x.dtype == np.float32:
        x64 = _scratch.f64[0][:x.size]
        np.copyto(x64, x)
        xx = _dot(x64, x64)
        norm = math.sqrt(xx) if math.isfinite(xx) else _norm(x64)
    else:
        norm = _norm(x)
    return _Delta(0.0, norm, norm, 1.0 if norm and math.isfinite(norm) else 0.0, 0.0)


def _blocks(raw: np.ndarray, dtype: str, side: int = 0) -> Iterator[np.ndarray]:
    """A segment's stored bytes as blocks of computable values: float32 where exact (the fast path), else float64
    or complex128. A converted block lives in the worker's scratch for ``side`` until the next one."""
    if dtype == "float32":
        vals = raw.view(np.float32)
        for s in range(0, vals.size, BLOCK_ELEMS):
            yield vals[s:s + BLOCK_ELEMS]
    elif dtype == "bfloat16":   # bfloat16 is the top half of a float32: shift it into place
        u16 = raw.view(np.uint16)
        for s in range(0, u16.size, BLOCK_ELEMS):
            half = u16[s:s + BLOCK_ELEMS]
            u32 = _scratch.f32[side][:half.size].view(np.uint32)
            np.copyto(u32, half)
            u32 <<= 16
            yield u32.view(np.float32)
    elif dtype == "float16":
        h = raw.view(np.float16)
        for s in range(0, h.size, BLOCK_ELEMS):
            f32 = _scratch.f32[side][:min(BLOCK_ELEMS, h.size - s)]
            np.copyto(f32, h[s:s + BLOCK_ELEMS])
            yield f32
    elif dtype in _NUMPY:
        vals = raw.view(_NUMPY[dtype])
        wide = np.complex128 if vals.dtype.kind == "c" else np.float64
        for s in range(0, vals.size, BLOCK_ELEMS):
            block = vals[s:s + BLOCK_ELEMS]
            yield block if block.dtype == wide else block.astype(wide)   # the reductions never write their input
    else:   # the float8 formats, which numpy lacks: widened by a table of their values (exact in float64)
        for s in range(0, raw.size, BLOCK_ELEMS):
            yield widen_float8(raw[s:s + BLOCK_ELEMS], dtype)


def _words(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Stored bytes as integers as wide as the dtype allows: compared fast, bit for bit."""
    return raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}.get(itemsize, np.uint64))


# ---------------------------------------------------------------- reading a job's bytes


class _Into(Read):
    """Elements ``[start, stop)`` of a flat array, read into ``dest`` (its bytes, a numpy uint8 buffer)."""

    __slots__ = ("dest", "name")

    def __init__(self, array: str, start: int, stop: int, dest: np.ndarray, name: str) -> None:
        super().__init__(array, start, stop)
        self.dest, self.name = dest, name

    def names(self) -> list[str]:
        return [self.name]

    def direct_target(self, info: ArrayInfo) -> np.ndarray:
        return self.dest

    def elements(self, raw: np.ndarray, dtype: str) -> np.ndarray:
        return raw   # the bytes, as numpy: no tensor, so no torch

    def fill(self, src: Any) -> None:
        np.copyto(self.dest, src)


class _Side:
    """One version's tensors as the jobs read them: arrays opened once, shared by the workers."""

    def __init__(self, plumbing: Plumbing, manifest: Manifest) -> None:
        self.plumbing = plumbing
        self.arrays = dict(manifest.arrays)
        self.store = plumbing.data_store(manifest)
        self.engine = Engine(self.store, self.arrays)   # tensors saved whole: a flat range of one array each
        self.manifest = manifest
        self._pieces: VersionReader | None = None       # tensors saved as several pieces, made on first need

    def prepare(self, entry: TensorEntry) -> None:
        """Look up the arrays of a tensor's pieces (a dedup'd piece's are another version's), before any
        worker reads: the workers share ``arrays`` and only read it."""
        for p in entry.pieces:
            if p.array not in self.arrays:
                vid = p.array.split("/")[1]
                self.arrays[p.array] = self.plumbing.manifest(vid).arrays[p.array]
        if len(entry.pieces) > 1 and self._pieces is None:
            from ckptrepo.loading import VersionReader
            self._pieces = VersionReader(self.store, dataclasses.replace(self.manifest, arrays=self.arrays))

    def read(self, segments: list[tuple[TensorEntry, int, int, np.ndarray]]) -> None:
        """Fill each ``(entry, start, stop, dest)``: elements ``[start, stop)`` of the tensor in row-major order,
        as stored bytes, into ``dest``."""
        plan: list[Read] = []
        targets: list[Piece] = []
        for entry, start, stop, dest in segments:
            pieces = entry.pieces
            if len(pieces) == 1 and pieces[0].box[1] == entry.shape:
                off = pieces[0].offset
                plan.append(_Into(pieces[0].array, off + start, off + stop, dest, entry.name))
            else:  # saved by several ranks: the range is a few boxes, each filled from the pieces it meets
                import torch

                from ckptrepo.parallel import Piece
                from ckptrepo.state import TORCH_DTYPES
                t = torch.from_numpy(dest).view(TORCH_DTYPES[entry.dtype])
                targets += [Piece(entry.name, entry.dtype, entry.shape, box,
                                  t[f - start:f - start + volume(box[1])].view(box[1]))
                            for f, box in flat_boxes(entry.shape, start, stop)]
        if plan:
            self.engine.execute(plan)
        if targets:
            assert self._pieces is not None
            self._pieces.read(targets)


# ---------------------------------------------------------------- jobs


@dataclass
class _Segment:
    """Elements ``[start, stop)`` of output row ``row``'s tensor, at byte ``at`` of the job's buffers: ``entry``
    in version A, ``other`` in version B (diff; None: stats, or the same stored bytes, read once)."""

    row: int
    entry: TensorEntry
    other: TensorEntry | None
    start: int
    stop: int
    at: int

    @property
    def both(self) -> bool:
        return self.other is not None

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * _itemsize(self.entry.dtype)


@dataclass
class _Job:
    segments: list[_Segment] = field(default_factory=list)
    size: int = 0               # bytes of buffer it needs per side (segments aligned)

    def read_bytes(self) -> int:
        return sum(s.nbytes * (2 if s.both else 1) for s in self.segments)


def _jobs(rows: Iterable[tuple[int, TensorEntry, TensorEntry | None]]) -> Iterator[_Job]:
    """Cut the tensors ``(row, entry in A, entry in B or None)`` into jobs of at most ``CHUNK_BYTES`` per side."""
    job = _Job()
    for row, entry, other in rows:
        item = _itemsize(entry.dtype)
        step = max(1, CHUNK_BYTES // item)
        for s in range(0, entry.numel, step):
            e = min(entry.numel, s + step)
            size = -(-(e - s) * item // _ALIGN) * _ALIGN
            if job.segments and job.size + size > CHUNK_BYTES:
                yield job
                job = _Job()
            job.segments.append(_Segment(row, entry, other, s, e, job.size))
            job.size += size
    if job.segments:
        yield job


Partial = tuple[int, int, Any]   # (row, start, _Moments or _Delta)


def _run_jobs(jobs: Iterable[_Job], work: Callable[[_Job], list[Partial]],
              on_bytes: Callable[[int], None] | None) -> dict[int, list[tuple[int, Any]]]:
    """Run the jobs on the worker threads, a bounded number queued at once; the partials of each row."""
    workers = max(2, min(MAX_WORKERS, _usable_cpus()))
    out: dict[int, list[tuple[int, Any]]] = {}
    pending: deque[tuple[Future, _Job]] = deque()

    def finish() -> None:
        fut, job = pending.popleft()
        for row, start, part in fut.result():
            out.setdefault(row, []).append((start, part))
        if on_bytes is not None:   # on this thread: the caller's callback need not be thread-safe
            on_bytes(job.read_bytes())

    with ThreadPoolExecutor(workers, thread_name_prefix="ckptrepo-inspect") as pool:
        try:
            for job in jobs:
                if len(pending) >= 2 * workers:
                    finish()
                pending.append((pool.submit(_quietly, work, job), job))
            while pending:
                finish()
        finally:
            for fut, _ in pending:
                fut.cancel()
    return out


def _quietly(work: Callable[[_Job], list[Partial]], job: _Job) -> list[Partial]:
    with np.errstate(all="ignore"):   # inf - inf is NaN, as the results say: no warning for it
        return work(job)


def _buffer(nbytes: int, which: int) -> np.ndarray:
    """The worker's buffer ``which`` (0: version A, 1: version B) of at least ``nbytes`` bytes."""
    raw = _scratch.raw
    if raw.size < 2 * nbytes:
        raw = _scratch.raw = np.empty(2 * max(nbytes, CHUNK_BYTES + _ALIGN), dtype=np.uint8)
    half = raw.size // 2
    return raw[which * half:which * half + nbytes]


def _read_job(job: _Job, side: _Side, which: int, segments: list[_Segment]) -> np.ndarray:
    """Read the segments' bytes of version A (``which`` 0) or B (1) into the worker's buffer for it."""
    buf = _buffer(job.size, which)
    side.read([(s.entry if which == 0 else s.other, s.start, s.stop, buf[s.at:s.at + s.nbytes])  # type: ignore[misc]
               for s in segments])
    return buf


def _stats_job(side: _Side, job: _Job) -> list[Partial]:
    buf = _read_job(job, side, 0, job.segments)
    out: list[Partial] = []
    for s in job.segments:
        reduce = _moments_narrow if s.entry.dtype in _NARROW else _moments_wide
        parts = [reduce(b) for b in _blocks(buf[s.at:s.at + s.nbytes], s.entry.dtype)]
        out.append((s.row, s.start, _pairwise(parts, _merge_moments)))
    return out


def _diff_job(sa: _Side, sb: _Side, job: _Job) -> list[Partial]:
    ba = _read_job(job, sa, 0, job.segments)
    pairs = [s for s in job.segments if s.both]
    bb = _read_job(job, sb, 1, pairs) if pairs else ba
    out: list[Partial] = []
    for s in job.segments:
        dtype = s.entry.dtype
        ra = ba[s.at:s.at + s.nbytes]
        rb = bb[s.at:s.at + s.nbytes] if s.both else ra
        # by bits: NaN equals NaN where the bytes are equal, 0.0 differs from -0.0
        same = not s.both or np.array_equal(_words(ra, _itemsize(dtype)), _words(rb, _itemsize(dtype)))
        if same:
            parts = [_norm_block(x) for x in _blocks(ra, dtype)]
        else:
            reduce = _delta_narrow if dtype in _NARROW else _delta_wide
            parts = [reduce(x, y) for x, y in zip(_blocks(ra, dtype, 0), _blocks(rb, dtype, 1))]
        part = _pairwise(parts, _merge_deltas)
        part.differs = not same
        out.append((s.row, s.start, part))
    return out


def _merged(parts: list[tuple[int, Any]] | None, merge: Callable[[Any, Any], Any], empty: Any) -> Any:
    """A tensor's partials merged in element order (``empty``: it has no elements)."""
    return _pairwise([p for _, p in sorted(parts, key=lambda sp: sp[0])], merge) if parts else empty


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
    numeric: bool = True             # False: a non-float tensor or step counter, its numbers left out (NaN)

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
            g = groups.setdefault(key, {"prefix": key, "tensors": 0, "changed": 0, "l2": 0.0, "norm_a": 0.0,
                                        "numeric": 0})
            g["tensors"] += 1
            g["changed"] += t.status != "unchanged"
            if t.numeric:   # a tensor left out of the numbers is counted, not measured
                g["numeric"] += 1
                g["l2"] = math.hypot(g["l2"], t.l2)     # hypot: the norm of norms, without squaring into overflow
                g["norm_a"] = math.hypot(g["norm_a"], t.norm_a)
        out = []
        for g in groups.values():
            l2, na = g["l2"], g.pop("norm_a")
            if not g.pop("numeric"):
                out.append(dict(g, l2=math.nan, relative=math.nan))
                continue
            out.append(dict(g, relative=l2 / na if na else (0.0 if l2 == 0 else math.inf)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "tensors": [t.to_json() for t in self.tensors],
                "objects": [o.to_json() for o in self.objects]}


def diff_versions(plumbing: Plumbing, a: str, b: str, pattern: str | None = None,
                  on_bytes: Callable[[int], None] | None = None, include_nonfloat: bool = False) -> VersionDiff:
    """Compare versions ``a`` and ``b`` tensor by tensor (the tensors ``pattern`` matches, read in parallel
    jobs) and object by object. ``on_bytes`` is told the stored bytes of each job once it is read. A non-float
    tensor or step counter (tools/_numeric.py) is listed changed or unchanged with its numbers NaN, unless
    ``include_nonfloat``."""
    va, vb = plumbing.resolve(a), plumbing.resolve(b)
    ma, mb = plumbing.manifest(va), plumbing.manifest(vb)
    plumbing.require_data(va, ma)
    plumbing.require_data(vb, mb)
    ta = {t.name: t for t in ma.tensors}
    tb = {t.name: t for t in mb.tensors}
    sa, sb = _Side(plumbing, ma), _Side(plumbing, mb)
    result = VersionDiff(va, vb)
    rows: list[tuple[int, TensorEntry, TensorEntry | None]] = []
    compared: dict[int, TensorEntry] = {}
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
        row = len(result.tensors)
        result.tensors.append(TensorDiff(name, "unchanged"))   # filled in below
        compared[row] = ea
        if ea.pieces:
            same = ea.pieces == eb.pieces   # the very same stored bytes: read once, for the norm
            sa.prepare(ea)
            if not same:
                sb.prepare(eb)
            rows.append((row, ea, None if same else eb))
    partials = _run_jobs(_jobs(rows), functools.partial(_diff_job, sa, sb), on_bytes)
    for row, entry in compared.items():
        result.tensors[row] = _tensor_diff(entry, _merged(partials.get(row), _merge_deltas, _Delta()))
    if not include_nonfloat:
        for row, t in enumerate(result.tensors):
            entry = tb.get(t.name) or ta[t.name]   # the newer side decides (decision 050)
            if not is_numeric(entry.name, entry.dtype, entry.numel):
                result.tensors[row] = TensorDiff(t.name, t.status, t.dtype, t.shape, *(math.nan,) * 6, numeric=False)
    result.objects = _diff_objects(ma.tree, mb.tree)
    return result


def _tensor_diff(entry: TensorEntry, d: _Delta) -> TensorDiff:
    na, nb, l2 = d.na, d.nb, d.l2
    if not d.differs:   # the same bytes: no difference at all, whatever the values (NaN included)
        return TensorDiff(entry.name, "unchanged", entry.dtype, list(entry.shape), 0.0, 0.0, 0.0, 1.0, na, nb)
    rel = l2 / na if na else (0.0 if l2 == 0 else math.inf)
    if na and nb and math.isfinite(na) and math.isfinite(nb):
        cos = d.cos
    else:
        cos = (1.0 if na == nb else 0.0) if not (na and nb) else math.nan
    return TensorDiff(entry.name, "changed", entry.dtype, list(entry.shape), l2, rel, d.max_abs, cos, na, nb)


def tensor_stats(plumbing: Plumbing, rev: str, pattern: str | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
    """Norm, mean, std, min/max/absmax and NaN/Inf counts of every tensor of ``rev`` that ``pattern`` matches
    (read in parallel jobs); ``on_bytes`` is told the stored bytes of each job once it is read."""
    vid = plumbing.resolve(rev)
    m = plumbing.manifest(vid)
    plumbing.require_data(vid, m)
    side = _Side(plumbing, m)
    entries = [e for e in m.tensors if not pattern or fnmatch.fnmatchcase(e.name, pattern)]
    for e in entries:
        side.prepare(e)
    rows = [(row, e, None) for row, e in enumerate(entries) if e.pieces]
    partials = _run_jobs(_jobs(rows), functools.partial(_stats_job, side), on_bytes)
    return [_tensor_stats(e, _merged(partials.get(row), _merge_moments, _Moments())) for row, e in enumerate(entries)]


def _tensor_stats(entry: TensorEntry, m: _Moments) -> TensorStats:
    n = entry.numel if entry.pieces else 0
    if not m.count:   # no finite value: like mean, min and max, the norm (over the finite values) is undefined
        return TensorStats(entry.name, entry.dtype, list(entry.shape), entry.numel, math.nan if n else 0.0,
                           math.nan, math.nan, math.nan, math.nan, m.nan, m.inf, math.nan)
    return TensorStats(entry.name, entry.dtype, list(entry.shape), entry.numel, m.norm, m.mean,
                       m.dev / math.sqrt(m.count), m.lo, m.hi, m.nan, m.inf, max(abs(m.lo), abs(m.hi)))


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
