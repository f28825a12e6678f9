"""ckptrepo: a versioned checkpoint repository for PyTorch training state.

Git for training state, built like an object store: every snapshot is an
immutable version with its own manifest, stored in any TensorStore key-value
store (local directory, memory, S3, GCS).
"""
from . import rules
from .errors import (CkptRepoError, ConflictError, CorruptionError, DetachedHeadError, FormatVersionError,
                     LayoutError, NotARepositoryError, RefError, RepositoryExistsError, RetentionError, RevisionError,
                     StateMismatchError, StorageError, UnsupportedValueError)
from .gc import RetentionPolicy
from .layout import ParallelLayout
from .manifest import Version
from .repo import Repository, VersionDetails, init, load, open

__version__ = "0.1.0"

__all__ = [
    "CkptRepoError", "ConflictError", "CorruptionError", "DetachedHeadError", "FormatVersionError", "LayoutError",
    "ParallelLayout", "RetentionPolicy", "load", "rules",
    "NotARepositoryError", "RefError", "RepositoryExistsError", "RetentionError", "RevisionError", "StateMismatchError",
    "StorageError", "UnsupportedValueError", "Repository", "Version", "VersionDetails", "init", "open",
]
