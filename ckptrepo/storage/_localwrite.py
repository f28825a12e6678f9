"""Whole-shard writes straight to local files: the fast save path for ``file`` stores.

The write-side counterpart of storage/_localread.py. Each filled staging segment is one
whole shard of a flat zarr v3 array (``sharding_indexed``, index at the end).
TensorStore writes such a shard correctly, but its write path spends CPU on
its encode copy, the portable software crc32c of its wheel, and a buffered
``write(2)`` into new page-cache pages (the largest of the three), and with
training using every core that CPU comes out of the training loop
(docs/decisions/004-odirect-direct-writer.md). Here, per shard object:

* from where the bytes are (``submit_live``, the snapshotter's way for a
  CPU state while ``O_DIRECT`` works): the inner chunks that lie wholly in
  one big tensor are written from the tensor's own memory (``saving._writer.fill_live``
  places big tensors at their address's offset within a page, so those chunks
  are page-aligned), the others from a staging buffer they were copied into.
  Each chunk's encoding starts on a device block (512 bytes, or 4096 where the
  device refuses 512): the chunk, its crc32c (storage/_crc.py: the ``fastcrc`` package,
  hardware CRC with the GIL released) and zeros up to the next block, which
  the index accounts for. No copy, no page-cache pages, no writeback; the
  snapshotter's pre-step hook copies whatever is not written yet when the
  optimizer is about to change the tensors (``LiveShard.release``);
* staged contiguously (``submit``: CUDA states, whose bytes must come to the
  host anyway): each inner chunk is copied into a page-aligned bounce buffer
  (``BOUNCE_BYTES`` per writer thread), its crc32c taken there while the
  bytes are in cache, and the bounce buffer written with ``O_DIRECT``.

``O_DIRECT`` is what makes both cheap: the same writer through the page cache
(``pwritev`` of views of the staging buffer, no user-space copy at all) costs
more CPU than the bounce-buffer copy, because of the page-cache write; and
writing from the tensors' memory saves the capture copy into staging, leaving
the crc32c and the kernel's pinning of the pages (benchmarks/RESULTS.md,
save_load.py and training_overhead.py; docs/architecture.md, "The save path").
A file system that refuses ``O_DIRECT`` (EINVAL) gets the page cache: the same
iovec, or ``pwritev`` of views of a contiguous staging buffer.

An object written through ``submit`` is byte-identical to TensorStore's
(tests/integration/test_localwrite.py checks every dtype size, partial last shards and
partial last inner chunks); one written from live memory differs only in the
block padding after each chunk, and TensorStore reads it back (tested too).
Both are written the way TensorStore's file kvstore writes a value (read
with strace on 0.1.86): to ``<key>.__lock`` in the same directory under an
open-file-description lock, fsync, rename to ``<key>``, fsync of the
directory; on an error the temporary file is removed. A crash leaves at
worst a ``.__lock`` file, which ``Store.list`` ignores and gc deletes with
its version's prefix, never a partial object under the final name. The
array's ``zarr.json`` is still created through TensorStore.
"""
from __future__ import annotations

import errno
import mmap
import os
import queue
import struct
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

try:
    import fcntl
except ImportError:   # not POSIX: every shard goes through TensorStore
    fcntl = None  # type: ignore[assignment]

import numpy as np

from ckptrepo import faults
from ckptrepo.storage._arrays import MISSING_CHUNK, ArrayInfo
from ckptrepo.storage._chunktable import chunk_crcs
from ckptrepo.storage._crc import crc32c
from ckptrepo.storage._localfs import LOCK_SUFFIX, ByteCounter
from ckptrepo.storage._vectored import transfer_all
from ckptrepo.storage._write_mode import Flight, WriteModes
from ckptrepo.storage.protocol import Store

DIRECT_WRITES = True     # False: every shard goes through TensorStore (read when a Snapshotter is created)
DIRECT_IO = True         # False: write through the page cache (pwritev of views of the staging buffer)
WRITE_THREADS = 4        # shard writes in flight: one thread's device wait overlaps the others' copies
BOUNCE_BYTES = 2 << 20   # per writer thread, for O_DIRECT
DIRECT_ALIGN = 4096      # O_DIRECT offsets, lengths and addresses (the largest logical block size in use)
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)   # Linux: the open-file-description lock TensorStore takes
_WRITE_LOCK = struct.pack("hhqqi4x", 1, os.SEEK_SET, 0, 0, 0)   # struct flock {F_WRLCK, SEEK_SET, 0, 0, 0}


