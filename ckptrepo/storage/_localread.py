"""Verified reads of zarr v3 shards straight from local files: the fast load path for ``file`` stores.

TensorStore reads the same shards correctly, but through its generic chunk
cache and a software crc32c, which makes loads CPU-bound on a machine with few
cores (benchmarks/RESULTS.md, save_load.py; docs/decisions/005). This path reads
with ``preadv`` straight into the destination tensors and checks the shard
index's and every inner chunk's crc32c itself; compressed chunks are checked, then inflated on the same
threads (storage/_frames.py). Anything it does not expect (a missing object, a bad checksum,
an unusual layout, a short read) raises ``Unexpected``, and the caller reads
that run through TensorStore instead, so errors and their messages are those
of the TensorStore path. Writes have their own direct path (storage/_localwrite.py).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckptrepo.storage._arrays import (
    BLOSC_HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    MISSING_CHUNK,
    ZARR_JSON,
    ZARR_JSON_MAX_BYTES,
    ArrayInfo,
    metadata_matches,
    shard_index,
)
from ckptrepo.storage._chunktable import first_mismatch
from ckptrepo.storage._crc import crc32c
from ckptrepo.storage._frames import can_decode, decode_frame
from ckptrepo.storage._localfs import ByteCounter, open_regular, read_regular
from ckptrepo.storage._vectored import transfer_all
from ckptrepo.storage.protocol import Store, StoreCapabilities

if TYPE_CHECKING:   # numpy destinations need no torch (diff and stats read without it)
    import torch


def _usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Concurrent preadv tasks. A warm read is CPU work (the kernel's copy out of the page cache, then crc32c), so
# threads beyond the cores only switch; cold loads barely care, since the disk gets 16 MiB requests either way.
DIRECT_THREADS = max(2, min(4, _usable_cpus()))
DIRECT_TASK_BYTES = 16 << 20    # a run is split into chunk-aligned tasks of about this size
ROW_SCRATCH_BYTES = 1 << 20     # row targets are read and copied out this much at a time (see _read_chunks)


_read = ByteCounter()
_count = _read.add


def bytes_read() -> int:
    """Bytes this process has read through the direct path so far (the counterpart of TensorStore's metrics)."""
    return _read.total()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_in_flight = 0   # tasks given to the pool and not finished: the pool is released only when none are
_scratch_of_thread = threading.local()   # per reader thread: the buffer row targets are read into


def _submit(fn: Callable[..., Any], *args: Any) -> Future:
    """Give a task to the process's reader threads, started by the first load and kept: starting (and joining)
    threads per load costs milliseconds on a busy machine, and each new thread would fault in a new row buffer.

    A forked child has none of them (fork copies only the calling thread), so it forgets the pool and starts
    its own at its first load (``_forget_pool``). A framework that must end with no thread of ours (Lightning's
    ``teardown``) releases them (``release_reader_threads``); the next load starts them again.
    """
    global _pool, _in_flight
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(DIRECT_THREADS, thread_name_prefix="ckptrepo-read")
        _in_flight += 1
        fut = _pool.submit(fn, *args)
    fut.add_done_callback(_task_done)
    return fut


def _task_done(_fut: Future) -> None:
    global _in_flight
    with _pool_lock:
        _in_flight -= 1


def release_reader_threads() -> bool:
    """End the reader threads if no load is using them (True), so that no thread of ckptrepo's outlives a
    framework's teardown; False when a load is in flight, whose threads end with the process instead."""
    global _pool
    with _pool_lock:
        if _pool is None or _in_flight:
            return _pool is None
        pool, _pool = _pool, None
    pool.shutdown(wait=True)
    return True


def _forget_pool() -> None:
    """In a forked child: the executor copied from the parent counts threads that do not exist here, so work
    given to it would wait for ever; the lock may have been held by a parent thread at the fork."""
    global _pool, _pool_lock, _in_flight
    _pool = None
    _pool_lock = threading.Lock()
    _in_flight = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class Unexpected(Exception):
    """The direct path met something it does not handle; the run is read through TensorStore instead."""


class DirectReader:
    """Verified reads of zarr v3 shards (``sharding_indexed``, index at the end) straight from local files.

    A shard object is the inner chunks' encodings (the chunk's bytes, or for a compressed array its blosc
    frame, then their crc32c, little endian) followed by the index: one ``(offset, nbytes)`` pair
    of little-endian uint64 per inner chunk, then the index's crc32c.
    """

    def __init__(self, capabilities: StoreCapabilities) -> None:
        assert capabilities.local_root is not None
        self.root = capabilities.local_root
        self._files = capabilities   # maps keys onto files, refusing '..', reserved endings and the like
        self._tasks: list[Future] = []
        self._shards: dict[str, _Shard] = {}                     # shard key -> its verified index
        self._metadata: dict[str, bool] = {}                    # array key -> zarr.json matches the manifest
        self._lock = threading.Lock()

    @classmethod
    def for_store(cls, store: Store) -> "DirectReader | None":
        root = store.capabilities.local_root
        return cls(store.capabilities) if root is not None and hasattr(os, "preadv") else None

    def close(self) -> None:
        """Drop this reader's queued tasks, wait for its running ones (they use the files), close the files."""
        for fut in self._tasks:
            fut.cancel()
        wait(self._tasks)
        self._tasks.clear()
        self._shards.clear()

    @staticmethod
    def reads(info: ArrayInfo) -> bool:
        """Whether this path reads the array's chunks: plain ones always, compressed ones where the blosc
        decoder is installed (asked on the planning thread, which imports it once)."""
        return info.compression is None or can_decode()

    def metadata_ok(self, info: ArrayInfo) -> bool:
        """Whether the array's ``zarr.json`` says what the manifest says (read and parsed here, once per array).

        This replaces opening the array through TensorStore on the direct path;
        False sends the caller to TensorStore, which opens it and reports what is wrong.
        """
        with self._lock:
            ok = self._metadata.get(info.key)
        if ok is None:
            try:
                raw = read_regular(self._path(f"{info.key}/{ZARR_JSON}"), info.key, ZARR_JSON_MAX_BYTES)
                if raw is None:
                    raise Unexpected(f"{info.key}: no {ZARR_JSON}")
                _count(len(raw))
                ok = metadata_matches(info, json.loads(raw))
            except Exception:  # noqa: BLE001 - whatever it is, TensorStore's path opens the array and judges
                ok = False
            with self._lock:
                self._metadata[info.key] = ok
        return ok

    def submit(self, info: ArrayInfo, run: Any, entries: list[Any], targets: dict[int, torch.Tensor],
               table: np.ndarray | None = None) -> list[Future]:
        """Queue the run as chunk-aligned tasks (never across a shard); the futures raise on any surprise.

        Each future's ``elems`` is the ``(start, stop)`` element range of the array its task reads, so a
        caller can act on part of a run as soon as the tasks covering it are done. With ``table`` (the
        array's chunk table, storage/_chunktable.py), each chunk's crc32c must also be its entry.
        """
        inner, shard = info.inner_elems, info.shard_elems
        if shard % inner:
            return [_failed()]
        pieces = [(entries[i].offset, entries[i].offset + entries[i].numel, _target_buffer(targets[i]))
                  for i in run.members]
        step = max(1, DIRECT_TASK_BYTES // info.inner_bytes)
        per_shard = shard // inner
        futs = []
        c, last = run.start // inner, (run.stop - 1) // inner
        while c <= last:
            stop = min(last + 1, c + step, (c // per_shard + 1) * per_shard)
            lo, hi = c * inner, stop * inner
            mine = [p for p in pieces if p[0] < hi and p[1] > lo]
            fut = _submit(self._read_chunks, info, c, stop, mine, table)
            fut.elems = (lo, hi)   # type: ignore[attr-defined]
            futs.append(fut)
            self._tasks.append(fut)
            c = stop
        return futs

    def _path(self, key: str) -> str:
        """The file of ``key`` under the root; a key that is no plain path there (``..``, empty parts) is
        refused, whatever the manifest that named it says."""
        path = self._files.local_path(key)
        if path is None:
            raise Unexpected(f"{key!r} is not a key of this store")
        return path

    def _open(self, info: ArrayInfo, s: int) -> int:
        """A descriptor of shard object ``s``, for one task: a load holds no more files open than it has
        reader threads (one descriptor per shard would meet the open-file limit: 1024 shards are 64 GiB).
        Only a regular file is opened, without blocking (open_regular): a FIFO would hang the task."""
        key = info.shard_key(s)
        try:
            fd = open_regular(self._path(key), key)
        except OSError as err:
            raise Unexpected(str(err)) from err
        if fd is None:
            raise Unexpected(f"{key}: missing")
        return fd

    def _shard(self, info: ArrayInfo, s: int, fd: int) -> "_Shard":
        """Shard object ``s``'s verified index, read through ``fd`` once per load and shared by the tasks."""
        key = info.shard_key(s)
        with self._lock:
            got = self._shards.get(key)
        if got is not None:
            return got
        n = info.shard_elems // info.inner_elems
        size = os.fstat(fd).st_size
        length = INDEX_ENTRY_BYTES * n + 4
        raw = os.pread(fd, length, size - length) if size >= length else b""
        _count(len(raw))
        index = shard_index(raw, n)
        if index is None:
            raise Unexpected(f"{key}: shard index")
        shard = _Shard(index, info.inner_bytes + 4)
        with self._lock:
            return self._shards.setdefault(key, shard)

    def _read_chunks(self, info: ArrayInfo, c0: int, c1: int, pieces: list[tuple[int, int, Any]],
                     table: np.ndarray | None) -> None:
        """Read inner chunks ``[c0, c1)`` of one shard into the pieces (sorted, disjoint element ranges).

        Chunks that lie wholly inside one plain target (a numpy byte buffer) are read straight into it.
        The others (chunks shared by several targets, holding bytes no target wants, or bound for a row
        target, a piece with ``scatter(buf, lo, hi)``) are read into this thread's scratch,
        ``ROW_SCRATCH_BYTES`` at a time, and copied out once verified, while still in cache: a few
        copies of a cache-sized buffer instead of a Python loop over every chunk and every target in it.
        """
        s = c0 // (info.shard_elems // info.inner_elems)
        fd = self._open(info, s)
        try:
            self._read_task(info, fd, self._shard(info, s, fd), c0, c1, pieces, table)
        finally:
            os.close(fd)

    def _read_task(self, info: ArrayInfo, fd: int, shard: "_Shard", c0: int, c1: int,
                   pieces: list[tuple[int, int, Any]], table: np.ndarray | None) -> None:
        inner, item, chunk_bytes = info.inner_elems, info.itemsize, info.inner_bytes
        step = max(1, ROW_SCRATCH_BYTES // chunk_bytes)   # chunks per scratch batch: one, if a chunk is bigger
        c, p = c0, 0
        while c < c1:
            lo = c * inner
            while p < len(pieces) and pieces[p][1] <= lo:
                p += 1
            if p < len(pieces) and type(pieces[p][2]) is np.ndarray and pieces[p][0] <= lo:
                start, stop_elem, buf = pieces[p]
                stop = min(c1, stop_elem // inner)
                if stop > c:   # whole chunks of one plain target: straight into it
                    first = (lo - start) * item
                    self._read_into(info, fd, shard, c, stop, buf[first:first + (stop - c) * chunk_bytes], table)
                    c = stop
                    continue
            stop = min(c1, c + step)
            for a, b, buf in pieces[p:]:   # stop where a plain target's whole chunks begin
                if a >= stop * inner:
                    break
                whole = -(-a // inner)
                if type(buf) is np.ndarray and c < whole < b // inner:
                    stop = min(stop, whole)
                    break
            hi = stop * inner
            scratch = _thread_scratch(step * chunk_bytes)
            self._read_into(info, fd, shard, c, stop, scratch[:(stop - c) * chunk_bytes], table)
            for a, b, buf in pieces[p:]:
                if a >= hi:
                    break
                a2, b2 = max(a, lo), min(b, hi)
                region = scratch[(a2 - lo) * item:(b2 - lo) * item]
                if type(buf) is np.ndarray:
                    np.copyto(buf[(a2 - a) * item:(b2 - a) * item], region)
                else:
                    buf.scatter(region, a2, b2)
            c = stop

    def _read_into(self, info: ArrayInfo, fd: int, shard: "_Shard", c0: int, c1: int, dest: np.ndarray,
                   table: np.ndarray | None) -> None:
        """Read inner chunks ``[c0, c1)`` of one shard (open as ``fd``, its index ``shard``) into ``dest``
        (their bytes back to back), verified."""
        if info.compression is not None:
            self._read_frames(info, fd, shard, c0, c1, dest, table)
            return
        per_shard = info.shard_elems // info.inner_elems
        chunk_bytes, n = info.inner_bytes, c1 - c0
        k0 = c0 % per_shard
        rows = dest.reshape(n, chunk_bytes)
        crcs = np.empty(4 * n, dtype=np.uint8)
        nbytes, stride = chunk_bytes + 4, shard.stride
        if k0 + n <= shard.regular:   # the usual layout, checked once per shard: no per-batch planning
            # ROW_SCRATCH_BYTES at a time, each batch checked while it is still in the CPU cache rather than
            # after one long preadv has pushed its start out of it
            gap = _scratch(stride - nbytes) if stride != nbytes else None
            batch = max(1, ROW_SCRATCH_BYTES // chunk_bytes)
            for b0 in range(0, n, batch):
                b1 = min(n, b0 + batch)
                if gap is None:
                    iov = [x for k in range(b0, b1) for x in (rows[k], crcs[4 * k:4 * k + 4])]
                else:
                    iov = [x for k in range(b0, b1) for x in (rows[k], crcs[4 * k:4 * k + 4], gap)][:-1]
                m = b1 - b0
                _preadv(fd, iov, shard.first + (k0 + b0) * stride, m * nbytes + (m - 1) * (stride - nbytes))
                _verify(info, rows, crcs, b0, b1, c0, per_shard)
            _check_table(info, table, crcs, c0)
            return
        else:   # chunks missing, resized or out of order somewhere in the shard: look at each
            entries = shard.index[k0:k0 + n]
            bad = np.flatnonzero((entries[:, 0] == MISSING_CHUNK) | (entries[:, 1] != nbytes))
            if len(bad):
                raise Unexpected(f"{info.shard_key(c0 // per_shard)}: inner chunk {c0 + int(bad[0])}")
            iov, file_off, expect, size = [], -1, -1, 0
            for k, off in enumerate(entries[:, 0].tolist()):
                if expect < off <= expect + _MAX_GAP and iov:   # padding after the previous chunk: read past it
                    iov.append(_scratch(off - expect))
                    size += off - expect
                elif off != expect:
                    if iov:
                        _preadv(fd, iov, file_off, size)
                    iov, file_off, size = [], off, 0
                iov += (rows[k], crcs[4 * k:4 * k + 4])
                size += nbytes
                expect = off + nbytes
            _preadv(fd, iov, file_off, size)
        _verify(info, rows, crcs, 0, n, c0, per_shard)
        _check_table(info, table, crcs, c0)


    def _read_frames(self, info: ArrayInfo, fd: int, shard: "_Shard", c0: int, c1: int, dest: np.ndarray,
                     table: np.ndarray | None) -> None:
        """``_read_into`` for a compressed array: the chunks' frames are read (those that lie back to back, up
        to ``ROW_SCRATCH_BYTES``, in one ``pread`` into this thread's frame buffer), each checked against its
        stored crc32c (over the frame, as the zarr codec chain writes it), inflated into its place in ``dest``,
        and the crc32c of its decoded bytes checked against the chunk table, which binds a compressed array by
        its decoded chunks (docs/format.md)."""
        per_shard = info.shard_elems // info.inner_elems
        chunk_bytes, n = info.inner_bytes, c1 - c0
        k0 = c0 % per_shard
        entries = shard.index[k0:k0 + n]
        bad = np.flatnonzero((entries[:, 0] == MISSING_CHUNK) | (entries[:, 1] < BLOSC_HEADER_BYTES + 4)
                             | (entries[:, 1] > chunk_bytes + _MAX_GAP))
        if len(bad):   # missing, or no size a frame of this chunk can have: TensorStore's path names it
            raise Unexpected(f"{info.shard_key(c0 // per_shard)}: inner chunk {c0 + int(bad[0])}")
        offsets, sizes = entries[:, 0].tolist(), entries[:, 1].tolist()
        rows = dest.reshape(n, chunk_bytes)
        decoded = np.empty(n, dtype="<u4")
        k = 0
        while k < n:
            start = end = offsets[k]
            j = k
            while j < n and offsets[j] == end and (j == k or end + sizes[j] - start <= ROW_SCRATCH_BYTES):
                end += sizes[j]
                j += 1
            buf = _frame_scratch(end - start)
            _preadv(fd, [buf], start, end - start)
            for i in range(k, j):
                at = offsets[i] - start
                frame, stored = buf[at:at + sizes[i] - 4], buf[at + sizes[i] - 4:at + sizes[i]]
                if crc32c(frame) != int.from_bytes(stored.tobytes(), "little"):
                    raise Unexpected(f"{info.shard_key(c0 // per_shard)}: inner chunk {c0 + i} checksum")
                try:
                    decode_frame(frame, rows[i])
                except Exception as err:  # noqa: BLE001 - whatever the codec says, TensorStore's path judges
                    raise Unexpected(f"{info.shard_key(c0 // per_shard)}: inner chunk {c0 + i}: {err}") from None
                decoded[i] = crc32c(rows[i])
            k = j
        _check_table(info, table, decoded.view(np.uint8), c0)


def _check_table(info: ArrayInfo, table: np.ndarray | None, crcs: np.ndarray, c0: int) -> None:
    """The stored crc32cs of chunks ``c0...`` (verified against their bytes) must be the chunk table's: bytes
    that are valid but not the version's own are sent to TensorStore's path, which names them."""
    if table is not None and first_mismatch(table, c0, crcs.view("<u4")) is not None:
        raise Unexpected(f"{info.key}: inner chunks from {c0} are not the manifest's")


def _verify(info: ArrayInfo, rows: np.ndarray, crcs: np.ndarray, k0: int, k1: int, c0: int, per_shard: int) -> None:
    """Check chunks ``rows[k0:k1]`` (inner chunks ``c0 + k``) against their stored crc32c."""
    stored = crcs[4 * k0:4 * k1].view("<u4").tolist()
    for k, want in zip(range(k0, k1), stored):
        if crc32c(rows[k]) != want:
            raise Unexpected(f"{info.shard_key(c0 // per_shard)}: inner chunk {c0 + k} checksum")


class _Shard:
    """A shard object's verified index, and how many of its leading inner chunks lie at one
    stride from the first (every chunk present and whole): TensorStore writes them back to back,
    localwrite.write_live at a block-aligned stride. Reads of those chunks need no look at the index."""

    __slots__ = ("index", "first", "stride", "regular")

    def __init__(self, index: np.ndarray, nbytes: int) -> None:
        self.index = index
        offsets, sizes = index[:, 0], index[:, 1]
        self.first = int(offsets[0])
        self.stride = int(offsets[1]) - self.first if len(offsets) > 1 else nbytes
        self.regular = 0
        if self.first != MISSING_CHUNK and nbytes <= self.stride <= nbytes + _MAX_GAP:
            good = (offsets == self.first + self.stride * np.arange(len(offsets), dtype=np.uint64)) \
                & (sizes == nbytes) & (offsets != MISSING_CHUNK)
            self.regular = int(np.argmin(good)) if not good.all() else len(good)


_MAX_GAP = 4096   # padding between chunk encodings read through rather than skipped with another preadv


def _thread_scratch(nbytes: int) -> np.ndarray:
    """This reader thread's buffer for chunks read before they are copied out (kept: no page faults per task)."""
    buf = getattr(_scratch_of_thread, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch_of_thread.buf = np.empty(nbytes, dtype=np.uint8)
    return buf


def _target_buffer(target: Any) -> Any:
    """A contiguous tensor's bytes as a flat numpy view; a row target (see ``_read_chunks``) as it is."""
    torch = sys.modules.get("torch")   # a tensor exists only once torch is imported
    if torch is not None and isinstance(target, torch.Tensor):
        return target.reshape(-1).view(torch.uint8).numpy()
    return target


def _frame_scratch(nbytes: int) -> np.ndarray:
    """This reader thread's buffer for compressed frames read before they are inflated (kept, like the row
    scratch; separate from it, since the frames are often inflated into the row scratch)."""
    buf = getattr(_scratch_of_thread, "frames", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch_of_thread.frames = np.empty(max(nbytes, ROW_SCRATCH_BYTES), dtype=np.uint8)
    return buf[:nbytes]


def _scratch(nbytes: int) -> np.ndarray:
    """Somewhere to read bytes nobody wants (padding between chunks)."""
    return np.empty(nbytes, dtype=np.uint8)


def _preadv(fd: int, iov: list[np.ndarray], offset: int, nbytes: int) -> None:
    """Fill every buffer of ``iov`` (``nbytes`` in all) from ``offset`` on; a short read is a surprise."""
    transfer_all(os.preadv, fd, iov, offset, _count, nbytes)


def _failed() -> Future:
    f: Future = Future()
    f.set_exception(Unexpected("unsupported geometry"))
    return f
