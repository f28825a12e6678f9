"""The save path: coalescing plans, the staging pool, lazy asynchronous capture, dedup and the commit.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.saving._capture import Snapshotter, unwrapped_optimizer
    from ckptrepo.saving._host_memory import parse_size
    from ckptrepo.saving._options import LocalTier, SnapshotterOptions
    from ckptrepo.saving._pieces import (
        BranchBase,
        GlobalChunk,
        RankWrite,
        commit_chunks,
        read_branch_base,
        read_chunks,
        tensor_order,
        write_rank_chunks,
    )
    from ckptrepo.saving._snapshot_job import SnapshotHandle
    from ckptrepo.saving._writer import PlanCache

_LAZY = {
    "ckptrepo.saving._capture": ("Snapshotter", "unwrapped_optimizer"),
    "ckptrepo.saving._host_memory": ("parse_size",),
    "ckptrepo.saving._options": ("LocalTier", "SnapshotterOptions"),
    "ckptrepo.saving._pieces": ("BranchBase", "GlobalChunk", "RankWrite", "commit_chunks", "read_branch_base",
                                "read_chunks", "tensor_order", "write_rank_chunks"),
    "ckptrepo.saving._snapshot_job": ("SnapshotHandle",),
    "ckptrepo.saving._writer": ("PlanCache",),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["BranchBase", "GlobalChunk", "LocalTier", "PlanCache", "RankWrite", "SnapshotHandle", "Snapshotter",
           "SnapshotterOptions", "commit_chunks", "parse_size", "read_branch_base", "read_chunks", "tensor_order",
           "unwrapped_optimizer", "write_rank_chunks"]
# End of facade.
