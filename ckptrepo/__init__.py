"""ckptrepo: a versioned checkpoint repository for PyTorch training state.

Git for training state, built like an object store: every snapshot is an
immutable version with its own manifest, stored in any TensorStore key-value
store (local directory, memory, S3, GCS).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptrepo.errors import (
                     ArgumentError,
                     CkptRepoError,
                     ConflictError,
                     CorruptionError,
                     DetachedHeadError,
                     FormatVersionError,
                     LayoutError,
                     NotARepositoryError,
                     PushRejectedError,
                     RefError,
                     RemoteError,
                     RepositoryExistsError,
                     RetentionError,
                     RevisionError,
                     StateMismatchError,
                     StorageError,
                     UnsupportedValueError,
)

if TYPE_CHECKING:
    from ckptrepo import rules
    from ckptrepo.core import Version
    from ckptrepo.maintenance import RetentionPolicy
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.repository import Repository, VersionDetails, clone, init, load, open
    from ckptrepo.saving import LocalTier, SnapshotterOptions

__version__ = "0.1.0"

# The rest of the API is imported on first use (PEP 562): a command such as `ckptrepo log` then loads only the
# modules it runs, not torch, numpy or TensorStore (tests/integration/test_startup.py holds it to that).
_LAZY = {
    "rules": ("ckptrepo.rules", None),
    "Version": ("ckptrepo.core", "Version"),
    "RetentionPolicy": ("ckptrepo.maintenance", "RetentionPolicy"),
    "ParallelLayout": ("ckptrepo.parallel.layout", "ParallelLayout"),
    "SnapshotterOptions": ("ckptrepo.saving", "SnapshotterOptions"),
    "LocalTier": ("ckptrepo.saving", "LocalTier"),
    **{name: ("ckptrepo.repository", name)
       for name in ("Repository", "VersionDetails", "clone", "init", "load", "open")},
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        if not name.startswith("_"):   # a subpackage or module (ckptrepo.repository, ckptrepo.dcp), as once imported
            try:
                return importlib.import_module(f"ckptrepo.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"ckptrepo.{name}":
                    raise
        raise AttributeError(f"module 'ckptrepo' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module) if attr is None else getattr(importlib.import_module(module), attr)
    globals()[name] = value   # once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArgumentError",
    "CkptRepoError", "ConflictError", "CorruptionError", "DetachedHeadError", "FormatVersionError", "LayoutError",
    "ParallelLayout", "RetentionPolicy", "load", "rules",
    "NotARepositoryError", "RefError", "RepositoryExistsError", "RetentionError", "RevisionError", "StateMismatchError",
    "StorageError", "UnsupportedValueError", "Repository", "Version", "VersionDetails", "init", "open",
    "clone", "PushRejectedError", "RemoteError", "SnapshotterOptions", "LocalTier",
]
