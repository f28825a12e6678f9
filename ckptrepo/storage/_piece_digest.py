"""Content digests of stored pieces, taken over bytes a reader already holds: what load and fsck check.

A manifest's piece records the digest of the bytes it stores (docs/format.md, the ``digest`` of a piece):
an algorithm byte, then a 128-bit hash of the bytes in row-major order. The chunk crc32cs and the chunk
table prove each chunk is as written, chunk by chunk; a crc32c is linear, so a chunk changed together with
4 bytes chosen to restore its crc32c passes both. The piece digest covers the piece's bytes as a whole, so
a reader that holds a piece whole checks it too.

* ``XXH3`` (1): xxh3-128 (the xxhash package, which lets go of the GIL while it hashes, so reader threads
  hash in parallel).
* ``WORDSUM`` (2): the sum of mixed 64-bit words a CUDA snapshot takes on its device
  (saving/_content_hash.py); here in numpy over host bytes, block by block, so that fsck and CPU loads,
  which import no torch or have no GPU, check it too. Integer sums give the same bits in any order.

A hasher is fed the piece's bytes in order, in as many parts as the reader has them.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import xxhash

from ckptrepo.errors import DigestMismatchError

XXH3 = 1
WORDSUM = 2
HASH_BYTES = 16   # after the algorithm byte

U64 = (1 << 64) - 1   # WORDSUM's sums are taken modulo 2**64
POS = 0x9E3779B97F4A7C15    # WORDSUM's position tag of word i: i * POS
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
M3 = 0xFF51AFD7ED558CCD

_BLOCK_WORDS = 1 << 18      # WORDSUM words mixed at once: few calls (and GIL hand-offs) per byte, temporaries L2-sized
_TAGS: np.ndarray | None = None   # i * POS for i < _BLOCK_WORDS (made once, read only)
_scratch = threading.local()      # per thread: the block's two temporaries, reused (no allocation per block)


def checkable(digest: bytes | None) -> bool:
    """Whether a recorded digest is one this release can recompute (absent on older versions: no check)."""
    return digest is not None and len(digest) == 1 + HASH_BYTES and digest[0] in (XXH3, WORDSUM)


def finish_wordsum(a: int, b: int, nbytes: int) -> bytes:
    """The WORDSUM digest from its two lane sums: the length mixed in, so trailing zero bytes are not padding."""
    def fmix(z: int) -> int:
        z ^= z >> 33
        z = z * M1 & U64
        z ^= z >> 29
        z = z * M2 & U64
        return z ^ z >> 32
    a, b = fmix((a ^ nbytes) & U64), fmix((b + nbytes * POS) & U64)
    return bytes([WORDSUM]) + a.to_bytes(8, "big") + b.to_bytes(8, "big")


class PieceHasher:
    """The digest of a piece's bytes, fed in order (``update``), by the algorithm of the digest it is checked
    against."""

    __slots__ = ("algorithm", "nbytes", "_xxh", "_a", "_b", "_tail", "_words")

    def __init__(self, algorithm: int, first_word: int = 0) -> None:
        """``first_word``: WORDSUM only, the position in the piece of the first word fed, for a hasher of one
        part of a piece (``lanes``): WORDSUM's sums do not depend on the order parts are hashed in."""
        if algorithm not in (XXH3, WORDSUM):
            raise ValueError(f"unknown digest algorithm {algorithm}")
        if first_word and algorithm != WORDSUM:
            raise ValueError("only WORDSUM digests can be taken in parts out of order")
        self.algorithm, self.nbytes = algorithm, 0
        self._xxh: Any = xxhash.xxh3_128() if algorithm == XXH3 else None
        self._a = self._b = 0
        self._tail = b""            # WORDSUM: the bytes of a word not yet whole
        self._words = first_word    # WORDSUM: the position of the next whole word

    def update(self, data: Any) -> None:
        """Feed the next bytes of the piece (anything with the buffer protocol, contiguous)."""
        raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        raw = raw.view(np.uint8)
        self.nbytes += raw.nbytes
        if self._xxh is not None:
            self._xxh.update(raw)
            return
        if self._tail:
            need = 8 - len(self._tail)
            self._tail += raw[:need].tobytes()
            raw = raw[need:]
            if len(self._tail) < 8:
                return
            self._mix(np.frombuffer(self._tail, dtype="<u8"))
            self._tail = b""
        whole = raw.nbytes // 8 * 8
        if whole:
            words = raw[:whole].view("<u8") if raw.ctypes.data % 8 == 0 else \
                np.frombuffer(raw[:whole].tobytes(), dtype="<u8")
            for k in range(0, len(words), _BLOCK_WORDS):
                self._mix(words[k:k + _BLOCK_WORDS])
        self._tail = raw[whole:].tobytes()

    def _mix(self, words: np.ndarray) -> None:
        """Mix whole words (the next ones of the piece) into both lanes, as saving/_content_hash.py does on a
        device: tag with the position, multiply by odd constants, xor-shift right, sum modulo 2**64."""
        n = len(words)
        z, t = _temporaries(n)
        np.add(_tags()[:n], np.uint64(self._words * POS & U64), out=z)   # (first + i) * POS, modulo 2**64
        z ^= words
        z *= np.uint64(M1)
        np.right_shift(z, np.uint64(29), out=t)
        z ^= t
        z *= np.uint64(M2)
        np.right_shift(z, np.uint64(32), out=t)
        z ^= t
        self._a = (self._a + int(z.sum(dtype=np.uint64))) & U64
        z *= np.uint64(M3)
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
        self._b = (self._b + int(z.sum(dtype=np.uint64))) & U64
        self._words += n

    def digest(self) -> bytes:
        """The digest of everything fed (17 bytes, as a manifest records it)."""
        if self._xxh is not None:
            return bytes([XXH3]) + self._xxh.digest()
        return finish_wordsum(*self.lanes(), self.nbytes)

    def lanes(self) -> tuple[int, int]:
        """WORDSUM's two lane sums of what was fed: the parts of a piece add up (modulo 2**64) to the piece's,
        which ``finish_wordsum`` turns into its digest. A part that ends inside a word must be the piece's last."""
        a, b = self._a, self._b
        if self._tail:   # the last word, zero-padded as the device buffer pads it
            last = PieceHasher(WORDSUM, self._words)
            last._mix(np.frombuffer(self._tail.ljust(8, b"\0"), dtype="<u8"))
            a, b = (a + last._a) & U64, (b + last._b) & U64
        return a, b