_written = ByteCounter()
_count = _written.add


def bytes_written() -> int:
    """Bytes this process has written through the direct path so far (tests check which path ran)."""
    return _written.total()


def supports(info: ArrayInfo, start: int, stop: int) -> bool:
    """Whether ``[start, stop)`` of ``info`` is exactly what one shard object holds (else: TensorStore writes it)."""
    shard, inner = info.shard_elems, info.inner_elems
    return (shard % inner == 0 and start % shard == 0 and start < stop
            and stop == min(info.numel, start + shard))


class _Shard:
    """The layout of one shard object, as TensorStore writes it.

    Every inner chunk that holds an element of the array is stored whole (the
    elements past the end of the array are zeros, the fill value), in order
    from offset 0, each followed by its crc32c (little endian); then the index:
    ``(offset, nbytes)`` as little-endian uint64 per inner chunk of the shard,
    ``2**64-1`` twice for a chunk wholly past the end of the array, and the
    index's own crc32c.
    """

    def __init__(self, info: ArrayInfo, data: np.ndarray | None, nbytes: int | None = None,
                 stride: int | None = None) -> None:
        """``data``: the shard's elements; or None and ``nbytes``, their size (the layout only).

        ``stride``: chunk ``k``'s encoding starts at ``k * stride`` (default:
        right after the previous one, TensorStore's layout); a larger stride
        leaves zeros after each chunk's crc32c (``write_live``'s layout).
        """
        self.raw = np.empty(0, np.uint8) if data is None else data.reshape(-1).view(np.uint8)
        self.nbytes = self.raw.nbytes if data is not None else int(nbytes or 0)
        self.chunk_bytes = info.inner_bytes
        n = info.shard_elems // info.inner_elems
        self.chunks = -(-self.nbytes // self.chunk_bytes)
        if self.chunks > n or self.nbytes % info.itemsize:
            raise ValueError(f"{self.nbytes} bytes do not fit one shard of {info.key}")
        self.stride = stride or self.chunk_bytes + 4
        if self.stride < self.chunk_bytes + 4:
            raise ValueError(f"a stride of {self.stride} bytes cannot hold a chunk of {self.chunk_bytes} "
                             f"and its crc32c")
        index = np.full((n, 2), MISSING_CHUNK, dtype="<u8")
        index[:self.chunks, 0] = np.arange(self.chunks, dtype=np.uint64) * self.stride
        index[:self.chunks, 1] = self.chunk_bytes + 4
        tail = index.tobytes()
        self.tail = tail + crc32c(tail).to_bytes(4, "little")
        self.total = self.chunks * self.stride + len(self.tail)

    def chunk(self, k: int) -> tuple[np.ndarray, int]:
        """Inner chunk ``k``'s bytes in ``data`` (a view) and how many zero bytes pad it to a whole chunk."""
        part = self.raw[k * self.chunk_bytes:(k + 1) * self.chunk_bytes]
        return part, self.chunk_bytes - part.nbytes


def encode_shard(info: ArrayInfo, data: np.ndarray) -> tuple[list[Any], int, np.ndarray]:
    """The iovec of one shard object, its length and its chunks' crc32cs: ``[chunk 0, crc 0, ..., index and its crc]``.

    ``data`` holds the shard's elements (C-contiguous); the chunks in the iovec
    are views of it, not copies (see ``_Shard`` for the layout).
    """
    shard = _Shard(info, data)
    crcs = chunk_crcs(info, shard.raw)
    iov: list[Any] = []
    for k in range(shard.chunks):
        part, padding = shard.chunk(k)
        iov.append(part)
        if padding:   # the last inner chunk of the array
            iov.append(np.zeros(padding, dtype=np.uint8))
        iov.append(crcs[k:k + 1])
    iov.append(shard.tail)
    return iov, shard.total, crcs


class _AlignedStream:
    """Writes a byte stream to an ``O_DIRECT`` file through one page-aligned bounce buffer.

    Each piece is copied into the buffer; the crc32c of chunk data is taken
    there, right after the copy, while it is in cache (from DRAM it would cost
    as much as the copy again). A full buffer is written at
    the next aligned offset; the last one is padded to ``DIRECT_ALIGN`` and the file
    truncated to the exact length by ``finish``.
    """

    def __init__(self, fd: int, bounce: np.ndarray) -> None:
        self.fd, self.buf = fd, bounce
        self.pos = self.offset = 0

    def put(self, src: np.ndarray, crc: int | None = None) -> int:
        """Append ``src`` (uint8); with ``crc``, return it extended over ``src``."""
        i, n = 0, src.nbytes
        size = self.buf.nbytes
        while i < n:
            k = min(n - i, size - self.pos)
            dst = self.buf[self.pos:self.pos + k]
            np.copyto(dst, src[i:i + k])
            if crc is not None:
                crc = crc32c(dst, crc)
            self.pos += k
            i += k
            if self.pos == size:
                self._flush(size)
        return 0 if crc is None else crc

    def _flush(self, nbytes: int) -> None:
        # a short write of an aligned request leaves an aligned rest
        _pwritev_all(self.fd, [self.buf[:nbytes]], self.offset)
        self.offset += nbytes
        self.pos = 0

    def finish(self, total: int) -> None:
        if self.pos:
            padded = -(-self.pos // DIRECT_ALIGN) * DIRECT_ALIGN
            self.buf[self.pos:padded] = 0
            self._flush(padded)
        if self.offset != total:
            os.ftruncate(self.fd, total)


def _write_aligned(fd: int, shard: _Shard, bounce: np.ndarray, crcs: np.ndarray) -> None:
    """The shard object through an ``O_DIRECT`` descriptor (see ``_AlignedStream``); ``crcs`` gets each chunk's
    crc32c."""
    out = _AlignedStream(fd, bounce)
    for k in range(shard.chunks):
        part, padding = shard.chunk(k)
        crc = out.put(part, 0)
        if padding:
            crc = out.put(np.zeros(padding, dtype=np.uint8), crc)
        crcs[k] = crc
        out.put(crcs[k:k + 1].view(np.uint8))
    out.put(np.frombuffer(shard.tail, dtype=np.uint8))
    out.finish(shard.total)


LIVE_BATCH = 64   # inner chunks per pwritev of a live shard: what a release may wait for (4 MiB)


class LiveShard:
    """A shard's inner chunks for ``write_live``, the ``live`` ones views of the tensors' own memory.

    Two readers go through the chunks in order: the writer (``written``) and,
    where the snapshot takes statistics or hashes of the bytes, the capture
    thread's feed (``fed``, ``saving._writer.feed_live``). The tensors must not
    change until both are through or the chunks are copied away: ``release()``
    (the snapshotter's pre-step hook) copies every live chunk either reader
    still needs into its slot of ``shadow`` (the staging buffer
    ``saving._writer.fill_live`` copied the other chunks into) and returns at
    once: it waits for neither the disk nor the feed, only for the lock a
    reader holds over one piece. A batch the writer had in flight from a chunk
    released meanwhile is written again from its copy (``_write_live``).
    ``on_released`` runs once, when both readers are through or at
    ``release``, whichever comes first (never, for a shard with no live chunk:
    it is released from the start). ``on_over`` runs once both the write
    (``finish``) and the feed (``feed_over``) are over: the shadow may be
    reused from then on.
    """

    def __init__(self, chunks: list[np.ndarray], live: list[bool], shadow: np.ndarray,
                 on_released: Callable[[], None], keep: Any = None, fed: int | None = None,
                 on_over: Callable[[], None] | None = None) -> None:
        self.chunks = chunks
        self.live = live
        self.shadow = shadow
        self.keep = keep            # the tensors' storages: alive while their memory is read
        self.written = 0            # chunks [0, written) are written (durable once the write is over)
        self.fed = len(chunks) if fed is None else fed   # chunks [0, fed) are read by the feed (None: no feed)
        self.released = not any(live)   # nothing in the tensors' memory: released from the start
        # dropped once called (or at once, for a shard released from the start): it is usually a bound method of
        # the snapshot's job, which lists its shards, and that cycle would leave the job to the cyclic GC
        self._on_released: Callable[[], None] | None = None if self.released else on_released
        self._lock = threading.Lock()
        self._write_over = False
        self._feed_over = fed is None
        self._on_over = on_over

    def release(self, copy: Callable[[np.ndarray, np.ndarray], Any] = np.copyto) -> int:
        """Copy the chunks still in the tensors' memory that a reader needs into the shadow; return how many bytes
        that copied. Chunks that follow each other in memory go in one ``copy(dst, src)`` (the snapshotter's
        copies with the training loop's threads, idle while it waits here)."""
        copied = 0
        with self._lock:
            if self.released:
                return 0
            n = len(self.chunks)
            k = min(self.written, self.fed)
            while k < n:
                if not self.live[k]:
                    k += 1
                    continue
                cb = self.chunks[k].nbytes
                start = self.chunks[k].ctypes.data
                k1 = k + 1   # a run of live chunks adjacent in memory (the same tensor)
                while k1 < n and self.live[k1] and self.chunks[k1].ctypes.data == start + (k1 - k) * cb:
                    k1 += 1
                # the run's bytes, one view from its first chunk: adjacent by address, so one stretch of memory
                src = np.lib.stride_tricks.as_strided(self.chunks[k], shape=((k1 - k) * cb,))
                copy(self.shadow[k * cb:k1 * cb], src)
                for j in range(k, k1):
                    self.chunks[j] = self.shadow[j * cb:(j + 1) * cb]
                    self.live[j] = False
                copied += (k1 - k) * cb
                k = k1
            self._release()
        return copied

    def finish(self) -> None:
        """The write is over (durable or failed): the writer reads the tensors' memory no more."""
        with self._lock:
            self.written = len(self.chunks)
            self._write_over = True
            self._settle()
        self._maybe_over()

    def fed_upto(self, k: int) -> None:
        """Chunks ``[0, k)`` are fed (the caller holds ``_lock``)."""
        self.fed = max(self.fed, k)
        self._settle()

    def feed_over(self) -> None:
        """The feed is over (done or given up): it reads the tensors' memory and the shadow no more."""
        with self._lock:
            self.fed_upto(len(self.chunks))
            self._feed_over = True
        self._maybe_over()

    def _maybe_over(self) -> None:
        with self._lock:
            if not (self._write_over and self._feed_over) or self._on_over is None:
                return
            on_over, self._on_over = self._on_over, None
        on_over()

    def _settle(self) -> None:
        if self.written >= len(self.chunks) and self.fed >= len(self.chunks):
            self._release()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.keep = None
            on_released, self._on_released = self._on_released, None
            if on_released is not None:
                on_released()


def _write_live(fd: int, layout: _Shard, shard: LiveShard, block: int, direct_io: bool, crcs: np.ndarray) -> None:
    """The chunks of ``shard`` at ``layout``'s stride, each followed by a block holding its crc32c, then the index;
    ``crcs`` gets each chunk's crc32c.

    A batch's crc32cs and its write run outside the shard's lock, so that
    ``release`` never waits for the disk. A chunk ``release`` copied away
    meanwhile (its view in ``shard.chunks`` is then another object) may have
    been checksummed or written while the training loop changed it: it is
    checksummed and written again from its copy, which holds the bytes as
    they were, before the batch counts as written.
    """
    n, stride, cb = layout.chunks, layout.stride, layout.chunk_bytes
    pad = stride - cb   # the crc32c and zeros up to the next block
    words, slots = _crc_blocks(pad)
    step = pad // 4
    chunks = shard.chunks
    iov: list[Any] = [None] * (2 * LIVE_BATCH)   # chunk j, then the block holding its crc32c
    iov[1::2] = slots
    batch: list[np.ndarray] = []
    k = 0
    while k < n:
        k1 = min(n, k + LIVE_BATCH)
        m = k1 - k
        with shard._lock:
            batch = chunks[k:k1]
        words[:m * step:step] = crcs[k:k1] = list(map(crc32c, batch))
        iov[:2 * m:2] = batch
        _pwritev_all(fd, iov if m == LIVE_BATCH else iov[:2 * m], k * stride, m * stride)
        with shard._lock:
            moved = [j for j in range(m) if chunks[k + j] is not batch[j]]
            if moved:   # copied away by a release while in flight: again from the copies, in one write
                j0, j1 = moved[0], moved[-1] + 1
                for j in moved:
                    words[j * step] = crcs[k + j] = crc32c(chunks[k + j])
                # a release copies every live chunk of the batch, so none in between is the tensors' memory
                assert not any(shard.live[k + j0:k + j1])
                iov[2 * j0:2 * j1:2] = chunks[k + j0:k + j1]
                _pwritev_all(fd, iov[2 * j0:2 * j1], (k + j0) * stride, (j1 - j0) * stride)
            shard.written = k1
            shard._settle()
        k = k1
    iov[::2] = [None] * LIVE_BATCH   # this thread's list must not keep the tensors alive
    del batch
    tail = np.frombuffer(layout.tail, dtype=np.uint8)
    if direct_io:
        padded = _aligned(-(-tail.nbytes // block) * block)
        padded[:tail.nbytes] = tail
        try:
            _pwritev_all(fd, [padded], n * stride)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            # a device of 4 KiB blocks takes every batch of chunks (each a multiple of 4 KiB long) but refuses the
            # index at a 512-byte boundary, after the shard is released: the index alone through the page cache
            # (otherwise every snapshot of a state over one shard would fail here)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _pwritev_all(fd, [tail], n * stride)
        os.ftruncate(fd, layout.total)
    else:
        _pwritev_all(fd, [tail], n * stride)


_per_thread = threading.local()


def _crc_blocks(pad: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """This writer thread's page-aligned blocks for the crc32cs of a live batch: ``LIVE_BATCH`` blocks of
    ``pad`` bytes (a crc32c, then zeros); their words (block ``j``'s crc32c is word ``j * pad // 4``) and views."""
    blocks = getattr(_per_thread, "crc_blocks", None)
    if blocks is None or blocks[1][0].nbytes != pad:
        buf = _aligned(LIVE_BATCH * pad)
        blocks = _per_thread.crc_blocks = (buf.view("<u4"), [buf[j * pad:(j + 1) * pad] for j in range(LIVE_BATCH)])
    return blocks


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeros, page-aligned (anonymous memory from mmap)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def _bounce_buffer() -> np.ndarray:
    """A page-aligned buffer of ``BOUNCE_BYTES``."""
    return _aligned(BOUNCE_BYTES)


class _NoDirectIO(Exception):
    """The file system refused O_DIRECT for this file; it is written through the page cache instead."""


class DirectWriter:
    """Writes whole shard objects of a local ``file`` store from a few threads (see the module docstring).

    Its own daemon threads, not a ThreadPoolExecutor: at interpreter exit,
    executors refuse new work before atexit hooks run, and the snapshotter's
    atexit hook still has snapshots to finish then.
    """

    def __init__(self, root: str, threads: int = WRITE_THREADS) -> None:
        self.root = root
        self.threads = max(1, threads)
        self.direct_io = DIRECT_IO and hasattr(os, "O_DIRECT")   # cleared at the first refusal
        self.block = 512   # write_live's chunk alignment: the device's logical block size (4096 once 512 is refused)
        self.modes = WriteModes()   # O_DIRECT, or the page cache where this disk writes far faster through it
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._dirs: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def for_store(cls, store: Store) -> "DirectWriter | None":
        """A writer for a store with a local root on a system with ``pwritev`` and OFD locks; None otherwise
        (TensorStore writes)."""
        root = store.capabilities.local_root
        if not DIRECT_WRITES or root is None or not hasattr(os, "pwritev") or _F_OFD_SETLKW is None:
            return None
        return cls(root)

    def submit(self, info: ArrayInfo, start: int, data: np.ndarray) -> "Future[np.ndarray] | None":
        """Queue the write of the shard that starts at element ``start``; the future completes once it is durable,
        with the shard's chunks' crc32cs (the chunk table's part, storage/_chunktable.py).

        ``data`` (the shard's elements) must stay untouched until then: it is
        written from where it is. None when ``data`` is not exactly one shard
        object (the caller writes it through TensorStore).
        """
        if not supports(info, start, start + data.size):
            return None
        return self._enqueue(info, start, data)

    def submit_live(self, info: ArrayInfo, start: int, shard: "LiveShard") -> "Future[np.ndarray]":
        """Queue the write of a shard whose inner chunks are ``shard.chunks`` (``saving._writer.fill_live``), some of
        them the tensors' own memory; the future completes once the object is durable."""
        return self._enqueue(info, start, shard)

    def _enqueue(self, info: ArrayInfo, start: int, data: "np.ndarray | LiveShard") -> "Future[np.ndarray]":
        fut: Future[np.ndarray] = Future()
        with self._lock:
            if len(self._workers) < self.threads:
                t = threading.Thread(target=self._work, name=f"ckptrepo-write-{len(self._workers)}", daemon=True)
                t.start()
                self._workers.append(t)
        self._queue.put((fut, info, start, data))
        return fut

    def _work(self) -> None:
        bounce: np.ndarray | None = None   # one per thread, allocated at the first O_DIRECT write through it
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, info, start, data = item
            bounce = self._write(fut, info, start, data, bounce)
            # not kept while waiting for the next: the future's callbacks hold the snapshot's job, which would
            # otherwise live on until this thread's next write and age into the cyclic GC's oldest generation
            del item, fut, info, start, data

    def _write(self, fut: "Future[np.ndarray]", info: ArrayInfo, start: int, data: "np.ndarray | LiveShard",
               bounce: np.ndarray | None) -> np.ndarray | None:
        """Write one queued shard and complete its future; returns the thread's bounce buffer (made here if needed)."""
        if not fut.set_running_or_notify_cancel():
            return bounce
        try:
            if isinstance(data, LiveShard):
                crcs = self.write_live(info, start, data)
            else:
                if bounce is None and self.direct_io:
                    bounce = _bounce_buffer()
                crcs = self.write_shard(info, start, data, bounce)
        except BaseException as err:  # noqa: BLE001 - delivered through the future
            fut.set_exception(err)
        else:
            fut.set_result(crcs)
        return bounce

    def write_shard(self, info: ArrayInfo, start: int, data: np.ndarray, bounce: np.ndarray | None = None
                    ) -> np.ndarray:
        """Encode and write one shard object durably (synchronous); returns its chunks' crc32cs; raises OSError or
        ValueError.

        With ``bounce`` (a page-aligned buffer) and a file system that accepts
        it, the object is written with O_DIRECT through that buffer; otherwise
        from an iovec of views of ``data`` through the page cache.
        """
        if not supports(info, start, start + data.size):
            raise ValueError(f"elements [{start}, {start + data.size}) are not one shard of {info.key}")
        shard = _Shard(info, data)
        path = os.path.join(self.root, info.shard_key(start // info.shard_elems))
        picked = self.direct_io and bounce is not None   # the modes choose; else the page cache, unmeasured
        direct = picked and self.modes.pick()
        flight = self.modes.begin()
        try:
            return self._write_shard(path, info, data, shard, bounce, picked, direct, flight)
        finally:
            flight.over()

    def _write_shard(self, path: str, info: ArrayInfo, data: np.ndarray, shard: _Shard, bounce: np.ndarray | None,
                     picked: bool, direct: bool, flight: Flight) -> np.ndarray:
        t0 = time.perf_counter()
        if direct:
            assert bounce is not None
            crcs = np.empty(shard.chunks, dtype="<u4")
            try:
                write_object(path, shard.total, lambda fd: _write_aligned(fd, shard, bounce, crcs), self._make_dir,
                             direct_io=True)
                self.modes.record(True, shard.total, time.perf_counter() - t0, flight.over())
                return crcs
            except _NoDirectIO:
                self.direct_io = False
                self.modes.abandon(True)
            except BaseException:
                self.modes.abandon(True)
                raise
        iov, total, crcs = encode_shard(info, data)
        chosen = picked and not direct   # the page cache by choice, not by a refusal of O_DIRECT
        try:
            write_object(path, total, lambda fd: _pwritev_all(fd, iov, 0), self._make_dir)
        except BaseException:
            if chosen:
                self.modes.abandon(False)
            raise
        if chosen:
            self.modes.record(False, total, time.perf_counter() - t0, flight.over())
        return crcs

    def write_live(self, info: ArrayInfo, start: int, shard: "LiveShard") -> np.ndarray:
        """Write durably one shard object whose inner chunks are ``shard.chunks`` (synchronous); returns their
        crc32cs.

        Each chunk's encoding (its bytes, its crc32c) starts at a multiple of
        the block size, zeros after the crc32c up to the next one, so every
        chunk goes with ``O_DIRECT`` from where it is, including the tensors'
        own memory (see ``LiveShard``). The block size is the device's logical
        block: 512 bytes is tried first, 4096 if that is refused; if both are,
        the same iovec goes through the page cache. The index records where
        each chunk is, so TensorStore and every other zarr reader read the
        object as usual; the padding costs 512 bytes per 64 KiB chunk (0.8 %).
        """
        nbytes = min(info.numel - start, info.shard_elems) * info.itemsize
        path = os.path.join(self.root, info.shard_key(start // info.shard_elems))
        while True:
            block, picked = self.block, self.direct_io   # other threads may change them
            layout = _Shard(info, None, nbytes, stride=-(-(info.inner_bytes + 4) // block) * block)
            if layout.chunks != len(shard.chunks):
                raise ValueError(f"{len(shard.chunks)} chunks given for a shard of {layout.chunks} of {info.key}")
            crcs = np.empty(layout.chunks, dtype="<u4")
            direct = picked and self.modes.pick()
            flight = self.modes.begin()
            t0 = time.perf_counter()
            try:
                # called within this iteration, so the loop variables it reads are this try's
                write_object(path, layout.total,
                             lambda fd: _write_live(fd, layout, shard, block, direct, crcs),  # noqa: B023
                             self._make_dir, direct_io=direct)
                sharing = flight.over()
                if picked:
                    self.modes.record(direct, layout.total, time.perf_counter() - t0, sharing)
                return crcs
            except BaseException as err:
                flight.over()
                if picked:   # the mode's trial slot is free again
                    self.modes.abandon(direct)
                if not isinstance(err, _NoDirectIO):
                    raise
                with shard._lock:   # chunks already written from the tensors may have changed since a release
                    if shard.released and any(shard.live[:shard.written]):
                        raise OSError(errno.EINVAL, f"O_DIRECT write of {path} refused after the state was "
                                                    f"released") from None
                    shard.written = 0   # the whole object again, from the same (unchanged) memory
                if block < DIRECT_ALIGN:
                    self.block = max(self.block, DIRECT_ALIGN)
                else:
                    self.direct_io = False

    def _make_dir(self, directory: str) -> None:
        """Create the shard directory once per writer (TensorStore creates missing parents the same way)."""
        with self._lock:
            if directory in self._dirs:
                return
        os.makedirs(directory, exist_ok=True)
        with self._lock:
            self._dirs.add(directory)

    def close(self) -> None:
        """Finish the writes queued so far and stop the threads."""
        with self._lock:
            workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)
        for t in workers:
            t.join()


def write_object(path: str, total: int, write: Callable[[int], None],
                 make_dir: Callable[[str], None] = lambda d: os.makedirs(d, exist_ok=True),
                 direct_io: bool = False) -> None:
    """Write a ``total``-byte object as the file ``path`` with TensorStore's file kvstore protocol.

    ``<path>.__lock`` is opened (created), locked (an OFD lock on the whole
    file, re-checked to still be the file at that name), filled by
    ``write(fd)``, fsynced and renamed to ``path``; then the directory is
    fsynced, so the new name is durable too. On an error before the rename the
    temporary file is removed. With ``direct_io`` the descriptor gets O_DIRECT
    first; ``_NoDirectIO`` is raised (nothing left behind) if the file system
    refuses it.
    """
    directory = os.path.dirname(path)
    make_dir(directory)
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        tmp = path + LOCK_SUFFIX
        fd = _open_locked(tmp)
        renamed = False
        try:
            if os.fstat(fd).st_size:   # left by an interrupted write of the same key
                os.ftruncate(fd, 0)
            if direct_io:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                    write(fd)
                except OSError as err:
                    if err.errno == errno.EINVAL:   # O_DIRECT unsupported here (tmpfs, some FUSE)
                        raise _NoDirectIO() from err
                    raise
            else:
                write(fd)
            os.fsync(fd)
            faults.point("before_shard_rename")
            os.rename(tmp, path)
            renamed = True
            os.fsync(dir_fd)
        except BaseException:
            if not renamed:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise
        finally:
            os.close(fd)   # releases the lock
    finally:
        os.close(dir_fd)


def _open_locked(path: str) -> int:
    """Open (create) ``path`` and hold an exclusive OFD lock on it while it still has that name."""
    assert _F_OFD_SETLKW is not None   # the direct writer is only made where the lock exists
    fd = os.open(path, _OPEN_FLAGS, 0o666)
    try:
        while True:
            fcntl.fcntl(fd, _F_OFD_SETLKW, _WRITE_LOCK)
            other = os.open(path, _OPEN_FLAGS, 0o666)
            a, b = os.fstat(fd), os.fstat(other)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                os.close(other)
                return fd
            os.close(fd)   # the previous holder renamed or removed it: lock the file now at that name
            fd = other
    except BaseException:
        os.close(fd)
        raise


def _pwritev_all(fd: int, iov: list[Any], offset: int, nbytes: int | None = None) -> None:
    """Write every buffer of ``iov`` from ``offset`` on (``nbytes``: their total, if the caller knows it)."""
    transfer_all(os.pwritev, fd, iov, offset, _count, nbytes)
