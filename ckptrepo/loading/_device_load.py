"""Loads onto a GPU: reads into a few pinned host buffers in rotation, host-to-device copies on a copy stream.

A tensor read to the CPU and then copied to the GPU costs the read plus the copy, and the copy from
pageable memory is slow and synchronous. Here the destinations on the device are cut into batches of at
most one staging buffer each; each batch is read (the read engine, ``_engine``, straight into the pinned
buffer where the direct reader can) while the batches read before it are copied to the device on a
copy stream, so a load costs about its read time plus one buffer's copy. Pinned memory is bounded:
``BUFFERS`` buffers of ``BUFFER_BYTES``; a buffer is reused once the event recorded after its copies says
they are done. The copy stream first waits for the caller's current stream (the destinations may have
been allocated or zeroed there) and is synchronised before the load returns, so the tensors are ready.

Front ends: whole tensors of a plain load (``read_tensors_to``) and target pieces of a layout load
(``read_pieces_to``); each cuts what it needs into transfers of at most a buffer, and reads a batch by
its own means. Destinations on other devices go the usual way.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from ckptrepo.core import Box, slices, volume
from ckptrepo.core.schema import Manifest, TensorEntry
from ckptrepo.loading._engine import Engine, Read, ReadStats
from ckptrepo.loading._reader import read_tensors
from ckptrepo.loading._reshard import VersionReader
from ckptrepo.parallel import Piece
from ckptrepo.state import BIGINT, NDARRAY, NPSCALAR, SCALAR, TORCH_DTYPES, wordsum_digests
from ckptrepo.storage import WORDSUM, ArrayInfo, PieceHasher, checkable, mismatch_error
from ckptrepo.storage.protocol import Store

__all__ = ["BUFFERS", "BUFFER_BYTES", "DEVICE_TYPES", "Pipeline", "Transfer", "batches", "ndarray_leaves",
           "read_pieces_to", "read_tensors_to", "split_box"]

BUFFER_BYTES = 64 << 20   # one staging buffer: a batch of reads, copied to the device as one group
BUFFERS = 4               # pinned buffers in rotation: some being read into, the others being copied from
READERS = 2               # batches read at once (the engine's reader threads serve both)
ALIGN = 64                # each staged tensor starts at a multiple of this in its buffer
DEVICE_TYPES = ("cuda",)  # destinations loaded through the pipeline (tests add "cpu" to exercise it)
# devices whose pipelines check WORDSUM digests (a CUDA snapshot's) on the device, with the function capture took
# them with, after the copies: on the host, numpy's WORDSUM would run far slower than the pipeline reads
DEVICE_DIGESTS = ("cuda",)


@dataclass
class Transfer:
    """Elements bound for ``dest`` (a device view of ``shape``), staged first as a contiguous host tensor of
    that shape and dtype; ``what`` is the front end's own note of what to read into it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    dest: torch.Tensor
    what: Any

    @property
    def nbytes(self) -> int:
        return volume(self.shape) * self.dtype.itemsize


