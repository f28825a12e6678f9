"""Quick GIL hand-offs while a CUDA capture runs.

Every torch call lets go of the GIL while it dispatches and must take it back afterwards. A training
thread that runs Python (the loop's own code, a data loader's collation) gives the GIL up only when the
interpreter's switch interval has passed since another thread asked for it: 5 ms by default. A capture
thread making a few hundred torch calls would then wait a few hundred switch intervals, seconds for a
capture the GPU does in milliseconds. So while any CUDA capture runs, the interval is shortened (never
lengthened) and restored afterwards: the training thread then hands the GIL over after 0.2 ms, and gets
it back as soon as the capture thread's short call returns.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

CAPTURE_SWITCH_INTERVAL_S = 2e-4

_lock = threading.Lock()
_active = 0
_saved: float | None = None   # the interval before the first use
_ours: float | None = None    # the interval as it reads back while shortened (it is kept in microseconds)


@contextlib.contextmanager
def quick_gil_handoffs(interval_s: float = CAPTURE_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Shorten ``sys.setswitchinterval`` to ``interval_s`` for the duration (nested and concurrent uses share
    one shortening); the interval found before the first use is restored after the last, unless someone set
    another meanwhile."""
    global _active, _saved, _ours
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            if _saved > interval_s:
                sys.setswitchinterval(interval_s)
            _ours = sys.getswitchinterval()
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                if sys.getswitchinterval() == _ours:
                    sys.setswitchinterval(_saved)
                _saved = _ours = None
