"""Fill target pieces from saved pieces, reading only the bytes they need.

For each target piece (a box of a global tensor and the local view that
receives it) and each saved piece of that tensor, the intersection of the two
boxes is a set of element runs in the saved piece's row-major storage
(:func:`ckptrepo.boxes.runs`). Runs of one saved array are merged into read
spans only across gaps smaller than an inner chunk (TensorStore fetches and
verifies whole inner chunks anyway), and every span is read with a
TensorStore byte-range read, all issued at once in one ``ts.Batch``. A span's
elements are then scattered into the target view with one strided copy. On a
local ``file`` store, spans are read by :class:`ckptrepo.localread.DirectReader`
(``preadv``, crc32c checked; spans sharing an inner chunk in one go, so it is
read once): a span that lands in one contiguous stretch of the target (a
whole piece, a pipeline stage, a column-parallel slice) straight into it; a
span that lands in evenly spaced rows of a strided view (a row-parallel
column block, loaded into wider or narrower rows) through the reader
thread's cache-sized buffer, copied out a verified megabyte at a time; any
other into a buffer it is scattered from once read. Anything unexpected falls
back to TensorStore.

``ReadStats`` counts what was needed, what was requested, and (through
TensorStore's kvstore metrics) what storage actually delivered.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import tensorstore as ts
import torch

from ckptrepo.core._boxes import Box, intersect, row_major_strides, runs, slices, volume
from ckptrepo.core.schema import Manifest
from ckptrepo.core.schema import Piece as SavedPiece
from ckptrepo.errors import CorruptionError, damaged_object_error, first_line, looks_damaged, storage_failure
from ckptrepo.loading import _reader as reader
from ckptrepo.parallel._sharding import Piece
from ckptrepo.state._providers import TORCH_DTYPES
from ckptrepo.storage import _localread as localread
from ckptrepo.storage._arrays import ArrayHandles, ArrayInfo
from ckptrepo.storage._localread import DirectReader
from ckptrepo.storage._tensorstore import local_bytes_read
from ckptrepo.storage.protocol import Store

INFLIGHT_BYTES = 512 << 20


@dataclass
class ReadStats:
    """Bytes a load needed, the bytes it asked storage for, and how many reads."""

    needed_bytes: int = 0
    requested_bytes: int = 0
    spans: int = 0
    runs: int = 0


@dataclass
class _Span:
    array: str
    start: int
    stop: int
    jobs: list[tuple[Any, ...]] = field(default_factory=list)


def kvstore_bytes_read() -> int:
    """Bytes this process has read from storage so far: every TensorStore kvstore driver's own counter
    (file, s3, gcs, memory) plus the direct local-file paths' (tensor data, small objects)."""
    total = localread.bytes_read() + local_bytes_read()
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if m["name"].endswith("/bytes_read"):
            total += sum(int(v.get("value", 0)) for v in m.get("values", []))
    return total


class VersionReader:
    """Reads target pieces from one version: its pieces indexed by tensor, its arrays opened once.

    Keep one per version when reading many times (the inspection tools read
    a tensor chunk by chunk).
    """

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.arrays = manifest.arrays
        self.saved: dict[str, tuple[SavedPiece, ...]] = {t.name: t.pieces for t in manifest.tensors}
        self.handle = ArrayHandles(store, self.arrays).get

    def read(self, targets: list[Piece], stats: ReadStats | None = None) -> ReadStats:
        """Fill every target piece's view from the version's saved pieces."""
        stats = stats or ReadStats()
        _read(self.store, self.arrays, self.handle, _plan(targets, self.saved, self.arrays, stats))
        return stats


def read_pieces(store: Store, manifest: Manifest, targets: list[Piece],
                stats: ReadStats | None = None) -> ReadStats:
    """Fill every target piece's view from the version's saved pieces (once; see VersionReader)."""
    return VersionReader(store, manifest).read(targets, stats)


