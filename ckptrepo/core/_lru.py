"""A small thread-safe least-recently-used cache.

A repository handle lives as long as the training run that snapshots through
it, so whatever it caches per version or per state structure must be bounded:
a cache that only grows holds every manifest of a run that snapshots every
step (thousands of Python objects each) and makes every full collection of
Python's cyclic garbage collector walk them all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``capacity`` entries; a hit makes its entry the most recent, an insert evicts the least recent."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache holds at least one entry (capacity {capacity})")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._put(key, value)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The cached value, or ``make()``'s, cached. ``make`` runs under the lock, so concurrent callers of
        one key make it once (keep it cheap: it holds up every other caller)."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                return value
            value = make()
            self._put(key, value)
            return value

    def _put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
