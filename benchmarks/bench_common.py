"""Helpers shared by the benchmark scripts (run them as `python benchmarks/NAME.py`)."""
from __future__ import annotations

import os
import resource


def cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fsync_dir(path: str) -> None:
    """Make a directory entry (a new file in it) durable, as the peers' saves must be for a fair timing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
