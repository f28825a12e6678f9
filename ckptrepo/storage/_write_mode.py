"""Which way a shard object goes to a local disk: with O_DIRECT, or through the page cache.

O_DIRECT spares the CPU a copy into the page cache and keeps the cache for the training data, which is
what a fast NVMe device rewards. Some devices write several times faster through the page cache (a
virtual disk that merges the kernel's larger writeback requests; benchmarks/RESULTS.md has a case). So
the writer measures both, as they come: each mode's recent throughput (bytes over
the object's write and fsync) is kept, the faster one is used, and the other is tried again every
``PROBE_EVERY`` objects in case the device's behaviour changed.
"""
from __future__ import annotations

import threading

PROBE_EVERY = 16
_WEIGHT = 0.5   # of the newest measurement in a mode's running rate


class WriteModes:
    """Shared by a writer's threads: ``pick()`` before an object, ``record()`` after it is durable."""

    def __init__(self) -> None:
        self._rate: dict[bool, float | None] = {True: None, False: None}   # O_DIRECT? -> bytes per second
        self._picks = 0
        self._lock = threading.Lock()

    def pick(self) -> bool:
        """Whether the next object goes with O_DIRECT: the untried mode first (O_DIRECT before the page
        cache), then the faster one, the slower one every ``PROBE_EVERY`` picks."""
        with self._lock:
            self._picks += 1
            direct, cached = self._rate[True], self._rate[False]
            if direct is None or cached is None:
                return direct is None
            faster = direct >= cached
            return (not faster) if self._picks % PROBE_EVERY == 0 else faster

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rate[direct]
            self._rate[direct] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate
