"""Helpers for stores whose keys are files under a local directory (``StoreCapabilities.local_root``).

Shared by the TensorStore store's file driver, the direct read and write paths
and the refs, none of which should need the others to count bytes or tidy folders.
"""
from __future__ import annotations

import os
import threading

# TensorStore's file kvstore writes a value to <key>.__lock, then renames it; such keys are never values
LOCK_SUFFIX = ".__lock"


class ByteCounter:
    """A running total of bytes, safe across threads: what a direct local I/O path (localread,
    localwrite, the store's plain reads) moved, the counterpart of TensorStore's own kvstore metrics."""

    def __init__(self) -> None:
        self._total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    def total(self) -> int:
        return self._total


def remove_empty_folders(root: str, prefix: str) -> None:
    """The empty folders under ``prefix`` (a folder when it ends in "/"), then its parents while they are empty,
    stopping below its top-level folder (``data/``, ``staging/``)."""
    path = os.path.join(root, prefix.rstrip("/"))
    folder = path if prefix.endswith("/") else os.path.dirname(path)
    for sub, _, _ in os.walk(folder, topdown=False):
        try:
            os.rmdir(sub)   # only when empty
        except OSError:
            pass
    remove_empty_parents(os.path.dirname(folder), os.path.join(root, prefix.split("/", 1)[0]))


def remove_empty_parents(folder: str, top: str) -> None:
    """Remove ``folder``, then its parents, while they are empty, stopping below ``top`` (a local store's
    folders: a deleted key's leftovers)."""
    while folder.startswith(top + os.sep):
        try:
            os.rmdir(folder)   # only when empty
        except OSError:
            return
        folder = os.path.dirname(folder)