def _read(store: Store, arrays: dict[str, ArrayInfo], handle: Any, spans: list[_Span]) -> None:
    """Read the spans (directly from local files where possible) and scatter them into their targets."""
    direct = DirectReader.for_store(store) if reader.DIRECT_READS else None
    byte_views: dict[int, np.ndarray | None] = {}   # per target piece (by id): see _byte_view
    if direct is not None:
        # all made before the first read starts: torch lets go of the GIL in each call _byte_view makes, and
        # once the readers run, taking it back costs a switch each time (~50 ms of a 4-to-2 rank load's first)
        for sp in spans:
            if len(sp.jobs) == 1 and id(sp.jobs[0][0]) not in byte_views:
                byte_views[id(sp.jobs[0][0])] = _byte_view(sp.jobs[0][0].view, TORCH_DTYPES[arrays[sp.array].dtype])
    try:
        i = 0
        while i < len(spans):
            batch, group, nbytes = ts.Batch(), [], 0
            while i < len(spans) and (not group or nbytes < INFLIGHT_BYTES):
                if direct is not None:
                    run = _direct_run(spans, i, arrays, byte_views)
                    info = arrays[run.array]
                    futs = direct.submit(info, run, run.entries, dict(enumerate(run.dests)))
                    # a strided span is scattered by the reader thread that finishes the last task covering it,
                    # while later tasks still read; not here: the main thread would queue for the GIL between
                    # copies while the readers run Python
                    scattered = [_when_all([f for f in futs if _covers(f, sp)], partial(_scatter_span, sp, scratch))
                                 for sp, scratch in zip(run.spans, run.scratch) if scratch is not None]
                    group.append((list(zip(run.spans, run.scratch)), None, _when_all(futs + scattered, _nothing)))
                    nbytes += (run.stop - run.start) * info.itemsize
                    i += len(run.spans)
                    continue
                sp = spans[i]
                group.append(([sp], handle(sp.array)[sp.start:sp.stop].read(batch=batch), None))
                nbytes += (sp.stop - sp.start) * arrays[sp.array].itemsize
                i += 1
            batch.submit()
            for members, fut, direct_done in group:
                if direct_done is not None:
                    try:
                        # checked while the reads are in flight (a cold small read costs a disk round trip)
                        ok = direct.metadata_ok(arrays[members[0][0].array])
                        direct_done.result()
                    except Exception:  # noqa: BLE001 - anything unexpected: TensorStore reads (and judges) them
                        ok = False
                    if ok:
                        continue
                    members = [sp for sp, _ in members]
                for sp in members:
                    _read_span_ts(sp, handle(sp.array) if fut is None else None, fut, arrays[sp.array])
    finally:
        if direct is not None:
            direct.close()


def _read_span_ts(sp: _Span, h: Any, fut: Any, info: ArrayInfo) -> None:
    """Finish (or, with ``h``, issue) a span's TensorStore read and scatter it into the targets."""
    try:
        data = (h[sp.start:sp.stop].read() if fut is None else fut).result()
    except Exception as err:  # noqa: BLE001
        raise _span_error(info, sp, err) from err
    _scatter_span(sp, torch.from_numpy(data.view(np.uint8)).view(TORCH_DTYPES[info.dtype]))


@dataclass
class _Entry:
    offset: int
    numel: int


@dataclass
class _DirectRun:
    """Consecutive spans of one array read in one go by localread.DirectReader, each into its target memory.

    Spans that share an inner chunk are read together so that chunk is read once.
    """

    array: str
    start: int
    stop: int
    spans: list[_Span] = field(default_factory=list)
    entries: list[_Entry] = field(default_factory=list)
    dests: list[Any] = field(default_factory=list)     # per span: a contiguous tensor or a _RowTarget
    scratch: list[torch.Tensor | None] = field(default_factory=list)   # per span: a buffer to scatter from

    def add(self, sp: _Span, info: ArrayInfo, byte_views: dict[int, np.ndarray | None]) -> None:
        dest: Any = _direct_destination(sp, info, byte_views)
        scratch = None
        if dest is None:
            dest = scratch = torch.empty(sp.stop - sp.start, dtype=TORCH_DTYPES[info.dtype])
        self.spans.append(sp)
        self.entries.append(_Entry(sp.start, sp.stop - sp.start))
        self.dests.append(dest)
        self.scratch.append(scratch)
        self.stop = sp.stop

    @property
    def members(self) -> range:
        return range(len(self.entries))


