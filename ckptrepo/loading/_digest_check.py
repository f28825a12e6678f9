"""The content-digest check of pieces a load reads whole (storage/_piece_digest.py says why it is needed).

A read of the engine that covers one stored piece exactly carries that piece's recorded digest
(``Read.digest``). The chunk checks pass first; then

* on TensorStore's path, the run's bytes are in one buffer once read: :func:`check_read` hashes the read's
  part of it before the read is handed its elements;
* on the direct path, a run is read by several reader tasks at once: :class:`DigestFeed` feeds the read's
  bytes to its hasher in order as the tasks covering it finish, on the reader thread that finishes each one
  (while its bytes are recent, and the xxhash package lets go of the GIL), and fails when the digest differs.
  A failed direct read falls back to TensorStore's path, which reads the run again and raises the error
  (the engine's rule: errors and messages are that path's).

A piece read in part (a resharding load) cannot be checked against a digest of the whole piece.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptrepo.storage import (
    U64,
    WORDSUM,
    PieceHasher,
    checkable,
    finish_wordsum,
    mismatch_error,
    piece_digest,
)

if TYPE_CHECKING:
    from ckptrepo.loading._engine import Read


GATHER_BYTES = 256 << 10   # strided rows are hashed this much at a time (check_rows), kept in the CPU cache


def check_read(read: "Read", raw: np.ndarray) -> None:
    """Raise DigestMismatchError when ``raw`` (the read's bytes, in order) does not hash to the read's digest."""
    digest = read.digest
    if checkable(digest) and piece_digest(digest[0], raw) != digest:   # type: ignore[index]
        raise mismatch_error(read.names()[0], read.box, read.array, read.start, read.numel)


def check_reads(reads: list[tuple["Read", np.ndarray]]) -> None:
    """``check_read`` of each (read, its bytes): the reads one reader task holds whole, once it is done."""
    for read, raw in reads:
        check_read(read, raw)


def check_rows(read: "Read", rows: np.ndarray) -> None:
    """``check_read`` of a read whose bytes went to rows of a strided target (``[rows, row bytes]``, each row
    contiguous): hashed row by row, in order, once every task has filled them."""
    digest = read.digest
    if not checkable(digest):
        return
    assert digest is not None
    hasher = PieceHasher(digest[0])
    if rows.flags.c_contiguous:
        hasher.update(rows.reshape(-1))
    elif len(rows):
        # rows gathered into a contiguous buffer a batch at a time: one hasher call per batch rather than per
        # row, whose Python cost outweighs the copy for rows of a few hundred bytes (narrow column blocks)
        per = max(1, GATHER_BYTES // max(1, rows.shape[1]))
        batch = np.empty((min(per, len(rows)), rows.shape[1]), dtype=rows.dtype)
        for i in range(0, len(rows), per):
            part = batch[:min(per, len(rows) - i)]
            np.copyto(part, rows[i:i + len(part)])
            hasher.update(part.reshape(-1))
    if hasher.digest() != digest:
        raise mismatch_error(read.names()[0], read.box, read.array, read.start, read.numel)


class DigestFeed:
    """A direct read's bytes hashed as the reader tasks covering them finish; ``done`` holds the outcome (the
    error when the digest differs or a task failed).

    Tasks finish in any order. A WORDSUM digest (a sum over positions) is taken in parts: each task's range
    is hashed on the thread that finished it, at once, and the parts' lane sums are added, so that a large
    piece is hashed by as many threads as read it. An xxh3 digest is sequential: each finished range waits in
    ``_ready`` until the ranges before it are fed. One thread feeds at a time (``_feeding``), outside the lock,
    so the others only note their range and go on reading; the feeder takes every range that becomes ready
    meanwhile.
    """

    def __init__(self, read: "Read", buf: np.ndarray, itemsize: int, tasks: list[Future]) -> None:
        assert read.digest is not None
        self.read, self.buf, self.item = read, buf, itemsize
        self.hasher = PieceHasher(read.digest[0])
        self.done: Future = Future()
        self._lock = threading.Lock()
        self._ready: dict[int, int] = {}
        self._pos = read.start
        self._feeding = False
        # WORDSUM in parts: each part must start on a whole word of the piece (and end on one, or at its end)
        self._parts: list[int] | None = None   # [lane a, lane b, bytes hashed]
        if read.digest[0] == WORDSUM and all(self._word_aligned(*self._range(t)) for t in tasks):
            self._parts = [0, 0, 0]
        for t in tasks:
            t.add_done_callback(self._finished)

    def _range(self, task: Future) -> tuple[int, int]:
        lo, hi = getattr(task, "elems", (self.read.start, self.read.stop))
        return max(lo, self.read.start), min(hi, self.read.stop)

    def _word_aligned(self, lo: int, hi: int) -> bool:
        start = self.read.start
        return (lo - start) * self.item % 8 == 0 and (hi == self.read.stop or (hi - start) * self.item % 8 == 0)

    def _finished(self, task: Future) -> None:
        err = None if not task.cancelled() and task.exception() is None else "the direct read failed"
        if err is not None:
            self._settle(None, err)
            return
        lo, hi = self._range(task)
        if self._parts is not None:
            self._hash_part(lo, hi)
            return
        with self._lock:
            self._ready[lo] = hi
            if self._feeding:
                return
            self._feeding = True
        try:
            while True:
                with self._lock:
                    a = self._pos
                    b = self._ready.pop(a, None)
                    if b is None:
                        self._feeding = False
                        return
                start = self.read.start
                self.hasher.update(self.buf[(a - start) * self.item:(b - start) * self.item])
                with self._lock:
                    self._pos = b
                if b == self.read.stop:
                    self._settle(self.hasher.digest(), None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the read
            with self._lock:
                self._feeding = False
            self._settle(None, repr(err))

    def _hash_part(self, lo: int, hi: int) -> None:
        """WORDSUM: hash the bytes of elements ``[lo, hi)`` on this thread and add their lane sums."""
        start, parts = self.read.start, self._parts
        assert parts is not None
        try:
            if hi > lo:
                h = PieceHasher(WORDSUM, (lo - start) * self.item // 8)
                h.update(self.buf[(lo - start) * self.item:(hi - start) * self.item])
                a, b = h.lanes()
                with self._lock:
                    parts[0], parts[1] = (parts[0] + a) & U64, (parts[1] + b) & U64
                    parts[2] += h.nbytes
                    whole = parts[2] == self.read.numel * self.item
                if whole:
                    self._settle(finish_wordsum(parts[0], parts[1], parts[2]), None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the read
            self._settle(None, repr(err))

    def _settle(self, digest: bytes | None, failure: Any) -> None:
        with self._lock:
            if self.done.done():
                return
            if failure is None and digest == self.read.digest:
                self.done.set_result(None)
                return
            r = self.read
            self.done.set_exception(mismatch_error(r.names()[0], r.box, r.array, r.start, r.numel)
                                    if failure is None else RuntimeError(failure))


__all__ = ["DigestFeed", "check_read", "check_reads", "check_rows"]
