"""Loading one version: a new state with the saved nesting, in place into an existing one, or one rank's state
in a parallel layout (``Repository.load``, after its argument checks).

Only the skeleton's own types are ever built, no pickle; with ``into``, shapes and dtypes are checked before
anything is changed (``_binding.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ckptrepo.core import Plumbing, require_data_somewhere
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CorruptionError
from ckptrepo.loading._binding import Binder
from ckptrepo.loading._layout_load import load_layout, needs_layout_load
from ckptrepo.state import malformed_skeleton, unflatten

if TYPE_CHECKING:
    from ckptrepo.loading._engine import ReadStats
    from ckptrepo.parallel.layout import ParallelLayout


def load_version(plumbing: Plumbing, vid: str, into: Any, target_device: torch.device | None,
                 on_bytes: Callable[[int], None] | None, parallel_layout: ParallelLayout | None,
                 rank: int | None, read_stats: ReadStats | None) -> Any:
    """Load version ``vid`` (see ``Repository.load``); a version whose data is gone is refused in one line."""
    m = plumbing.manifest(vid)
    plumbing.require_data(vid, m)
    try:
        return _load_data(plumbing, vid, m, into, target_device, on_bytes, parallel_layout, rank, read_stats)
    except CorruptionError:
        # pruned by a gc while it was read, here or on the remote: say so, not "corrupt; run fsck"
        require_data_somewhere(plumbing, vid, m)
        raise


def _load_data(plumbing: Plumbing, vid: str, m: Manifest, into: Any, target_device: torch.device | None,
               on_bytes: Callable[[int], None] | None, parallel_layout: ParallelLayout | None,
               rank: int | None, read_stats: ReadStats | None) -> Any:
    # looked up at each load, not bound once at import: a test stands in for the reads (a gc racing them)
    from ckptrepo.loading._device_load import ndarray_leaves, read_tensors_to
    store = plumbing.data_store(m)
    if needs_layout_load(m, parallel_layout, into):
        return load_layout(store, m, parallel_layout, rank, into, target_device, read_stats)
    entries = list(m.tensors)
    arrays = m.arrays
    fresh: dict[int, torch.Tensor] = {}

    def get_tensor(i: int, as_numpy: bool) -> Any:
        t = fresh[i]
        if as_numpy:
            return t.numpy()
        return t.to(target_device) if target_device is not None else t

    def build(node: Any) -> Any:
        return unflatten(node, get_tensor)

    if into is None:
        # onto a GPU: read through pinned buffers and copied as read (loading/_device_load.py)
        fresh.update(read_tensors_to(store, arrays, entries, list(range(len(entries))), device=target_device,
                                     on_host=ndarray_leaves(m.tree), on_bytes=on_bytes))
        return unflatten(m.tree, get_tensor)
    binder = Binder(entries, build, vid)
    with malformed_skeleton():
        finalize = binder.bind(m.tree, into)
    wanted = list(range(len(entries)))
    got = read_tensors_to(store, arrays, entries, wanted, into=binder.destinations, on_bytes=on_bytes)
    fresh.update({i: t for i, t in got.items() if i not in binder.destinations})
    return finalize()


__all__ = ["load_version"]
