"""The declared size of compressed inner chunks, checked before TensorStore decodes them.

A compressed inner chunk is a blosc frame (docs/decisions/035-zstd-compression.md) whose 16-byte header
declares how many bytes it inflates to. TensorStore allocates that much and decompresses before it compares
the result with the chunk's size, so a frame of a few KiB declaring gigabytes of zeros (valid crc32c and
all) costs a load or fsck that much memory before it is refused. Every chunk of this format inflates to exactly
its array's inner chunk bytes, so a reader looks at the headers of the chunks it is about to have decoded:
the shard index (one suffix read per shard) and 16 bytes per chunk, requested together in one batch
(``pread`` on a local store). A mismatch is corruption, named by shard object and chunk; anything else odd
(an index with a bad crc32c, a missing or tiny chunk) is left to TensorStore, which refuses it without
inflating anything.

The direct local read path decodes compressed chunks itself (``decode_frame``, numcodecs' blosc, the same
c-blosc TensorStore links), so that a compressed load reads, checks and inflates on its own reader threads
rather than through TensorStore's chunk cache; the same header check guards it, and the frame's declared
compressed size must be the bytes stored, since c-blosc reads as far as the header says.
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckptrepo.errors import damaged_object_error
from ckptrepo.storage._arrays import BLOSC_HEADER_BYTES, INDEX_ENTRY_BYTES, MISSING_CHUNK, ArrayInfo, shard_index
from ckptrepo.storage._localfs import open_regular
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:
    import tensorstore as ts


@functools.cache
def _blosc() -> Any:
    """numcodecs' blosc module, or None where numcodecs is not installed (compressed loads then go through
    TensorStore). Imported on first use: most loads read plain arrays only."""
    try:
        from numcodecs import blosc  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return None
    return blosc


def can_decode() -> bool:
    """Whether ``decode_frame`` is available (imports numcodecs once: call it from the thread that plans a load,
    not from reader threads)."""
    return _blosc() is not None


def decode_frame(frame: Any, out: Any) -> None:
    """Inflate the blosc frame ``frame`` (a compressed inner chunk without its crc32c) into ``out``, a writable
    contiguous buffer of exactly the chunk's bytes; ValueError when its header declares another decompressed
    size or a compressed size other than the frame's own (the codec would read past the frame); the codec's
    own error when it refuses the stream. The GIL is released while it inflates (numcodecs, with its default
    ``use_threads``, uses a per-call context off the main thread)."""
    view = memoryview(frame).cast("B")
    if view.nbytes < BLOSC_HEADER_BYTES:
        raise ValueError("a blosc frame shorter than its header")
    header = bytes(view[:BLOSC_HEADER_BYTES])
    want = memoryview(out).nbytes
    why = frame_problem(header, want)
    if why is None and int.from_bytes(header[12:16], "little") != view.nbytes:
        why = f"its blosc header declares {int.from_bytes(header[12:16], 'little')} bytes compressed, " \
              f"not the {view.nbytes} stored"
    if why is not None:
        raise ValueError(why)
    _blosc().decompress(view, out)


def frame_problem(header: bytes, want: int) -> str | None:
    """Why a blosc frame's header cannot be that of a ``want``-byte chunk, or None (a short header: the codec
    refuses it without allocating)."""
    if len(header) < BLOSC_HEADER_BYTES:
        return None
    declared = int.from_bytes(header[4:8], "little")
    if declared != want:
        return f"its blosc header declares {declared} bytes decompressed, not the {want} of an inner chunk"
    return None


class FrameCheck:
    """The compressed inner chunks of one array that reads are about to decode, each checked once."""

    def __init__(self, store: Store, info: ArrayInfo) -> None:
        self.store, self.info = store, info
        self._kv: ts.KvStore | None = None
        self._indexes: dict[int, np.ndarray | None] = {}   # shard -> its (offset, size) per chunk; None: unread
        self._checked: set[int] = set()                     # chunks whose headers passed

    def problem(self, *ranges: tuple[int, int]) -> tuple[int, str] | None:
        """The first inner chunk among those holding the elements of ``ranges`` (``(lo, hi)`` each) whose header
        declares another size, and why; None when none does. All of them are asked for at once: two round
        trips, whatever the number of chunks."""
        info = self.info
        per_shard = info.shard_elems // info.inner_elems
        chunks = sorted({c for lo, hi in ranges for c in range(lo // info.inner_elems, -(-hi // info.inner_elems))
                         if c not in self._checked})
        if not chunks:
            return None
        wanted = sorted({c // per_shard for c in chunks} - set(self._indexes))
        index_bytes = per_shard * INDEX_ENTRY_BYTES + 4
        for s, raw in zip(wanted, self._read([(s, -index_bytes) for s in wanted], index_bytes)):
            self._indexes[s] = shard_index(raw, per_shard)
        where: list[tuple[int, int]] = []   # (chunk, offset in its shard) of each header to read
        for c in chunks:
            index = self._indexes.get(c // per_shard)
            if index is None:
                continue
            offset, size = (int(v) for v in index[c % per_shard])
            if offset != MISSING_CHUNK and size >= BLOSC_HEADER_BYTES + 4:
                where.append((c, offset))
        got = self._read([(c // per_shard, offset) for c, offset in where], BLOSC_HEADER_BYTES)
        for (c, _), header in zip(where, got):
            why = frame_problem(header, info.inner_bytes)
            if why is not None:
                return c, why
            self._checked.add(c)
        return None

    def _read(self, ranges: list[tuple[int, int]], length: int) -> list[bytes]:
        """``length`` bytes of shard object ``s`` from ``offset`` (from its end when negative) for each ``(s,
        offset)``, in order; empty where it cannot be read (its read through TensorStore names why). Local
        files with ``pread``, one descriptor per shard; any other store in one TensorStore batch."""
        if not ranges:   # every chunk asked about was checked already
            return []
        if self.store.capabilities.file_path(self.info.shard_key(ranges[0][0])) is not None:
            return self._read_files(ranges, length)
        import tensorstore as ts
        kv = self._open()
        batch = ts.Batch()
        futs = [kv.read(f"c/{s}", byte_range=slice(offset, None if offset < 0 else offset + length), batch=batch)
                for s, offset in ranges]
        batch.submit()
        return [_value(f) for f in futs]

    def _read_files(self, ranges: list[tuple[int, int]], length: int) -> list[bytes]:
        out: list[bytes] = []
        fd, open_shard = None, None
        try:
            for s, offset in ranges:
                if s != open_shard:
                    if fd is not None:
                        os.close(fd)
                    key = self.info.shard_key(s)
                    path = self.store.capabilities.file_path(key)
                    fd, open_shard = (None if path is None else _open(path, key)), s
                if fd is None:
                    out.append(b"")
                    continue
                try:
                    at = offset if offset >= 0 else os.fstat(fd).st_size + offset
                    out.append(os.pread(fd, length, at) if at >= 0 else b"")
                except OSError:
                    out.append(b"")
        finally:
            if fd is not None:
                os.close(fd)
        return out

    def check(self, ranges: list[tuple[int, int]], names: Callable[[int], list[str]]) -> None:
        """Raise a CorruptionError, naming the shard object, the chunk and ``names(chunk)`` (the tensors read
        there), when a chunk holding elements of ``ranges`` declares another size."""
        found = self.problem(*ranges)
        if found is not None:
            c, why = found
            shard = self.info.shard_key(c // (self.info.shard_elems // self.info.inner_elems))
            raise damaged_object_error(shard, f"inner chunk {c}: {why}", names(c))

    def _open(self) -> "ts.KvStore":
        if self._kv is None:
            import tensorstore as ts
            self._kv = ts.KvStore.open(self.store.child_spec(self.info.key), context=self.store.context).result()
        return self._kv


def _open(path: str, key: str) -> int | None:
    """A descriptor of a regular file (never a FIFO or device), or None where none can be had."""
    try:
        return open_regular(path, key)
    except Exception:  # noqa: BLE001 - OSError, or a CorruptionError naming it: its read names it again
        return None


def _value(fut: Any) -> bytes:
    """A read's bytes; empty where it failed (the object is missing or short: TensorStore's read names it)."""
    try:
        r = fut.result()
    except Exception:  # noqa: BLE001 - judged by the read that follows
        return b""
    return bytes(r.value) if r.state == "value" else b""


__all__ = ["FrameCheck", "can_decode", "decode_frame", "frame_problem"]
