"""Named points inside the save path where tests inject crashes, pauses and errors.

Production code calls :func:`point` at each step that matters for crash safety
(after a data shard is durable, after all data, after the manifest, before the
ref moves; the same steps of a push, and local retention's deletes). By default
it does nothing. Tests register a callable for a point name, e.g. one that
SIGKILLs the process, to prove every interruption leaves the repository
consistent.
"""
from __future__ import annotations

from typing import Callable

_hooks: dict[str, Callable[[str], None]] = {}

POINTS = (
    "after_read_head",      # the parent (branch tip) has been read
    "before_capture",       # a segment is about to be copied into staging (raise here to fail capture)
    "before_shard_write",   # a filled segment is about to be written (raise here to fail the write)
    "before_shard_rename",  # local direct writes only: the shard is durable under its temporary name, not yet renamed
    "after_shard_write",    # one data shard is durable
    "after_data",           # every data shard is durable
    "after_manifest",       # the version manifest is durable; the ref has not moved
    "after_ref",            # the ref has moved (the version is committed)
    "push_after_array",     # push: one array is complete on the remote (its zarr.json written last)
    "push_after_manifest",  # push: one version's manifest is on the remote; no remote ref has moved yet
    "push_before_ref",      # push: every version is on the remote; its branch is about to move
    "evict_before_delete",  # local retention: a version's eviction marker is written, its data not deleted yet
)


def set_hook(name: str, fn: Callable[[str], None] | None) -> None:
    """Install (or with None, remove) the hook for point ``name``."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    if fn is None:
        _hooks.pop(name, None)
    else:
        _hooks[name] = fn


def clear() -> None:
    """Remove every hook."""
    _hooks.clear()


def point(name: str) -> None:
    """Run the hook registered for ``name``, if any."""
    fn = _hooks.get(name)
    if fn is not None:
        fn(name)


__all__ = ["POINTS", "clear", "point", "set_hook"]
