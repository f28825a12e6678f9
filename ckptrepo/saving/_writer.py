"""Coalescing plans, the staging pool, and segment filling for the save path.

The plan packs every tensor of one dtype back to back into one flat stream and
cuts the stream into shard-sized segments; each segment is filled into one
staging buffer and written as one whole shard (see saving/_capture.py for the
pipeline). Plans depend only on the (dtype, shape) list and the shard size, so
they are cached and reused: a training loop plans once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ckptrepo.core import LruCache
from ckptrepo.state import TORCH_DTYPES, TensorRecord
from ckptrepo.storage import DIRECT_ALIGN, LiveShard, choose_geometry, itemsize, numpy_dtype


@dataclass(frozen=True)
class Placement:
    """Where one tensor's elements sit: its dtype stream and element offset there."""

    dtype: str
    offset: int
    numel: int


@dataclass(frozen=True)
class Segment:
    """One shard's worth of a stream and the tensor slices that fill it.

    ``parts`` holds ``(tensor index, first source element, first element within the segment, count)``.
    """

    dtype: str
    start: int
    stop: int
    parts: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class WritePlan:
    """The coalescing plan for one state structure."""

    signature: tuple[tuple[str, tuple[int, ...]], ...]
    streams: dict[str, tuple[int, int, int]]   # dtype -> (numel, shard_elems, inner_elems)
    placements: tuple[Placement, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (not the zeros that align some of them in their stream)."""
        return sum(p.numel * itemsize(p.dtype) for p in self.placements)


def plan_signature(records: Sequence[TensorRecord]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((r.dtype, r.shape) for r in records)


LIVE_ALIGN = DIRECT_ALIGN   # memory and file alignment of chunks written from where they are (O_DIRECT's)


def make_plan(records: Sequence[TensorRecord], shard_bytes: int | None = None,
              residues: Sequence[int | None] | None = None) -> WritePlan:
    """Pack tensors per dtype in state order and cut each stream into segments.

    ``residues`` (per record, None or a byte offset modulo ``LIVE_ALIGN``):
    such a tensor is placed where its first byte's stream offset has that
    residue, its memory address's (at most ``LIVE_ALIGN`` bytes of zeros
    before it). Every inner chunk wholly inside it is then page-aligned in
    memory as it is in the stream, so localwrite can write it with
    ``O_DIRECT`` from the tensor itself (``fill_live``).
    """
    totals: dict[str, int] = {}
    placements = []
    for i, r in enumerate(records):
        off = totals.get(r.dtype, 0)
        residue = residues[i] if residues is not None else None
        if residue is not None:
            item = itemsize(r.dtype)
            off += (residue // item - off) % (LIVE_ALIGN // item)
        placements.append(Placement(r.dtype, off, r.numel))
        totals[r.dtype] = off + r.numel
    streams = {}
    for dtype, numel in totals.items():
        if numel == 0:
            continue
        shard, inner = choose_geometry(dtype, numel, **({"shard_bytes": shard_bytes} if shard_bytes else {}))
        streams[dtype] = (numel, shard, inner)
    segments: list[Segment] = []
    for dtype, (numel, shard, _) in streams.items():
        members = [(i, p) for i, p in enumerate(placements) if p.dtype == dtype and p.numel]
        j = 0
        for start in range(0, numel, shard):
            stop = min(numel, start + shard)
            parts = []
            while j < len(members) and members[j][1].offset < stop:
                i, p = members[j]
                lo, hi = max(start, p.offset), min(stop, p.offset + p.numel)
                parts.append((i, lo - p.offset, lo - start, hi - lo))
                if p.offset + p.numel <= stop:
                    j += 1
                else:
                    break
            segments.append(Segment(dtype, start, stop, tuple(parts)))
    return WritePlan(plan_signature(records), streams, tuple(placements), tuple(segments))


def written_from_memory(nbytes: int, chunk_bytes: int) -> bool:
    """Whether a contiguous CPU tensor of ``nbytes`` is big enough to be written from its own memory (two inner
    chunks or more): placed by its address (``live_residues``), so a copy of it must keep that address's page
    offset (``_eager_copies.page_aligned_copy``)."""
    return nbytes >= 2 * chunk_bytes


def live_residues(records: Sequence[TensorRecord], chunk_bytes: int) -> tuple[int | None, ...]:
    """``make_plan``'s residues for writing from the tensors' memory: contiguous CPU tensors of two
    inner chunks or more are placed at their address's offset modulo ``LIVE_ALIGN``; the rest packed."""
    out = []
    for r in records:
        t = r.tensor
        big = t.device.type == "cpu" and t.is_contiguous() and written_from_memory(r.numel * t.element_size(),
                                                                                    chunk_bytes)
        out.append(t.data_ptr() % LIVE_ALIGN if big and t.data_ptr() % t.element_size() == 0 else None)
    return tuple(out)


