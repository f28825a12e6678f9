"""Per-tensor statistics taken while a snapshot is captured, from the bytes being written.

Trajectory questions (how did this layer's norm evolve, where did the first NaN appear) are asked of
thousands of versions; reading every version's tensors to answer them costs the whole history's bytes.
The capture path already touches every byte it writes, so it summarises them on the way: each tensor's
count of finite values, mean, sum of squared deviations (merged across chunks by Chan's formula, which
stays accurate where ``E[x^2] - E[x]^2`` would cancel), min, max, and NaN and Inf counts. The manifest
records the derived ``STAT_COLUMNS`` (core/schema.py); ``tools/_trajectory.py`` answers from them.

CPU tensors are fed their bytes in order, in chunks that stay in cache, with numpy: single-threaded
SIMD loops that never start an OpenMP team beside the training loop's (torch reductions called from this
thread would), nor a BLAS thread pool (``np.dot`` over a chunk would). A float32 chunk (float16, bfloat16
and float8 ones reach here as float32) is widened once into float64, whose 53 bits hold its sum and its
deviations from the mean closely enough that the mean needs no correction pass: min, max, the widening
copy, the sum, the centring and the sum of squares.

CUDA tensors are summarised on the device, on the capture side stream, beside their copy (a segment's
parts together: saving/_device_copies.py); their small results come to the host once the copies are
synchronised anyway.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ckptrepo.core import Moments
from ckptrepo.core.schema import STAT_COLUMNS, TensorStatsRecord
from ckptrepo.storage import numpy_dtype

CHUNK_ELEMS = 1 << 16   # 256 KiB of float32: the chunk and its temporaries stay in L2
DEVICE_BLOCK = 1 << 22  # 4M elements: a CUDA block's float32 and float64 temporaries stay under 50 MB

_FLOAT_NATIVE = ("float32", "float64")
# float64 magnitudes whose squares, summed over a chunk, stay normal numbers
_SAFE_64 = (1e-140, 1e140)
NOT_RECORDED = math.nan
_scratch = threading.local()   # per thread (the capture thread, a test's): a float64 chunk, reused


def _wide(k: int) -> np.ndarray:
    """This thread's float64 scratch of ``k`` elements (at most ``CHUNK_ELEMS``): a chunk's deviations."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = np.empty(CHUNK_ELEMS, dtype=np.float64)
    return buf[:k]


class HostStats:
    """Statistics of one tensor whose bytes are fed in order (``update``), as the dedup hashers are."""

    __slots__ = ("dtype", "_np", "_kind", "_m")

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._np = numpy_dtype(dtype)
        self._kind = self._np.kind     # f: float, c: complex, i/u/b: integers and bools; V: float8 (ml_dtypes)
        self._m = Moments()

    def update(self, data: Any) -> None:
        """Feed the next bytes of the tensor (a uint8 numpy array, a whole number of elements)."""
        values = np.frombuffer(data, dtype=self._np) if not isinstance(data, np.ndarray) else data.view(self._np)
        for s in range(0, len(values), CHUNK_ELEMS):
            self._chunk(values[s:s + CHUNK_ELEMS])

    def _chunk(self, x: np.ndarray) -> None:
        if self.dtype not in _FLOAT_NATIVE:
            if self._kind == "c":
                x = np.abs(x)
            else:   # halves, bfloat16, float8, integers, bools: exact in float32/float64
                x = x.astype(np.float64 if self._kind in "iub" else np.float32)
        m = self._m
        lo, hi = float(x.min()), float(x.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):   # NaN propagates through min and max
            nan = np.isnan(x)
            inf = np.isinf(x)
            m.nan += int(nan.sum())
            m.inf += int(inf.sum())
            x = x[~(nan | inf)]
            if not len(x):
                return
            lo, hi = float(x.min()), float(x.max())
        k = len(x)
        top = max(abs(lo), abs(hi))
        if x.dtype.itemsize == 4:
            # float32 values are float64 values: widened once into a cached float64 chunk, the mean is summed
            # (pairwise) in float64, close enough that the deviations need no correction; one pass per quantity,
            # each a SIMD loop over cached data
            d = _wide(k)
            np.copyto(d, x)
            mean = float(d.sum()) / k
            d -= mean
            dev = math.sqrt(float(np.einsum("i,i", d, d)))
        elif top == 0.0 or _SAFE_64[0] < top < _SAFE_64[1]:
            # the corrected two-pass algorithm: centred on a first mean, then that mean corrected by the
            # deviations' own mean; the squares carry the spread, not the offset (numpy sums pairwise)
            mean = float(x.sum()) / k
            d = np.subtract(x, mean, out=_wide(k))
            r = float(d.sum()) / k
            mean += r
            dev = math.sqrt(max(0.0, float(np.einsum("i,i", d, d)) - k * r * r))
        else:   # squares would overflow or underflow: scaled by the largest magnitude
            d = np.divide(x, top, out=_wide(k))
            mean = float(d.sum()) / k
            d -= mean
            dev = top * math.sqrt(float(np.einsum("i,i", d, d)))
            mean *= top
        m.add(k, mean, dev, lo, hi)

    def moments(self) -> Moments:
        return self._m


