"""fsck's check of the pieces' content digests (storage/_piece_digest.py): each piece that records one is
hashed while fsck reads its array's shards in order, and named when its bytes do not match.

Chunk crc32cs and the chunk table pass for a chunk changed with its crc32c restored; the digest of the whole
piece does not. A piece that several versions share (dedup) is hashed once per fsck.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ckptrepo.core import volume
from ckptrepo.core.schema import Manifest
from ckptrepo.storage import ArrayInfo, PieceHasher, checkable, mismatch_text

Checked = set[tuple[str, int, int, bytes]]   # (array, offset, elements, digest) of every piece hashed so far


class PieceDigests:
    """The pieces of one version in one array that carry a digest not checked yet, fed that array's elements in
    order (:meth:`feed`); ``errors`` names those that do not match."""

    def __init__(self, m: Manifest, info: ArrayInfo, checked: Checked) -> None:
        self.info = info
        self.errors: list[str] = []
        todo: list[tuple[int, int, bytes, str, Any]] = []
        for t in m.tensors:
            for p in t.pieces:
                if p.array != info.key or not checkable(p.digest):
                    continue
                assert p.digest is not None
                n = volume(p.box[1])
                key = (p.array, p.offset, n, p.digest)
                if n and key not in checked and p.offset + n <= info.numel:
                    checked.add(key)
                    todo.append((p.offset, p.offset + n, p.digest, t.name, p.box))
        self._todo = sorted(todo, key=lambda x: x[0])
        self._next = 0
        self._open: list[tuple[tuple[int, int, bytes, str, Any], PieceHasher | None]] = []   # None: left unchecked

    def feed(self, lo: int, hi: int, data: np.ndarray | None) -> None:
        """Elements ``[lo, hi)`` of the array as read (bytes), or None where they could not be read: the pieces
        there are left unchecked, their damage named already."""
        todo, item = self._todo, self.info.itemsize
        while self._next < len(todo) and todo[self._next][0] < hi:
            piece = todo[self._next]
            self._open.append((piece, PieceHasher(piece[2][0])))
            self._next += 1
        still = []
        for piece, hasher in self._open:
            start, stop, digest, name, box = piece
            if hasher is not None:
                if data is None:
                    hasher = None
                else:
                    hasher.update(data[(max(start, lo) - lo) * item:(min(stop, hi) - lo) * item])
            if stop > hi:
                still.append((piece, hasher))
            elif hasher is not None and hasher.digest() != digest:
                self.errors.append(mismatch_text(name, box, self.info.key, start, stop - start))
        self._open = still


__all__ = ["Checked", "PieceDigests"]
