"""ckptrepo: a versioned checkpoint repository for PyTorch training state.

Git for training state, built like an object store: every snapshot is an
immutable version with its own manifest, stored in any TensorStore key-value
store (local directory, memory, S3, GCS).
"""
from ckptrepo import rules
from ckptrepo.core._manifest import Version
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
from ckptrepo.maintenance._gc import RetentionPolicy
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.repository import Repository, VersionDetails, clone, init, load, open

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "CkptRepoError", "ConflictError", "CorruptionError", "DetachedHeadError", "FormatVersionError", "LayoutError",
    "ParallelLayout", "RetentionPolicy", "load", "rules",
    "NotARepositoryError", "RefError", "RepositoryExistsError", "RetentionError", "RevisionError", "StateMismatchError",
    "StorageError", "UnsupportedValueError", "Repository", "Version", "VersionDetails", "init", "open",
    "clone", "PushRejectedError", "RemoteError",
]
