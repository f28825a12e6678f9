"""Vectored I/O that moves every byte: ``preadv``/``pwritev`` over any number of buffers.

Both direct local paths (storage/_localread.py, storage/_localwrite.py) hand the kernel long buffer
lists (an inner chunk and its crc32c, chunk after chunk). The kernel takes at
most ``IOV_MAX`` buffers per call and may move fewer bytes than asked on
large requests, so the list is sent in groups and a group is resumed where a
short transfer stopped.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

IOV_MAX = 1024


class ShortTransfer(OSError):
    """The kernel moved no bytes (end of file on a read, nothing written)."""


def transfer_all(call: Callable[[int, Sequence[Any], int], int], fd: int, iov: Sequence[Any], offset: int,
                 on_bytes: Callable[[int], None], nbytes: int | None = None) -> None:
    """Run ``call(fd, buffers, offset)`` (``os.preadv`` or ``os.pwritev``) until all of ``iov`` has moved.

    ``nbytes``: the buffers' total, when the caller knows it; a list the kernel takes in one call then
    costs one call and no size lookups per buffer when it all moves at once (the usual case).
    """
    if nbytes is not None and len(iov) <= IOV_MAX:
        n = call(fd, iov, offset)
        if n > 0:
            on_bytes(n)
        if n == nbytes:
            return
        if n <= 0:
            raise ShortTransfer(f"{getattr(call, '__name__', 'I/O')} moved nothing at offset {offset}")
        iov, offset = _skip(iov, n), offset + n
    i = 0
    while i < len(iov):
        group = iov[i:i + IOV_MAX]
        want = sum(memoryview(b).nbytes for b in group)
        done = 0
        while done < want:
            n = call(fd, _skip(group, done), offset + done)
            if n <= 0:
                raise ShortTransfer(f"{getattr(call, '__name__', 'I/O')} moved nothing at offset {offset + done}")
            on_bytes(n)
            done += n
        offset += want
        i += IOV_MAX


def _skip(group: Sequence[Any], n: int) -> Sequence[Any]:
    """The buffers of ``group`` without their first ``n`` bytes."""
    if n == 0:
        return group
    out = []
    for b in group:
        mv = memoryview(b).cast("B")
        if n >= mv.nbytes:
            n -= mv.nbytes
            continue
        out.append(mv[n:] if n else mv)
        n = 0
    return out
