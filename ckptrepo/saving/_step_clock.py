"""What a snapshot cost the training loop: the time it held the loop, and the slowdown of the steps it overlapped.

``blocking_s`` counts the time the training thread spends inside ``snapshot()`` and in the optimizer's
pre-step wait for capture. The snapshot's background work (capture, hashes, statistics, writes, the
commit) runs while the loop computes, and on a host whose cores the loop uses takes some of them: the
steps it overlaps are slower, which no wait shows. ``StepClock`` measures that from the attached
optimizer's pre-step hook, which every step passes through:

* each interval between two of its steps (from the end of one pre-step hook to the end of the next, so the
  wait for capture, the ``snapshot()`` call and the slowdown all fall inside one);
* each snapshot's window, from ``snapshot()`` until its commit (or failure);
* a snapshot's lost time: the sum, over the intervals that overlap its window (and end before no later
  snapshot's start), of each interval minus the median of recent intervals that overlapped no window; the
  interval still running counts for what it has run beyond that median. Never less than ``blocking_s``
  plus a wait still in progress, whatever the noise of the other steps says.

The commit records the lost time in the version. Its background work is mostly over by then, but the step
it slowed is usually still running: the commit stage first waits for that step's end (``hold``, bounded,
and never while something waits for the commit), so the figure holds all of that step.

Without an attached optimizer (no steps seen), or without a step that ran clear of every snapshot (a
snapshot every step from the first), there is nothing to compare with, and the lost time is the blocking
time. A wait in ``close()`` or ``wait()`` is outside any step and not counted.
"""
from __future__ import annotations

import contextlib
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator

# the intervals kept: enough for a median of the recent clean steps and the window of a commit, few enough
# that the commit thread's pass over them (intervals times windows) stays cheap
KEEP_INTERVALS = 64
# steps longer than this: a commit is not held for the end of the step running (see StepClock.hold)
HOLD_MAX_S = 2.0


class StepClock:
    """The intervals between one optimizer's steps and the windows of the snapshots in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: float | None = None    # the end of the last pre-step hook
        self._waiting: float | None = None   # the start of a pre-step wait in progress
        self._intervals: deque[tuple[float, float]] = deque(maxlen=KEEP_INTERVALS)
        self._windows: dict[int, list[float]] = {}   # window key -> [start, end (inf while open)]
        self._keys = itertools.count()
        self._ticked = threading.Condition(self._lock)
        self._released: set[int] = set()   # windows whose commit something waits for: never held

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around the pre-step hook's wait: the interval since the last step ends when the wait does."""
        start = time.perf_counter()
        with self._lock:
            self._waiting = start
        try:
            yield
        finally:
            now = time.perf_counter()
            with self._lock:
                self._waiting = None
                if self._last is not None:
                    self._intervals.append((self._last, now))
                self._last = now
                self._ticked.notify_all()

    def opened(self, started: float) -> int:
        """A snapshot began at ``started``: the key of its window (``lost``, ``closed``)."""
        key = next(self._keys)
        with self._lock:
            self._windows[key] = [started, _OPEN]
            self._prune()
        return key

    def closed(self, key: int) -> None:
        """The snapshot is committed or failed: later intervals are neither its nor slowed by it."""
        with self._lock:
            window = self._windows.get(key)
            if window is not None and window[1] == _OPEN:
                window[1] = time.perf_counter()
            self._released.discard(key)

    def release(self, key: int) -> None:
        """Something waits for the snapshot of window ``key`` to commit: ``hold`` must not keep it back."""
        with self._lock:
            window = self._windows.get(key)
            if window is not None and window[1] == _OPEN:   # a closed window is never held, nor closed again
                self._released.add(key)
            self._ticked.notify_all()

    def hold(self, key: int) -> None:
        """Before the commit records ``lost``: wait for the step running now to end, since the snapshot's
        background work slowed it and only its end says by how much. Not when nothing steps (no step seen, none
        clear of a snapshot, or the last one more than two typical steps ago), when steps are longer than
        ``HOLD_MAX_S`` (the version would stay uncommitted that long), nor once something waits for the commit
        (``release``: ``wait()``, ``close()``, ``result()`` and the wait for room in ``snapshot()``, which the
        training thread may call before its next step); at most until two typical steps after the last one."""
        with self._lock:
            if key in self._released or self._last is None:
                return
            clean = [e - s for s, e in self._intervals if not self._overlaps(s, e)]
            if not clean or statistics.median(clean) > HOLD_MAX_S:
                return
            since = self._last
            deadline = since + 2 * statistics.median(clean)
            while self._last == since and key not in self._released:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self._ticked.wait(left)

    def lost(self, key: int, blocking: float) -> float:
        """The time the loop lost to the snapshot of window ``key`` so far (all of it once the window is closed)."""
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                return blocking
            start, end = window
            now = time.perf_counter()
            running = end == _OPEN
            floor = blocking + (now - self._waiting if running and self._waiting is not None else 0.0)
            later = min((w[0] for w in self._windows.values() if w[0] > start), default=_OPEN)
            clean = [e - s for s, e in self._intervals if not self._overlaps(s, e)]
            if not clean:
                return floor
            typical = statistics.median(clean)
            excess = sum(e - s - typical for s, e in self._intervals if start < e <= later and s < end)
            if running and self._last is not None and later == _OPEN:   # the interval still running
                excess += max(0.0, now - max(self._last, start) - typical)
            return max(floor, excess)

    def _overlaps(self, s: float, e: float) -> bool:
        return any(w0 < e and s < w1 for w0, w1 in self._windows.values())

    def _prune(self) -> None:
        """Forget closed windows that end before the oldest interval kept (they mark none of them), and beyond
        ``KEEP_INTERVALS`` windows the oldest closed ones (snapshots with no optimizer stepping)."""
        oldest = self._intervals[0][0] if self._intervals else _OPEN
        closed = [k for k, (_s, e) in self._windows.items() if e != _OPEN]
        for k in closed:
            if self._windows[k][1] < oldest or len(self._windows) > KEEP_INTERVALS:
                del self._windows[k]


_OPEN = float("inf")

__all__ = ["HOLD_MAX_S", "KEEP_INTERVALS", "StepClock"]