class _RowTarget:
    """A span whose target is rows of a strided view (a column block of a wider tensor, or a column slice
    of a saved block): the reader copies each verified batch of elements straight into those rows.

    Both sides must be a uniform stack of rows of the part's innermost dimension: in the saved piece
    (row starts an arithmetic sequence) and in the target view (its leading dimensions collapse into one
    stride). Each reader task copies the rows (and parts of rows at its edges) that its elements hold,
    from a buffer of its own that is still in cache, so no span-sized scratch is allocated, filled and
    scattered once every task is done. Tasks write disjoint bytes: no lock.
    """

    __slots__ = ("target", "first", "step", "n", "length", "item")

    def __init__(self, target: np.ndarray, first: int, step: int, item: int) -> None:
        self.target = target   # the target rows as uint8, [n, length * item]
        self.first, self.step, self.item = first, step, item   # in elements: where row 0 starts, row to row
        self.n, self.length = target.shape[0], target.shape[1] // item

    @classmethod
    def build(cls, sp: _Span, info: ArrayInfo, dest: np.ndarray) -> "_RowTarget | None":
        """The row target of a one-job span whose part lands in ``dest`` (bytes of a plain CPU view, its last
        dimension contiguous: see ``_byte_view``), or None."""
        _tp, sbox, part, offset, _starts, _length = sp.jobs[0]
        nd = len(part[1])
        # the part's rows are evenly spaced in the saved piece when it spans every middle dimension
        if nd < 2 or any(part[1][d] != sbox[1][d] for d in range(1, nd - 1)):
            return None
        length, n_all = part[1][-1], volume(part[1][:-1])
        strides = row_major_strides(sbox[1])
        step = strides[-2]
        first = offset + sum((q - o) * st for q, o, st in zip(part[0], sbox[0], strides))
        r0 = max(0, -((first - sp.start) // step))            # the rows that start inside the span
        r1 = min(n_all, -((first - sp.stop) // step))
        if r0 >= r1:
            return None
        target = dest
        if nd > 2:
            try:   # only if the leading dims collapse: no copy
                target = target.reshape((n_all, length * info.itemsize), copy=False)
            except ValueError:
                return None
        return cls(target[r0:r1], first + r0 * step, step, info.itemsize)

    def scatter(self, src: np.ndarray, a: int, b: int) -> None:
        """Copy array elements ``[a, b)``, held by ``src`` (uint8, verified), into the target rows they belong to."""
        target, s0, step, n, length, item = self.target, self.first, self.step, self.n, self.length, self.item
        r_min = max(0, (a - length - s0) // step + 1)          # the rows that meet [a, b)
        r_max = min(n, -((s0 - b) // step))
        if r_min >= r_max:
            return
        f_lo = max(r_min, -((s0 - a) // step))                 # the rows wholly inside [a, b)
        f_hi = min(r_max, (b - length - s0) // step + 1)
        if f_lo < f_hi:
            first = (s0 + f_lo * step - a) * item
            # the rows as a strided view of src: np.ndarray checks the bounds in C, where as_strided runs
            # a dozen lines of Python under the GIL that the other reader threads are waiting for
            np.copyto(target[f_lo:f_hi],
                      np.ndarray((f_hi - f_lo, length * item), np.uint8, src, first, (step * item, 1)))
        for r in {r_min, r_max - 1}:                          # rows that [a, b) cuts: at most these two
            if f_lo <= r < f_hi:
                continue
            s = s0 + r * step
            lo, hi = max(s, a), min(s + length, b)
            target[r, (lo - s) * item:(hi - s) * item] = src[(lo - a) * item:(hi - a) * item]


def _scatter_span(sp: _Span, src: torch.Tensor) -> None:
    """Copy a span's elements, read into a buffer (TensorStore's, or scratch for a strided target), to its targets."""
    for job in sp.jobs:
        _scatter(src, sp.start, *job)


def _nothing() -> None:
    pass


def _covers(fut: Future, sp: _Span) -> bool:
    """Whether a direct read task holds part of the span (a task without a range: assume it does)."""
    lo, hi = getattr(fut, "elems", (sp.start, sp.stop))
    return lo < sp.stop and hi > sp.start


def _when_all(futs: list[Future], then: Callable[[], None]) -> Future:
    """A future that runs ``then`` in the thread that completes the last of ``futs`` once all succeeded.

    Callbacks, not a waiting task: a task waiting in the same pool for others could starve it.
    """
    done: Future = Future()
    left = [len(futs)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(f: Future) -> None:
        # a task the reader cancelled once the load failed: its exception() would raise in this callback
        err = CancelledError() if f.cancelled() else f.exception()
        with lock:
            if err is not None:
                errors.append(err)
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        if errors:
            done.set_exception(errors[0])
            return
        try:
            then()
        except BaseException as err2:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err2)
        else:
            done.set_result(None)

    if not futs:   # nothing to wait for: run it now
        futs = [Future()]
        left[0] = 1
        futs[0].set_result(None)
    for f in futs:
        f.add_done_callback(one)
    return done


def _direct_run(spans: list[_Span], i: int, arrays: dict[str, ArrayInfo],
                byte_views: dict[int, np.ndarray | None]) -> _DirectRun:
    """The direct read starting at span ``i``: it and the following spans that share its inner chunks."""
    info = arrays[spans[i].array]
    run = _DirectRun(spans[i].array, spans[i].start, spans[i].stop)
    run.add(spans[i], info, byte_views)
    inner = info.inner_elems
    j = i + 1
    while j < len(spans) and spans[j].array == run.array and spans[j].start >= run.stop \
            and spans[j].start // inner <= (run.stop - 1) // inner:
        run.add(spans[j], info, byte_views)
        j += 1
    return run


def _direct_destination(sp: _Span, info: ArrayInfo,
                        byte_views: dict[int, np.ndarray | None]) -> np.ndarray | _RowTarget | None:
    """Where the direct reader can put a span's elements itself: the bytes of the contiguous stretch of a
    plain CPU view that its one run lands in, or the rows of a strided one (``_RowTarget``); None: a scratch
    buffer."""
    if len(sp.jobs) != 1:
        return None
    tp, _sbox, part, _offset, starts, length = sp.jobs[0]
    view = byte_views[id(tp)]   # made for every one-job span before the reads start (_read)
    if view is None:
        return None
    item = info.itemsize
    rel = [p - t for p, t in zip(part[0], tp.box[0])]
    if rel:   # numpy slicing: a few hundred spans per load, where a torch index costs ~10x as much
        rel[-1] *= item
    sizes = part[1][:-1] + (part[1][-1] * item,) if part[1] else ()
    dest = view[slices(rel, sizes)]
    if len(starts) == 1 and length == volume(part[1]) and dest.flags.c_contiguous:
        return dest.reshape(-1)
    return _RowTarget.build(sp, info, dest)


def _byte_view(view: torch.Tensor, dtype: torch.dtype) -> np.ndarray | None:
    """A target view's memory as numpy bytes (the last dimension ``itemsize`` times longer), or None where
    the direct reader must not write into it: not a plain CPU tensor of the stored dtype, or strided in its
    last dimension. Made once per target piece, so each span's destination is a numpy slice of it."""
    if view.device.type != "cpu" or view.dtype != dtype or view.requires_grad or view.is_conj() or view.is_neg():
        return None
    if view.dim() == 0:
        view = view.reshape(1)
    if view.numel() == 0 or view.stride(-1) != 1:
        return None
    return view.view(torch.uint8).numpy()


def _plan(targets: list[Piece], saved: dict[str, tuple[SavedPiece, ...]], arrays: dict[str, ArrayInfo],
          stats: ReadStats) -> list[_Span]:
    """Group every (target, saved piece) intersection's runs into read spans."""
    spans: list[_Span] = []
    for tp in targets:
        have = saved.get(tp.name)
        if have is None:
            raise CorruptionError(f"{tp.name} is not in the version's tensor table; run `ckptrepo fsck`")
        covered = 0
        for sbox, array, offset in have:
            part = intersect(sbox, tp.box)
            if part is None:
                continue
            covered += volume(part[1])
            info = arrays[array]
            starts, length = runs(sbox, part)
            starts = starts + offset
            stats.runs += len(starts)
            stats.needed_bytes += volume(part[1]) * info.itemsize
            if len(starts) == 1:   # one run (a whole piece, a slab of rows): one span, no gaps to look for
                bounds: Any = ((0, 1),)
            else:   # split where the gap to the next run exceeds an inner chunk: those bytes are not worth reading
                gaps = starts[1:] - (starts[:-1] + length)
                cuts = np.flatnonzero(gaps > info.inner_elems) + 1
                bounds = zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(starts)])))
            for lo, hi in bounds:
                sp = _Span(array, int(starts[lo]), int(starts[hi - 1]) + length)
                sp.jobs.append((tp, sbox, part, offset, starts[lo:hi], length))
                stats.requested_bytes += (sp.stop - sp.start) * info.itemsize
                stats.spans += 1
                spans.append(sp)
        if covered != volume(tp.box[1]):
            raise CorruptionError(f"{tp.name}: the version's pieces cover {covered} of the {volume(tp.box[1])} "
                                  f"elements this rank needs; run `ckptrepo fsck`")
    spans.sort(key=lambda s: (s.array, s.start))
    return spans


def _scatter(src: torch.Tensor, span_start: int, tp: Piece, sbox: Box, part: Box, offset: int,
             starts: np.ndarray, length: int) -> None:
    """Copy the runs of ``part`` that a read span holds into the target view."""
    dest = tp.view[slices([p - t for p, t in zip(part[0], tp.box[0])], part[1])]
    if len(starts) * length == volume(part[1]):
        # the span holds the whole part: one strided view of it, one copy
        first = int(starts[0]) - span_start
        _copy(dest, src.as_strided(part[1], row_major_strides(sbox[1]), first) if part[1]
              else src[first:first + 1].view(()))
        return
    # the part is split over several spans: copy run by run (through a buffer when dest is not contiguous)
    all_starts, _ = runs(sbox, part)
    row_of = {int(s) + offset: k for k, s in enumerate(all_starts)}
    # a strided part is read, changed and written back whole: its spans are scattered by whichever reader
    # threads finish them, so two of them at once would each write back the other's rows as they were
    contiguous = dest.is_contiguous()
    with contextlib.nullcontext() if contiguous else _SPLIT_PART_LOCK:
        rows = dest.view(len(all_starts), length) if contiguous else dest.reshape(len(all_starts), length).clone()
        for s in starts:
            rows[row_of[int(s)]].copy_(src[int(s) - span_start:int(s) - span_start + length])
        if not contiguous:
            dest.copy_(rows.view(dest.shape))


_SPLIT_PART_LOCK = threading.Lock()   # see _scatter: a strided part split over several spans


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)``, by numpy for CPU tensors with contiguous rows: one thread that lets go of the GIL,
    where torch would start (or spin) an OpenMP team in a reader thread."""
    if dest.device.type == "cpu" and dest.dim() and dest.stride(-1) == 1 and src.stride(-1) == 1 \
            and dest.dtype == src.dtype and not dest.requires_grad and not (dest.is_conj() or dest.is_neg()):
        np.copyto(dest.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dest.copy_(src)


def _span_error(info: ArrayInfo, sp: _Span, err: Exception) -> Exception:
    names = sorted({job[0].name for job in sp.jobs})
    first, last = sp.start // info.shard_elems, (sp.stop - 1) // info.shard_elems
    objects = ", ".join(info.shard_key(s) for s in range(first, last + 1))
    reason = first_line(err)
    if looks_damaged(reason):
        return damaged_object_error(objects, reason, names)
    return storage_failure(f"reading {objects}", reason)


__all__ = ["ReadStats", "VersionReader", "kvstore_bytes_read", "read_pieces"]