def _tags() -> np.ndarray:
    global _TAGS
    if _TAGS is None:
        _TAGS = np.arange(_BLOCK_WORDS, dtype=np.uint64) * np.uint64(POS)
    return _TAGS


def _temporaries(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two block temporaries, ``n`` words each (``n`` at most ``_BLOCK_WORDS``)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = (np.empty(_BLOCK_WORDS, dtype=np.uint64), np.empty(_BLOCK_WORDS, dtype=np.uint64))
    return bufs[0][:n], bufs[1][:n]


def piece_digest(algorithm: int, data: Any) -> bytes:
    """The digest of ``data``'s bytes by ``algorithm``, in one call."""
    h = PieceHasher(algorithm)
    h.update(data)
    return h.digest()


def mismatch_error(tensor: str, box: Any, array: str, offset: int, numel: int) -> DigestMismatchError:
    """The one-line error of a piece whose bytes are not the ones its digest names, and what to run."""
    return DigestMismatchError(f"{mismatch_text(tensor, box, array, offset, numel)}; run `ckptrepo fsck`")


def mismatch_text(tensor: str, box: Any, array: str, offset: int, numel: int) -> str:
    """What names such a piece: the version that stored it (the array's), the tensor, the piece (its box and
    where its elements lie)."""
    version = array.split("/")[1][:12] if array.count("/") >= 2 else "?"
    return (f"version {version}: tensor {tensor}, piece {_box(box)} (elements {offset} to {offset + numel} of "
            f"{array}) does not match the content digest its manifest records: its stored bytes changed after "
            f"they were written")


def _box(box: Any) -> str:
    """A piece's box as offsets and sizes, short."""
    try:
        return f"at {list(box[0])} of size {list(box[1])}"
    except (TypeError, IndexError):
        return "?"


__all__ = ["WORDSUM", "XXH3", "PieceHasher", "checkable", "finish_wordsum", "mismatch_error", "mismatch_text",
           "piece_digest"]
