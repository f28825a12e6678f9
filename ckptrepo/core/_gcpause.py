"""Pause Python's cyclic garbage collector around bulk work that allocates many short-lived objects.

A load plans and issues thousands of reads (spans, futures, index arrays).
Each few hundred allocations trigger a young-generation collection, and
the survivors (the plan lives until the load ends) soon trigger a full one,
which walks every object in the process: with torch imported that is a
quarter of a million objects, so full collections take a large share of a
small load's time and cause its outliers (docs/decisions/008-gc-pause.md).
Rank 0's decoding and merging of a sharded snapshot's rank parts is such
bulk work too.

Reference counting still frees everything that is not in a cycle, and the
collector runs again as soon as the outermost pause ends; the pause covers
one bounded call, never the training loop.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Disable the cyclic collector for the duration (nested and concurrent uses restore it once, at the end)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