class DeviceStats:
    """Statistics of one CUDA tensor, computed by kernels queued on the current (side) stream.

    ``update_device`` takes device slices and queues the work in blocks of ``DEVICE_BLOCK`` elements, each
    converted to float32 (float64 stays float64), so its temporaries stay a few tens of MB whatever the
    tensor and every dtype torch stores is covered (float8 has no reductions of its own). Nothing waits for
    the device until ``moments``, which runs once the capture thread has synchronised its copies. A tensor
    holding NaN or Inf records their counts; its other statistics are left unrecorded (NaN): filtering on
    the device would cost a copy of the tensor. (The host path reports the finite values' statistics.)
    """

    __slots__ = ("dtype", "_parts", "_counts", "_rows")

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._parts: list[Any] = []     # per block, on the device: mean, dev, min, max, NaN count, Inf count
        self._counts: list[int] = []    # per block, on the host: its elements
        self._rows: list[tuple[Any, int, int]] = []   # batched blocks: (StatRows, row, elements)

    def add_row(self, rows: Any, row: int, count: int) -> None:
        """A block of ``count`` elements summarised with other tensors' blocks (saving/_device_copies.py):
        row ``row`` of ``rows`` (a ``StatRows``); plain Python, so the capture thread makes no torch call."""
        self._rows.append((rows, row, count))

    def update_device(self, x: Any) -> None:
        import torch
        for s in range(0, x.numel(), DEVICE_BLOCK):
            block = x[s:s + DEVICE_BLOCK]
            if block.is_complex():
                block = block.abs()
            if block.dtype not in (torch.float32, torch.float64):   # integers exact in float64, halves in float32
                block = block.float() if block.is_floating_point() else block.double()
            n = block.numel()
            lo, hi = torch.aminmax(block)
            mean = block.sum(dtype=torch.float64) / n
            dev = torch.linalg.vector_norm(block - mean.to(block.dtype), dtype=torch.float64)
            nan = torch.isnan(block).sum()
            inf = torch.isinf(block).sum()
            self._parts.append(torch.stack([mean, dev, lo.double(), hi.double(), nan.double(), inf.double()]))
            self._counts.append(n)

    def moments(self) -> Moments:
        import torch
        m = Moments()
        blocks: list[tuple[int, list[float]]] = []
        if self._parts:
            blocks += zip(self._counts, torch.stack(self._parts).cpu().tolist())
        blocks += [(n, rows.host()[r]) for rows, r, n in self._rows]
        for n, (mean, dev, lo, hi, nan, inf) in blocks:
            if nan or inf:
                m.unknown = True   # only the counts of this part are right: see the class docstring
            m.nan += int(nan)
            m.inf += int(inf)
            m.add(n, mean, dev, lo, hi)
        self._parts, self._counts, self._rows = [], [], []
        return m


class Tee:
    """Feeds one tensor's bytes to both its dedup hasher and its statistics."""

    __slots__ = ("hasher", "stats")

    def __init__(self, hasher: Any, stats: HostStats) -> None:
        self.hasher = hasher
        self.stats = stats

    def update(self, data: Any) -> None:
        self.hasher.update(data)
        self.stats.update(data)


def full_row(row: tuple[float, ...], delta: float = NOT_RECORDED, relative: float = NOT_RECORDED) -> tuple[float, ...]:
    """A recorded row: the statistics, then the change from the parent (NaN where it was not measured)."""
    out = (*row, delta, relative)
    assert len(out) == len(STAT_COLUMNS)
    return out


def stat_feeds(job: Any, records: list[Any], hashers: dict[int, Any]) -> tuple[dict[int, Any], dict[int, Any]]:
    """The statistics of each planned tensor or piece (plan index -> HostStats or DeviceStats), and what its
    staged bytes feed: its hasher, its statistics, or both."""
    stats: dict[int, Any] = {pi: DeviceStats(r.dtype) if r.tensor.is_cuda else HostStats(r.dtype)
                             for pi, r in enumerate(records)}
    feeds: dict[int, Any] = dict(stats)
    for pi, h in hashers.items():
        feeds[pi] = Tee(h, stats[pi])
    return stats, feeds


def piece_moments(job: Any) -> tuple[tuple[str, Any], ...] | None:
    """A sharded job's moments per piece, written or reused (global name, ``Moments.to_raw()``), in record
    order, for rank 0 to merge into the version's statistics; None when the snapshotter takes none. Those
    of the written pieces are kept in ``job.piece_moments`` for the next snapshot's dedup."""
    if not job.record_stats:
        return None
    out = []
    for i, r in enumerate(job.records):
        if not r.numel:
            continue
        if i in job.reused_moments:
            out.append((r.name, job.reused_moments[i]))
            continue
        pi = job.plan_index.get(i)
        if pi in job.stats:
            raw = job.piece_moments[pi] = job.stats[pi].moments().to_raw()
            out.append((r.name, raw))
    return tuple(out)


def stats_record(job: Any) -> TensorStatsRecord | None:
    """The ``tensor_stats`` of a single-process job at commit: written tensors from what their bytes fed,
    reused ones (unchanged since the version they point into) from that version's, with no change."""
    if job.sharded or job.plan is None or not job.record_stats:
        return None
    placement = {ri: pi for pi, ri in enumerate(job.written)}
    names, rows = [], []
    for i, r in enumerate(job.records):
        if i in job.reused:
            prev = job.reused[i].stats
            row = full_row(prev, 0.0, 0.0) if prev is not None else (NOT_RECORDED,) * len(STAT_COLUMNS)
        else:
            feed = job.stats.get(placement.get(i, -1))
            if feed is None:
                row = (NOT_RECORDED,) * len(STAT_COLUMNS)
            else:
                job.stat_rows[i] = feed.moments().row(r.numel)
                row = full_row(job.stat_rows[i])
        names.append(r.name)
        rows.append(row)
    return TensorStatsRecord.of_rows(names, rows)
