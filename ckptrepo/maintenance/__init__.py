"""Keeping a repository healthy: retention and garbage collection, fsck, disk usage.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.maintenance._fsck import FsckReport, fsck
    from ckptrepo.maintenance._gc import (
        DEFAULT_GRACE_S,
        GcReport,
        RetentionPolicy,
        VersionFacts,
        collect,
        data_version_ids,
        prune_version,
        pruning_arrays,
        staged_ids,
    )
    from ckptrepo.maintenance._lost import collected_while_committing, own_arrays, repair_lost, undo_collected_commit
    from ckptrepo.maintenance._usage import DiskUsage, disk_usage

_LAZY = {
    "ckptrepo.maintenance._fsck": ("FsckReport", "fsck"),
    "ckptrepo.maintenance._gc": ("DEFAULT_GRACE_S", "GcReport", "RetentionPolicy", "VersionFacts", "collect",
                                 "data_version_ids", "prune_version", "pruning_arrays", "staged_ids"),
    "ckptrepo.maintenance._lost": ("collected_while_committing", "own_arrays", "repair_lost", "undo_collected_commit"),
    "ckptrepo.maintenance._usage": ("DiskUsage", "disk_usage"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["DEFAULT_GRACE_S", "DiskUsage", "FsckReport", "GcReport", "RetentionPolicy", "VersionFacts", "collect",
           "collected_while_committing", "data_version_ids", "disk_usage", "fsck", "own_arrays", "prune_version",
           "pruning_arrays", "repair_lost", "staged_ids", "undo_collected_commit"]
# End of facade.
