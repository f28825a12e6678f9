"""crc32c of in-memory buffers without holding the GIL: the checksum of both direct local paths.

google_crc32c's own functions keep the GIL for buffers under 1 MiB, and inner
chunks are 64 KiB, so the writer's and reader's threads would take turns with
the training (or loading) thread for the GIL over every chunk. The libcrc32c
it wraps, called through ctypes, releases it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Callable

import google_crc32c
import numpy as np


def _native_crc32c() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the libcrc32c that google_crc32c wraps, called through ctypes.

    None when the library cannot be found or disagrees with google_crc32c
    (then google_crc32c is used, GIL held).
    """
    if google_crc32c.implementation != "c":
        return None
    here = os.path.dirname(os.path.abspath(google_crc32c.__file__))
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(here), "google_crc32c.libs", "libcrc32c*.so*")))
    candidates += sorted(glob.glob(os.path.join(here, ".libs", "libcrc32c*")))
    found = ctypes.util.find_library("crc32c")
    if found:
        candidates.append(found)
    probe = np.frombuffer(bytes(range(256)) * 5, dtype=np.uint8)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        if fn(0, probe.ctypes.data, probe.nbytes) == google_crc32c.value(probe) \
                and fn(7, probe.ctypes.data, 100) == google_crc32c.extend(7, probe[:100]):
            return fn
    return None


_crc_extend = _native_crc32c()


def crc32c(buf: np.ndarray, crc: int = 0) -> int:
    """crc32c of a C-contiguous array's bytes, extending ``crc``; without the GIL where possible."""
    if _crc_extend is not None:
        return _crc_extend(crc, buf.ctypes.data, buf.nbytes)
    return google_crc32c.extend(crc, buf)
