"""Parallel layouts: TP/PP/DP/ZeRO layouts, sharding rules, the mapping of local state to global pieces,
replica fingerprints, and the distributed two-phase commit.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.parallel._distributed import (
        GroupHealth,
        Staging,
        all_gather,
        assign_writers,
        merge_rank_manifests,
        merge_tensor_table,
        process_group_rank,
    )
    from ckptrepo.parallel._kv import DeadlineError, GroupStore, ranks_text
    from ckptrepo.parallel._replicas import check_replicas, fingerprints
    from ckptrepo.parallel._sharding import Piece, ShardedState, Sharder, column_blocks, rank_name, rank_path

_LAZY = {
    "ckptrepo.parallel._distributed": ("GroupHealth", "Staging", "all_gather", "assign_writers", "merge_rank_manifests",
                                       "merge_tensor_table", "process_group_rank"),
    "ckptrepo.parallel._kv": ("DeadlineError", "GroupStore", "ranks_text"),
    "ckptrepo.parallel._replicas": ("check_replicas", "fingerprints"),
    "ckptrepo.parallel._sharding": ("Piece", "ShardedState", "Sharder", "column_blocks", "rank_name", "rank_path"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["DeadlineError", "GroupHealth", "GroupStore", "Piece", "ShardedState", "Sharder", "Staging", "all_gather",
           "assign_writers", "check_replicas", "column_blocks", "fingerprints", "merge_rank_manifests",
           "merge_tensor_table", "process_group_rank", "rank_name", "rank_path", "ranks_text"]
# End of facade.
