"""Which way a shard object goes to a local disk: with O_DIRECT, or through the page cache.

O_DIRECT spares the CPU a copy into the page cache and keeps the cache for the training data, which is
what a fast NVMe device rewards. Some devices write several times faster through the page cache (a
virtual disk that merges the kernel's larger writeback requests; benchmarks/RESULTS.md has a case). So
the writer measures both, as they come: each mode's recent throughput (bytes over the object's write and
fsync, times the objects written meanwhile: the device's rate) is kept, and the other mode is tried again
every ``PROBE_EVERY`` objects in case the device's behaviour changed.

The two rates are not weighed evenly: the page cache's costs a copy of every byte on a CPU the training
loop shares, which its rate does not show, and on a device where both modes write about as fast that
copy is CPU the loop loses for nothing (docs/decisions/055-the-write-rate.md). So O_DIRECT is kept unless the
page cache wrote ``PAGE_CACHE_MARGIN`` times faster. A mode's trial is one object at a time: the writer's
threads pick at once, and without that rule all of them would try the untried mode together.
"""
from __future__ import annotations

import threading

PROBE_EVERY = 16
PAGE_CACHE_MARGIN = 2.0   # how much faster the page cache must write to be used
_WEIGHT = 0.5   # of the newest measurement in a mode's running rate


class WriteModes:
    """Shared by a writer's threads: ``pick()`` before an object, ``record()`` once it is durable (or
    ``abandon()`` if its write failed)."""

    def __init__(self) -> None:
        self._rate: dict[bool, float | None] = {True: None, False: None}   # O_DIRECT? -> bytes per second
        self._trying: dict[bool, int] = {True: 0, False: 0}   # objects in flight in each mode while it has no rate
        self._picks = 0
        self._in_flight = 0   # objects being written (``begin``), whichever way
        self._lock = threading.Lock()

    def pick(self) -> bool:
        """Whether the next object goes with O_DIRECT: O_DIRECT first; once it has a rate, one object through
        the page cache; then the preferred mode (``preferred``), the other every ``PROBE_EVERY`` picks."""
        with self._lock:
            self._picks += 1
            direct, cached = self._rate[True], self._rate[False]
            if direct is None and cached is None:
                choice = True
            elif direct is None or cached is None:
                untried = direct is None
                # the untried mode for one object at a time, the measured one meanwhile
                choice = (not untried) if self._trying[untried] else untried
            else:
                best = self._preferred(direct, cached)
                choice = (not best) if self._picks % PROBE_EVERY == 0 else best
            if self._rate[choice] is None:
                self._trying[choice] += 1
            return choice

    def preferred(self) -> bool | None:
        """The mode objects go in between trials (True: O_DIRECT); None until both have a rate."""
        with self._lock:
            direct, cached = self._rate[True], self._rate[False]
            return None if direct is None or cached is None else self._preferred(direct, cached)

    @staticmethod
    def _preferred(direct: float, cached: float) -> bool:
        return cached <= PAGE_CACHE_MARGIN * direct

    def record(self, direct: bool, nbytes: int, seconds: float, sharing: float = 1.0) -> None:
        """An object ``pick`` sent this way is durable: ``nbytes`` in ``seconds`` (write and fsync), while
        ``sharing`` objects on average (itself included) were being written to the device.

        The rate kept is the device's, ``sharing`` times the object's own: the first objects of a writer all
        go with O_DIRECT at once, each getting a part of the device, where the page cache's first trial may
        run nearly alone; objects' own rates would favour whichever mode ran with fewer others.
        """
        with self._lock:
            self._settle(direct)
            if seconds <= 0 or nbytes <= 0:
                return
            rate = nbytes * max(1.0, sharing) / seconds
            old = self._rate[direct]
            self._rate[direct] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate

    def abandon(self, direct: bool) -> None:
        """An object ``pick`` sent this way was not written (an error, or O_DIRECT refused): no figure."""
        with self._lock:
            self._settle(direct)

    def _settle(self, direct: bool) -> None:
        if self._trying[direct]:
            self._trying[direct] -= 1

    def begin(self) -> "Flight":
        """An object's write starts (either way): counted among those in flight until its ``Flight.over``."""
        with self._lock:
            self._in_flight += 1
            return Flight(self, self._in_flight)

    def _land(self) -> int:
        with self._lock:
            self._in_flight -= 1
            return self._in_flight + 1


class Flight:
    """One object's write among the others: how many shared the device with it, on average (the mean of the
    counts at its start and at its end), which ``WriteModes.record`` turns into the device's rate."""

    def __init__(self, modes: WriteModes, at_start: int) -> None:
        self._modes, self._at_start = modes, at_start
        self._sharing: float | None = None

    def over(self) -> float:
        """End the write (once; later calls return the same figure)."""
        if self._sharing is None:
            self._sharing = (self._at_start + self._modes._land()) / 2
        return self._sharing
