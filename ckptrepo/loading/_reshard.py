"""Layout loads: fill target pieces from saved pieces, reading only the bytes they need.

For each target piece (a box of a global tensor and the local view that
receives it) and each saved piece of that tensor, the intersection of the two
boxes is a set of element runs in the saved piece's row-major storage
(:func:`ckptrepo.core._boxes.runs`). Runs of one saved array are merged into read
spans only across gaps smaller than an inner chunk (storage fetches and
verifies whole inner chunks anyway); each span is one read of the engine
(``_engine``), which reads it and hands it its elements. A span says where the
direct reader may put them itself: when it lands in one contiguous stretch of
the target (a whole piece, a pipeline stage, a column-parallel slice), straight
there; when it lands in evenly spaced rows of a strided view (a row-parallel
column block, loaded into wider or narrower rows), through the reader thread's
cache-sized buffer, copied out a verified megabyte at a time (``_RowTarget``);
otherwise the span scatters a buffer into its targets with one strided copy.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import torch

from ckptrepo.core import Box, intersect, row_major_strides, runs, slices, volume
from ckptrepo.core.schema import Manifest
from ckptrepo.core.schema import Piece as SavedPiece
from ckptrepo.errors import CorruptionError
from ckptrepo.loading._engine import Engine, Read, ReadStats
from ckptrepo.parallel import Piece
from ckptrepo.state import TORCH_DTYPES
from ckptrepo.storage import ArrayInfo
from ckptrepo.storage.protocol import Store


class _Span(Read):
    """A read span of one saved array and the parts of target pieces it fills: per job, ``(target piece,
    saved box, the part of both, the saved piece's offset, the starts of the part's runs in the span, run
    length)``."""

    __slots__ = ("jobs", "byte_views")

    def __init__(self, array: str, start: int, stop: int, job: tuple[Any, ...],
                 byte_views: dict[int, Any]) -> None:
        super().__init__(array, start, stop)
        self.jobs = [job]
        self.byte_views = byte_views   # per target piece (by id), shared by a plan's spans: see _byte_view

    def names(self) -> list[str]:
        return sorted({job[0].name for job in self.jobs})

    def prepare(self, info: ArrayInfo) -> None:
        tp = self.jobs[0][0]
        if len(self.jobs) == 1 and id(tp) not in self.byte_views:
            self.byte_views[id(tp)] = _byte_view(tp.view, TORCH_DTYPES[info.dtype])

    def direct_target(self, info: ArrayInfo) -> np.ndarray | _RowTarget | None:
        if len(self.jobs) != 1:
            return None
        return _direct_destination(self, info, self.byte_views[id(self.jobs[0][0])])

    def fill(self, src: torch.Tensor) -> None:
        """Copy the span's elements, read into a buffer (TensorStore's, or scratch), to its targets."""
        for job in self.jobs:
            _scatter(src, self.start, *job)


class VersionReader:
    """Reads target pieces from one version: its pieces indexed by tensor, its arrays opened once.

    Keep one per version when reading many times (the inspection tools read
    a tensor chunk by chunk).
    """

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.arrays = manifest.arrays
        self.saved: dict[str, tuple[SavedPiece, ...]] = {t.name: t.pieces for t in manifest.tensors}
        self.engine = Engine(store, self.arrays)

    def read(self, targets: list[Piece], stats: ReadStats | None = None,
             skip_digest: int | None = None) -> ReadStats:
        """Fill every target piece's view from the version's saved pieces (checking the digest of each saved piece
        read whole, but for those of algorithm ``skip_digest``, which the caller checks itself)."""
        stats = stats or ReadStats()
        self.engine.execute(_plan(targets, self.saved, self.arrays, stats, skip_digest))
        return stats


def read_pieces(store: Store, manifest: Manifest, targets: list[Piece],
                stats: ReadStats | None = None) -> ReadStats:
    """Fill every target piece's view from the version's saved pieces (once; see VersionReader)."""
    return VersionReader(store, manifest).read(targets, stats)


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

    def rows(self) -> np.ndarray:
        """The target rows as bytes, ``[rows, row bytes]``: in order, a whole saved piece's bytes when the span is
        one (what its digest is checked against, loading/_digest_check.py)."""
        return self.target

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


def _direct_destination(sp: _Span, info: ArrayInfo, view: np.ndarray | None) -> np.ndarray | _RowTarget | None:
    """Where the direct reader can put a one-job span's elements itself: the bytes of the contiguous stretch of
    the target piece's ``view`` (its bytes, see ``_byte_view``) that its one run lands in, or the rows of a
    strided one (``_RowTarget``); None: a scratch buffer."""
    tp, _sbox, part, _offset, starts, length = sp.jobs[0]
    if view is None:
        return None
    item = info.itemsize
    rel = [p - t for p, t in zip(part[0], tp.box[0])]
    if rel:   # numpy slicing: a few hundred spans per load, and a torch index costs several times as much
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
          stats: ReadStats, skip_digest: int | None = None) -> list[_Span]:
    """Group every (target, saved piece) intersection's runs into read spans."""
    spans: list[_Span] = []
    byte_views: dict[int, Any] = {}
    for tp in targets:
        have = saved.get(tp.name)
        if have is None:
            raise CorruptionError(f"{tp.name} is not in the version's tensor table; run `ckptrepo fsck`")
        covered = 0
        for sbox, array, offset, digest in have:
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
                sp = _Span(array, int(starts[lo]), int(starts[hi - 1]) + length,
                           (tp, sbox, part, offset, starts[lo:hi], length), byte_views)
                if digest is not None and part == sbox and len(starts) == 1 and digest[0] != skip_digest:
                    # the whole saved piece, in order
                    sp.digest, sp.box = digest, sbox
                stats.requested_bytes += (sp.stop - sp.start) * info.itemsize
                stats.spans += 1
                spans.append(sp)
        if covered != volume(tp.box[1]):
            raise CorruptionError(f"{tp.name}: the version's pieces cover {covered} of the {volume(tp.box[1])} "
                                  f"elements this rank needs; run `ckptrepo fsck`")
    return spans   # in target order: the engine sorts them by array and offset


def _scatter(src: torch.Tensor, span_start: int, tp: Piece, sbox: Box, part: Box, offset: int,
             starts: np.ndarray, length: int) -> None:
    """Copy the runs of ``part`` that a read span holds into the target view."""
    dest = tp.view[slices([p - t for p, t in zip(part[0], tp.box[0])], part[1])]
    if len(starts) * length == volume(part[1]):
        # the span holds the whole part: one strided view of it, one copy
        first = int(starts[0]) - span_start
        # as_strided counts its offset from the storage's start: src may be a slice of a wider read (whole
        # inner chunks around the span), so its own offset comes first
        whole = src.as_strided(part[1], row_major_strides(sbox[1]), src.storage_offset() + first) if part[1] \
            else src[first:first + 1].view(())
        _copy(dest, whole)
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


__all__ = ["VersionReader", "read_pieces"]
