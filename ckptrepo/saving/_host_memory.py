"""How much host memory a snapshotter may stage in: the ``host_memory`` argument parsed, or the default."""
from __future__ import annotations

import re

from ckptrepo.errors import ArgumentError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|[KMGT]|B)?\s*$", re.IGNORECASE)
_UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1}


def parse_size(size: int | str | None, name: str = "host_memory") -> int | None:
    """``"8GiB"``, ``"512MB"``, ``1 << 30`` -> bytes; None for the default. Anything else (negative, zero,
    "abc", a float) is refused in one line rather than read as a tiny pool or as the default."""
    if size is None:
        return None
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif m is not None:
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    else:
        n = 0
    if n <= 0:
        raise ArgumentError(f"{name} {size!r} is not a size; pass bytes (an int > 0) or a string like '8GiB'")
    return n


def default_host_memory() -> int:
    """A quarter of the memory available now, at most 8 GiB and at least 256 MiB."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 4 << 30
    return max(256 << 20, min(8 << 30, avail // 4))


__all__ = ["default_host_memory", "parse_size"]