def batches(transfers: Sequence[Transfer], buffer_bytes: int) -> list[list[tuple[Transfer, int]]]:
    """Pack transfers, in order, into batches of one buffer each: (transfer, byte offset in the buffer)."""
    out: list[list[tuple[Transfer, int]]] = []
    batch: list[tuple[Transfer, int]] = []
    pos = 0
    for t in transfers:
        n = t.nbytes
        if n > buffer_bytes:
            raise ValueError(f"a transfer of {n} bytes does not fit a {buffer_bytes}-byte staging buffer")
        at = -(-pos // ALIGN) * ALIGN
        if batch and at + n > buffer_bytes:
            out.append(batch)
            batch, at = [], 0
        batch.append((t, at))
        pos = at + n
    if batch:
        out.append(batch)
    return out


def split_box(box: Box, max_elems: int) -> list[Box]:
    """Cut ``box`` into boxes of at most ``max_elems`` elements, in row-major order: whole rows of its first
    dimension where one row fits, else each row cut the same way."""
    offsets, sizes = tuple(box[0]), tuple(box[1])
    if not sizes or volume(sizes) <= max_elems:
        return [(offsets, sizes)]
    row = volume(sizes[1:])
    if row <= max_elems:
        rows = max(1, max_elems // row)
        return [((offsets[0] + a,) + offsets[1:], (min(rows, sizes[0] - a),) + sizes[1:])
                for a in range(0, sizes[0], rows)]
    return [((offsets[0] + a,) + o, (1,) + s)
            for a in range(sizes[0]) for o, s in split_box((offsets[1:], sizes[1:]), max_elems)]


class Pipeline:
    """Reads batches of transfers into staging buffers and copies them to their destinations, overlapped.

    ``copy(dests, hosts)`` queues the copies of one batch (default: ``copy_(non_blocking=True)`` each, on
    the copy stream); ``pin``: whether buffers are pinned (default: for a CUDA device).
    """

    def __init__(self, device: torch.device, buffer_bytes: int | None = None, buffers: int | None = None,
                 readers: int = READERS, pin: bool | None = None,
                 copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None) -> None:
        self.device = device
        self.buffer_bytes = buffer_bytes or BUFFER_BYTES   # the module's, read now (tests shrink them)
        self.buffers = max(2, buffers or BUFFERS)
        self.readers = max(1, min(readers, self.buffers - 1))   # a buffer is always left to copy from
        self.cuda = device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.stream: Any = torch.cuda.Stream(device=device) if self.cuda else None
        self._copy = copy
        self._free: deque[torch.Tensor] = deque()
        self._copying: deque[tuple[torch.Tensor, Any]] = deque()   # (buffer, event after its copies), oldest first
        self.allocated = 0
        self.copied_batches = 0

    def run(self, transfers: Sequence[Transfer],
            read: Callable[[list[tuple[Transfer, torch.Tensor]]], None],
            check: Callable[[list[tuple[Transfer, torch.Tensor]]], None] | None = None) -> None:
        """Fill every transfer's destination: ``read`` fills a batch's host tensors (in a worker thread);
        ``check`` is given each batch's host tensors in plan order, once read, while its copies run."""
        plan = batches(transfers, self.buffer_bytes)
        if not plan:
            return
        if self.cuda:   # the destinations were made (or zeroed) on the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        reading: deque[tuple[list[tuple[Transfer, int]], torch.Tensor, list[torch.Tensor], Future]] = deque()
        pool = ThreadPoolExecutor(self.readers, thread_name_prefix="ckptrepo-load")
        grad = torch.is_grad_enabled()
        try:
            for batch in plan:
                buf = self._take()
                hosts = [buf[at:at + t.nbytes].view(t.dtype).view(t.shape) for t, at in batch]
                reading.append((batch, buf, hosts, pool.submit(_read_in, read, list(zip((t for t, _ in batch), hosts)),
                                                               grad)))
                if len(reading) >= self.readers:
                    self._copy_batch(*reading.popleft(), check)
            while reading:
                self._copy_batch(*reading.popleft(), check)
        finally:
            for _, _, _, fut in reading:   # a failed load: no reader writes into a buffer after this returns
                fut.cancel()
            pool.shutdown(wait=True)
            if self.cuda:
                self.stream.synchronize()
            self._copying.clear()

    def _take(self) -> torch.Tensor:
        if self._free:
            return self._free.popleft()
        if self.allocated < self.buffers:
            self.allocated += 1
            return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)
        buf, event = self._copying.popleft()   # the oldest copies: done first
        if event is not None:
            event.synchronize()
        return buf

    def _copy_batch(self, batch: list[tuple[Transfer, int]], buf: torch.Tensor, hosts: list[torch.Tensor],
                    fut: Future, check: Callable[[list[tuple[Transfer, torch.Tensor]]], None] | None = None) -> None:
        fut.result()
        dests = [t.dest for t, _ in batch]
        event = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self._queue_copies(dests, hosts)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            self._queue_copies(dests, hosts)
        self.copied_batches += 1
        self._copying.append((buf, event))
        if check is not None:   # the buffer is not reused before the next batch is taken: it is still this batch's
            check([(t, h) for (t, _), h in zip(batch, hosts)])

    def _queue_copies(self, dests: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
        if self._copy is not None:
            self._copy(dests, hosts)
            return
        for d, h in zip(dests, hosts):
            d.copy_(h, non_blocking=self.cuda)

    def after(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``'s device work on the copy stream, after every copy queued so far (the caller's run
        synchronises it before returning only if it comes first: call this before ``run`` returns, or run
        nothing after)."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                fn()
            self.stream.synchronize()
        else:
            fn()


def _read_in(read: Callable[[list[tuple[Transfer, torch.Tensor]]], None],
             pairs: list[tuple[Transfer, torch.Tensor]], grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        read(pairs)


def pipelined(t: torch.Tensor | None, device: torch.device | None) -> bool:
    """Whether a destination (or, where there is none yet, a fresh tensor on ``device``) is filled through the
    pipeline."""
    if t is not None:
        return t.device.type in DEVICE_TYPES
    return device is not None and device.type in DEVICE_TYPES


# ---- whole tensors (plain loads) ----------------------------------------------------------------------------
class _StagedRead(Read):
    """Elements of one tensor's range, read into a host tensor (a staging buffer's view)."""

    __slots__ = ("name", "host")

    def __init__(self, array: str, start: int, stop: int, name: str, host: torch.Tensor) -> None:
        super().__init__(array, start, stop)
        self.name, self.host = name, host

    def names(self) -> list[str]:
        return [self.name]

    def direct_target(self, info: ArrayInfo) -> torch.Tensor:
        return self.host

    def fill(self, src: torch.Tensor) -> None:
        self.host.copy_(src.view(self.host.dtype))


def read_tensors_to(store: Store, arrays: dict[str, ArrayInfo], entries: list[TensorEntry], wanted: list[int],
                    into: dict[int, torch.Tensor] | None = None, device: torch.device | None = None,
                    on_host: set[int] | frozenset[int] = frozenset(),
                    on_bytes: Callable[[int], None] | None = None, pipeline: Pipeline | None = None
                    ) -> dict[int, torch.Tensor]:
    """``read_tensors``, with the destinations on a GPU (``into``'s, or fresh ones on ``device`` but for the
    indices ``on_host``: numpy leaves) filled through the pipeline; the rest read as ``read_tensors`` does."""
    into = into or {}
    engine = Engine(store, arrays)
    gpu = [i for i in wanted if i not in on_host and pipelined(into.get(i), device)]
    host = [i for i in wanted if i not in set(gpu)]
    out = read_tensors(store, arrays, entries, host, {i: into[i] for i in host if i in into}, on_bytes,
                       engine) if host else {}
    if not gpu:
        return out
    dev = into[gpu[0]].device if gpu[0] in into else device
    assert dev is not None
    pipe = pipeline or Pipeline(dev)
    on_device = pipe.device.type in DEVICE_DIGESTS
    transfers: list[Transfer] = []
    unstrided: list[tuple[torch.Tensor, torch.Tensor]] = []   # (destination, contiguous stand-in on the device)
    device_checks: list[tuple[str, Any, torch.Tensor]] = []   # WORDSUM pieces checked on the device
    for i in gpu:
        e = entries[i]
        dtype = TORCH_DTYPES[e.dtype]
        dest = into[i] if i in into else torch.empty(e.shape, dtype=dtype, device=device)
        out[i] = dest
        if e.numel == 0 or e.array is None:
            continue
        flat = dest.view(-1) if _flat_ok(dest) else None
        if flat is None:
            flat = torch.empty(e.numel, dtype=dtype, device=dest.device)
            unstrided.append((dest, flat))
        if on_device and _device_digest(e.pieces[0].digest) and len(e.pieces) == 1:
            device_checks.append((e.name, e.pieces[0], flat))
        step = max(1, pipe.buffer_bytes // flat.element_size())
        for a in range(0, e.numel, step):
            b = min(e.numel, a + step)
            transfers.append(Transfer(dtype, (b - a,), flat[a:b], (e.array, e.offset + a, e.offset + b, e.name)))

    def read(pairs: list[tuple[Transfer, torch.Tensor]]) -> None:
        engine.execute([_StagedRead(t.what[0], t.what[1], t.what[2], t.what[3], h) for t, h in pairs], on_bytes)

    pipe.run(transfers, read, _WholeDigests(entries, gpu, on_device).check)
    if device_checks:
        pipe.after(partial(_check_on_device, device_checks))
    def into_strided() -> None:
        for d, f in unstrided:
            d.copy_(f.view(d.shape))
    if unstrided:
        pipe.after(into_strided)
    return out


class _WholeDigests:
    """The content digests of the tensors a plain load sends through the pipeline, each taken over its staged
    host bytes as the batches come in plan order (a tensor larger than a buffer spans several), and checked
    once its last transfer is in: where the host already has the bytes, whatever the device."""

    def __init__(self, entries: list[TensorEntry], wanted: list[int], on_device: bool) -> None:
        self.hashers = {entries[i].name: (entries[i], PieceHasher(digest[0]))
                        for i in wanted if len(entries[i].pieces) == 1
                        for digest in (entries[i].pieces[0].digest,) if digest is not None and checkable(digest)
                        and not (on_device and _device_digest(digest))}

    def check(self, pairs: list[tuple[Transfer, torch.Tensor]]) -> None:
        for t, host in pairs:
            array, _start, stop, name = t.what
            got = self.hashers.get(name)
            if got is None:
                continue
            entry, hasher = got
            hasher.update(host.reshape(-1).view(torch.uint8).numpy())
            piece = entry.pieces[0]
            if stop == piece.offset + entry.numel and hasher.digest() != piece.digest:
                raise mismatch_error(name, piece.box, array, piece.offset, entry.numel)


def _device_digest(digest: bytes | None) -> bool:
    """Whether a recorded digest is WORDSUM, which a CUDA pipeline checks on the device."""
    return digest is not None and checkable(digest) and digest[0] == WORDSUM


def _check_on_device(checks: list[tuple[str, Any, torch.Tensor]]) -> None:
    """Compare WORDSUM digests of pieces on the device (in the current stream, after their copies) with the
    recorded ones: the bytes as they arrived, whatever copy follows."""
    got = wordsum_digests([t for _, _, t in checks])
    for (name, piece, _), digest in zip(checks, got):
        if digest != piece.digest:
            raise mismatch_error(name, piece.box, piece.array, piece.offset, volume(piece.box[1]))


def _flat_ok(t: torch.Tensor) -> bool:
    """Whether a destination can be filled through a flat view of itself."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def ndarray_leaves(tree: Any) -> set[int]:
    """The tensor-table indices of a skeleton's numpy leaves: they load on the host whatever the device."""
    out: set[int] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        if not isinstance(node, (list, tuple)) or not node:
            continue
        tag = node[0]
        if tag == NDARRAY:
            out.add(node[1])
        elif tag not in (SCALAR, BIGINT, NPSCALAR):
            todo.extend(c for c in node[1:] if isinstance(c, (list, tuple)))
    return out


# ---- target pieces (layout loads) -----------------------------------------------------------------------------
_PLAN_LOCK = threading.Lock()   # the read statistics of batches planned in two reader threads at once


def read_pieces_to(store: Store, manifest: Manifest, targets: list[Piece], stats: ReadStats | None = None,
                   pipeline: Pipeline | None = None) -> ReadStats:
    """``read_pieces``, with the target pieces whose views are on a GPU filled through the pipeline: each cut
    into boxes of at most a buffer, read into staged pieces of the same global tensor, then copied into the
    view's part."""
    stats = stats or ReadStats()
    reader = VersionReader(store, manifest)
    gpu = [p for p in targets if pipelined(p.view, None) and p.view.numel()]
    host = [p for p in targets if not (pipelined(p.view, None) and p.view.numel())]
    if host:
        reader.read(host, stats)
    if not gpu:
        return stats
    pipe = pipeline or Pipeline(gpu[0].view.device)
    on_device = pipe.device.type in DEVICE_DIGESTS
    device_checks = []   # saved WORDSUM pieces that are target pieces: checked on the device, after the copies
    for p in gpu:
        whole = _same_piece(p, reader.saved) if on_device else None
        if whole is not None and _device_digest(whole.digest):
            device_checks.append((p.name, whole, p.view))
    transfers = []
    for p in gpu:
        dtype = TORCH_DTYPES[p.dtype]
        for box in split_box(p.box, max(1, pipe.buffer_bytes // dtype.itemsize)):
            rel = [o - b for o, b in zip(box[0], p.box[0])]
            dest = p.view[slices(rel, box[1])] if box[1] else p.view
            transfers.append(Transfer(dtype, tuple(box[1]), dest, (p, box)))

    def read(pairs: list[tuple[Transfer, torch.Tensor]]) -> None:
        staged = [Piece(t.what[0].name, t.what[0].dtype, t.what[0].gshape, t.what[1], h) for t, h in pairs]
        mine = ReadStats()
        reader.read(staged, mine, skip_digest=WORDSUM if on_device else None)
        with _PLAN_LOCK:
            stats.needed_bytes += mine.needed_bytes
            stats.requested_bytes += mine.requested_bytes
            stats.spans += mine.spans
            stats.runs += mine.runs

    pipe.run(transfers, read, _SplitPieceDigests(gpu, reader.saved, transfers, on_device).check)
    if device_checks:
        pipe.after(partial(_check_on_device, device_checks))
    return stats


def _same_piece(p: Piece, saved: dict[str, Any]) -> Any:
    """The saved piece whose box is target piece ``p``'s, or None."""
    box = tuple(map(tuple, p.box))
    return next((s for s in saved.get(p.name, ()) if tuple(map(tuple, s.box)) == box), None)


class _SplitPieceDigests:
    """The content digests of saved pieces that a layout load reads whole through the pipeline in several
    transfers (a target piece that is a saved piece, larger than a buffer): split_box cuts it in row-major
    order, so its staged boxes, in plan order, are its bytes in order. A saved piece that fits in one transfer
    is checked by the read engine (a span covering it whole)."""

    def __init__(self, targets: list[Piece], saved: dict[str, Any], transfers: list[Transfer],
                 on_device: bool) -> None:
        count: dict[int, int] = {}
        for t in transfers:
            count[id(t.what[0])] = count.get(id(t.what[0]), 0) + 1
        self.open: dict[int, tuple[Any, PieceHasher, int]] = {}   # id(target) -> (saved piece, hasher, bytes left)
        for p in targets:
            if count.get(id(p), 0) < 2:
                continue
            whole = _same_piece(p, saved)
            digest = None if whole is None else whole.digest
            if digest is not None and checkable(digest) and not (on_device and _device_digest(digest)):
                nbytes = p.view.numel() * TORCH_DTYPES[p.dtype].itemsize
                self.open[id(p)] = (whole, PieceHasher(digest[0]), nbytes)

    def check(self, pairs: list[tuple[Transfer, torch.Tensor]]) -> None:
        for t, host in pairs:
            p = t.what[0]
            got = self.open.get(id(p))
            if got is None:
                continue
            saved, hasher, left = got
            raw = host.reshape(-1).view(torch.uint8).numpy()
            hasher.update(raw)
            left -= raw.nbytes
            self.open[id(p)] = (saved, hasher, left)
            if left == 0 and hasher.digest() != saved.digest:
                raise mismatch_error(p.name, saved.box, saved.array, saved.offset, volume(saved.box[1]))
