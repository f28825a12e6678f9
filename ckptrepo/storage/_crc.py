"""crc32c of in-memory buffers, for every checksum the library takes (objects, chunks, manifests).

One function over the ``fastcrc`` package (Rust, crc-rs): CRC-32/ISCSI, which is
crc32c, with the GIL released for large buffers (64 KiB inner chunks included).
Both direct local paths checksum every 64 KiB inner chunk in their own threads
while the training (or loading) thread runs Python, so both the rate and the
GIL matter: of the crc32c packages, ``fastcrc`` is the fastest over 64 KiB
chunks on one and on two threads, and it releases the GIL where
google_crc32c keeps it for small buffers (docs/decisions/006-fastcrc.md).
tests/integration/test_localwrite.py checks it against google_crc32c.
"""
from __future__ import annotations

from typing import Any

from fastcrc import crc32 as _crc32


def crc32c(buf: Any, crc: int = 0) -> int:
    """crc32c of a C-contiguous buffer's bytes (numpy array, bytes, memoryview), extending ``crc``."""
    return _crc32.iscsi(buf, crc)