class PlanCache:
    """Plans keyed by the state's (dtype, shape) signature and shard size; counts how often planning ran.

    Holds the few most recent plans (a training loop has one structure; an
    occasional other state, e.g. an evaluation snapshot, should not evict it).
    """

    def __init__(self, capacity: int = 8) -> None:
        self._plans: LruCache[tuple, WritePlan] = LruCache(capacity)  # snapshot() and capture threads share it
        self.misses = 0

    def get(self, records: Sequence[TensorRecord], shard_bytes: int | None = None,
            residues: Sequence[int | None] | None = None) -> WritePlan:
        """The plan for these records (``residues``: see ``make_plan``; a training loop's tensors keep their
        addresses, so it still plans once)."""
        key = (plan_signature(records), shard_bytes, None if residues is None else tuple(residues))

        def plan() -> WritePlan:   # runs under the cache's lock: one miss per new structure
            self.misses += 1
            return make_plan(records, shard_bytes, residues)
        return self._plans.get_or_make(key, plan)


class StagingPool:
    """A bounded set of reusable host buffers; ``take`` blocks when all are in use (backpressure).

    With ``align``, each buffer starts at a multiple of ``align`` bytes (it is
    allocated ``align`` bytes larger and sliced; pinned buffers too), so that
    it can be written with ``O_DIRECT`` as it is.

    Pinning is slow: allocating a pinned buffer takes tens of times longer than
    filling it from the GPU. A pool that grew only when ``take`` found none free
    would keep allocating inside the capture of snapshot after snapshot (the
    writes give buffers back, so each capture runs short by a few), and capture
    would run at the speed of pinning instead of the copy (benchmarks/RESULTS.md,
    gpu_capture.py). ``grow_in_background`` allocates what one snapshot needs in
    a thread of its own instead, once.
    """

    def __init__(self, buffer_bytes: int, max_buffers: int, pin: bool = False, align: int = 0) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max(1, max_buffers)
        self.pin = pin
        self.align = align
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cv = threading.Condition()
        self._growing: threading.Thread | None = None

    def take(self) -> torch.Tensor:
        with self._cv:
            while not self._free and self._allocated >= self.max_buffers:
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._allocated += 1
        return self._new_buffer()

    def _new_buffer(self) -> torch.Tensor:
        """A buffer for a slot already counted in ``_allocated``; the slot is given back if allocating fails."""
        try:
            return aligned_empty(self.buffer_bytes, self.align, pin=self.pin)
        except BaseException:
            with self._cv:
                self._allocated -= 1
                self._cv.notify()
            raise

    def has_room(self) -> bool:
        """Whether ``take`` would return without waiting for a ``give`` (a free buffer, or room for one more)."""
        with self._cv:
            return bool(self._free) or self._allocated < self.max_buffers

    def give(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def grow_in_background(self, buffers: int) -> None:
        """Allocate buffers, in a daemon thread, until ``buffers`` (at most the bound) exist; no-op while a
        growth is under way or when there are enough. A failed allocation (pinned memory runs out) stops the
        growth quietly: ``take`` then allocates, or raises, where the capture needs the buffer."""
        with self._cv:
            if self._allocated >= min(buffers, self.max_buffers) or self._growing is not None:
                return
            self._growing = threading.Thread(target=self._grow, args=(buffers,), name="ckptrepo-pool", daemon=True)
            self._growing.start()

    def _grow(self, buffers: int) -> None:
        try:
            while True:
                with self._cv:
                    if self._allocated >= min(buffers, self.max_buffers):
                        return
                    self._allocated += 1
                try:
                    buf = self._new_buffer()
                except BaseException:  # noqa: BLE001 - take() meets the same failure where it matters
                    return
                self.give(buf)
        finally:
            with self._cv:
                self._growing = None

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * (self.buffer_bytes + (0 if self.pin else self.align))


def aligned_empty(nbytes: int, align: int, pin: bool = False) -> torch.Tensor:
    """``nbytes`` uninitialised bytes starting at a multiple of ``align`` (0: anywhere).

    Pageable memory is allocated ``align`` bytes larger and sliced. Pinned memory is page-aligned as it comes
    (cudaHostAlloc), and is allocated at its exact size where that suffices: torch's pinned allocator rounds
    every request up to a power of two, so 64 MiB and one page more would pin 128 MiB.
    """
    if pin and align:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if buf.data_ptr() % align == 0:
            return buf
        del buf
    buf = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = (-buf.data_ptr()) % align if align else 0
    return buf[skip:skip + nbytes]


def fill_segment(seg: Segment, sources: Callable[[int], torch.Tensor], buf: torch.Tensor,
                 non_blocking: bool = False, hashers: Mapping[int, Any] | None = None) -> np.ndarray:
    """Copy the segment's tensor slices into ``buf``; return the numpy view TensorStore will write.

    (A local store with ``O_DIRECT`` and a CPU state skips this copy: ``fill_live``.)

    ``sources(i)`` is tensor ``i`` of the plan, in any shape; its elements are
    taken in row-major order. CPU sources are copied with a plain
    single-threaded memcpy (numpy), strided ones (the column blocks of a
    distributed snapshot) row by row from where they are: torch's ``copy_`` or
    ``reshape`` would start a second OpenMP team in the capture thread that
    fights the training loop's team for the same cores. With ``non_blocking``
    (CUDA sources, pinned ``buf``) the copies are only queued on the current
    stream: the caller must synchronise before writing.

    ``hashers`` (tensor index -> incremental hash, e.g. ``xxhash.xxh3_128()``,
    or statistics, saving/_tensor_stats.py) are fed the staged bytes of those
    tensors (``update``): the hash of exactly what is written; CUDA sources'
    slices go to ``update_device`` instead. A tensor's slices come in order as long as the
    segments of its dtype are filled in plan order.
    """
    torch_dtype = TORCH_DTYPES[seg.dtype]
    item = torch.empty((), dtype=torch_dtype).element_size()
    nbytes = (seg.stop - seg.start) * item
    raw = buf[:nbytes]
    raw_np = raw.numpy()
    typed = None
    for idx, src, dst, count in seg.parts:
        tensor = sources(idx)
        if tensor.device.type == "cpu":
            staged = raw_np[dst * item:(dst + count) * item]
            copy_flat_range(staged, tensor, src, count)
            if hashers is not None and idx in hashers:
                hashers[idx].update(staged)
        else:
            typed = raw.view(torch_dtype) if typed is None else typed
            part = tensor.reshape(-1)[src:src + count]
            if hashers is not None and idx in hashers:
                hashers[idx].update_device(part)   # summarised on the device, on this stream, before the copy
            typed[dst:dst + count].copy_(part, non_blocking=non_blocking)
    return raw_np.view(numpy_dtype(seg.dtype))


def fill_live(seg: Segment, sources: Callable[[int], torch.Tensor], buf: torch.Tensor, chunk_bytes: int,
              hashers: Mapping[int, Any] | None = None) -> tuple[list[np.ndarray], list[bool]]:
    """Prepare a segment of CPU tensors to be written as its shard object from where the bytes are.

    Returns one ``chunk_bytes`` uint8 array per inner chunk of the segment,
    and whether it is *live*: the tensor's own memory, where the chunk lies
    wholly inside one contiguous tensor at a ``LIVE_ALIGN``-aligned address
    (``live_residues`` placed big tensors so that all their inner chunks but
    the edges are); else slot ``k`` of ``buf`` (page-aligned, ``chunk_bytes``
    per slot), into which that chunk's bytes are copied here: tensor edges,
    small and strided tensors, the zeros between aligned tensors and past the
    array's end. Only those slots are written, so a state of big tensors costs
    almost no copy; the caller must keep the tensors unchanged until the live
    chunks are written or copied away (``localwrite.LiveShard.release``).
    ``hashers`` see each tensor's bytes in order, read where they are.
    """
    item = itemsize(seg.dtype)
    cb = chunk_bytes
    n = -(-(seg.stop - seg.start) * item // cb)
    raw = buf.numpy()
    if n * cb > raw.nbytes or buf.data_ptr() % LIVE_ALIGN or cb % LIVE_ALIGN:
        raise ValueError(f"a {raw.nbytes}-byte buffer cannot stage {n} chunks of {cb} bytes from where they are")
    chunks: list[np.ndarray | None] = [None] * n
    # each part's bytes where they are (None: strided), taken once: torch calls cost microseconds each,
    # numpy slices a fraction of one, and this runs per segment of every snapshot
    views: list[np.ndarray | None] = []
    for idx, src, dst, count in seg.parts:
        tensor = sources(idx)
        if tensor.device.type != "cpu":
            raise ValueError("only CPU tensors are written from where they are")
        flat = _flat_bytes(tensor)
        data = None if flat is None else flat[src * item:(src + count) * item]
        views.append(data)
        if data is None:
            continue
        lo, hi = dst * item, (dst + count) * item
        first = -(-lo // cb)
        if (tensor.data_ptr() + src * item + first * cb - lo) % LIVE_ALIGN == 0:
            chunks[first:hi // cb] = [data[a:a + cb] for a in range(first * cb - lo, (hi // cb) * cb - lo, cb)]
        if hashers is not None and idx in hashers:
            hashers[idx].update(data)
    live = [c is not None for c in chunks]

    def zero(a: int, b: int) -> None:
        for k in range(a // cb, -(-b // cb)):
            if not live[k]:
                raw[max(a, k * cb):min(b, (k + 1) * cb)] = 0

    pos = 0
    for (idx, src, dst, count), data in zip(seg.parts, views):
        lo, hi = dst * item, (dst + count) * item
        if lo > pos:
            zero(pos, lo)
        pos = hi
        if data is not None:
            for k in range(lo // cb, -(-hi // cb)):
                if not live[k]:
                    a, b = max(lo, k * cb), min(hi, (k + 1) * cb)
                    np.copyto(raw[a:b], data[a - lo:b - lo])
            continue
        tensor = sources(idx)
        hasher = hashers.get(idx) if hashers is not None else None
        for k in range(lo // cb, -(-hi // cb)):
            if live[k]:
                continue
            a, b = max(lo, k * cb), min(hi, (k + 1) * cb)
            copy_flat_range(raw[a:b], tensor, src + (a - lo) // item, (b - a) // item)
            if hasher is not None:
                hasher.update(raw[a:b])
    zero(pos, n * cb)
    return [c if c is not None else raw[k * cb:(k + 1) * cb] for k, c in enumerate(chunks)], live


FEED_CHUNKS = 4   # inner chunks per piece fed to hashes and statistics: 256 KiB, which stay in cache


def feed_live(seg: Segment, sources: Callable[[int], torch.Tensor], shard: LiveShard, chunk_bytes: int,
              feeds: Mapping[int, Any], scratch: np.ndarray) -> None:
    """Feed a live shard's bytes to the hashes and statistics of its tensors (``feeds``, by plan index), in order.

    Runs after the segment is queued for writing, so that the writes start
    at once and the pre-step hook never waits for this pass: a piece is read
    under the shard's lock, from the tensor's memory while its chunks are
    live, else from the shadow (``LiveShard.release`` copies what the feed
    has not read yet). Pieces end at every ``FEED_CHUNKS``-th chunk of the
    segment and at its tensors' edges, whatever is live, so the same state
    always gives the same figures; a piece over live and copied chunks is
    gathered into ``scratch`` (``FEED_CHUNKS * chunk_bytes`` bytes) first.
    """
    item = itemsize(seg.dtype)
    cb = chunk_bytes
    group = FEED_CHUNKS * cb
    raw = shard.shadow
    try:
        for idx, src, dst, count in seg.parts:
            feed = feeds.get(idx)
            if feed is None:
                continue
            flat = _flat_bytes(sources(idx))
            data = None if flat is None else flat[src * item:(src + count) * item]
            lo, hi = dst * item, (dst + count) * item
            a = lo
            while a < hi:
                b = min(hi, (a // group + 1) * group)
                with shard._lock:
                    ks = range(a // cb, -(-b // cb))
                    live = [shard.live[k] for k in ks]
                    if data is not None and all(live):
                        piece = data[a - lo:b - lo]
                    elif not any(live):
                        piece = raw[a:b]
                    else:
                        for k in ks:
                            x0, x1 = max(a, k * cb), min(b, (k + 1) * cb)
                            np.copyto(scratch[x0 - a:x1 - a], shard.chunks[k][x0 - k * cb:x1 - k * cb])
                        piece = scratch[:b - a]
                    feed.update(piece)
                    shard.fed_upto(b // cb)
                a = b
    finally:
        shard.feed_over()


def _flat_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor's bytes as a 1-D uint8 numpy view; None for a strided one."""
    if not tensor.is_contiguous():
        return None
    flat = tensor if tensor.dim() == 1 else tensor.view(-1)
    return flat.view(torch.uint8).numpy()


def copy_flat_range(staged: np.ndarray, tensor: torch.Tensor, start: int, count: int) -> None:
    """Copy elements ``[start, start + count)`` of a CPU tensor, in row-major order, into the bytes ``staged``.

    A tensor whose rows are contiguous (a column block of a weight: last
    stride 1, leading dimensions mergeable) is copied as a 2-D strided block
    plus the partial rows at either end, with no intermediate copy; anything
    stranger goes through ``reshape`` (one copy).
    """
    if tensor.is_contiguous():
        np.copyto(staged, tensor.reshape(-1)[start:start + count].view(torch.uint8).numpy())
        return
    rows = _byte_rows(tensor)
    if rows is None:
        part = torch.empty(count, dtype=tensor.dtype).copy_(tensor.reshape(-1)[start:start + count])
        np.copyto(staged, part.view(torch.uint8).numpy())
        return
    item = tensor.element_size()
    width = rows.shape[1]
    lo, hi = start * item, (start + count) * item
    r0, c0 = divmod(lo, width)
    r1, c1 = divmod(hi, width)
    if r0 == r1:
        np.copyto(staged, rows[r0, c0:c1])
        return
    pos = 0
    if c0:
        np.copyto(staged[:width - c0], rows[r0, c0:])
        pos, r0 = width - c0, r0 + 1
    if r1 > r0:
        n = (r1 - r0) * width
        np.copyto(staged[pos:pos + n].reshape(r1 - r0, width), rows[r0:r1])
        pos += n
    if c1:
        np.copyto(staged[pos:pos + c1], rows[r1, :c1])


def _byte_rows(tensor: torch.Tensor) -> np.ndarray | None:
    """The tensor as a 2-D numpy byte view (rows x bytes per row) without copying, or None if it is not one."""
    if tensor.dim() == 0 or tensor.stride(-1) != 1 or any(s < 0 for s in tensor.stride()):
        return None
    arr = tensor.view(torch.uint8).numpy()
    try:
        return arr.reshape((-1, arr.shape[-1]), copy=False)   # raises rather than copy if the leading dims split
    except ValueError:
        return None
