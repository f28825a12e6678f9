"""Exception types.

Every error a user can cause carries a one-line message that says what went
wrong and what to do, so the CLI can print ``str(err)`` and exit without a
traceback.
"""
from __future__ import annotations

import errno
import os
import re
import sys
import warnings
from types import FrameType


class CkptRepoError(Exception):
    """Base class of every ckptrepo error."""


class NotARepositoryError(CkptRepoError):
    """The URL holds no ckptrepo repository."""


class RepositoryExistsError(CkptRepoError):
    """``init`` found a repository already there."""


class FormatVersionError(CkptRepoError):
    """The repository was written in a format this release cannot read."""


class RevisionError(CkptRepoError):
    """A revision is unknown, ambiguous or malformed."""


class RefError(CkptRepoError):
    """A branch or tag cannot be created or moved as asked."""


class DetachedHeadError(CkptRepoError):
    """A snapshot was attempted while HEAD points at a version, not a branch."""


class ConflictError(CkptRepoError):
    """A compare-and-swap on a ref lost against a concurrent writer."""


class UnsupportedValueError(CkptRepoError):
    """A value in the state cannot be stored without pickle."""


class StateMismatchError(CkptRepoError):
    """``load(into=...)`` found a shape, dtype or structure that differs."""


class CorruptionError(CkptRepoError):
    """An object failed its checksum or does not match its manifest."""


class StorageError(CkptRepoError):
    """The key-value store failed (I/O error, permission, network)."""


class SnapshotFailedError(CkptRepoError):
    """A background snapshot could not be committed; raised at the next call into the snapshotter."""


class ExchangeError(CkptRepoError):
    """An export or import cannot be done as asked: unknown format or path, existing output, or a value
    the format cannot hold."""


class TrustRequiredError(CkptRepoError):
    """Importing would unpickle the input, which can run arbitrary code; the caller must say it trusts the source."""


class MissingDependencyError(CkptRepoError):
    """An optional feature needs a package that is not installed; the message names the extra to install."""


class RetentionError(CkptRepoError):
    """A retention rule cannot be applied as given (a best-N rule without a metric, or one no version records)."""


class ArgumentError(CkptRepoError, ValueError):
    """An argument of a call has the wrong type or a value out of range (a ValueError too, as Python's own
    checks of such arguments are)."""


class RemoteError(CkptRepoError):
    """A remote cannot take part: it holds another repository, or none where one is needed."""


class PushRejectedError(RemoteError):
    """A push that would lose the remote's versions (not a fast-forward), as git rejects it: fetch first."""


class BackpressureWarning(UserWarning):
    """A snapshot waited, or was skipped, because the local tier holds as much data not pushed to its remote yet
    as ``local_max_bytes`` allows (a snapshotter with ``push_to``)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside ckptrepo: the user's line that called the
    library (``repo.load(...)``), not the module deep inside that noticed. A fixed ``stacklevel`` names the
    wrong line as soon as the calls between the public method and the warning change; this counts them."""
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class LayoutError(CkptRepoError):
    """A parallel layout or sharding rule does not fit the state (wrong degrees, indivisible sizes)."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none: what a one-line error
    quotes of a cause (a TensorStore or OS error can run over several lines, and some have no message)."""
    if isinstance(err, OSError) and err.strerror:
        return os_error_text(err)
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = _OS_ERROR_CODE.sub("", text.splitlines()[0])
    # TensorStore appends the whole spec of the array or store it was opening (a kilobyte of JSON) and an
    # HTTP error's XML body: neither says anything the rest of the line does not
    cut = min((i for i in (line.find(m) for m in _BULKY_PAYLOADS) if i >= 0), default=-1)
    end = line.rfind("']")
    return line[:cut] + line[end + 2:] if 0 <= cut < end else line


_BULKY_PAYLOADS = (" [tensorstore_spec='", " [http_response_body='")
_OS_ERROR_CODE = re.compile(r" ?\[os_error_code='?\d+'?\]")   # TensorStore's errno, after the words that say it


# TensorStore's status codes (the first word of its messages) for a store that could not be reached or
# would not serve us: nothing is known about the object then, so it must not be reported as damaged
_UNREACHABLE_CODES = frozenset(("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED",
                                "RESOURCE_EXHAUSTED", "CANCELLED"))


def is_storage_failure(reason: str) -> bool:
    """Whether a read error's first line says the store failed us (unreachable, refusing, every retry of a
    request spent) rather than anything about what it holds: a stopped S3 endpoint must read as
    a StorageError, not as corrupt objects and a call to run fsck."""
    return reason.split(":", 1)[0].strip() in _UNREACHABLE_CODES or "retry attempts failed" in reason


def storage_failure_hint(reason: str) -> str:
    """What to do, appended to a storage error whose request was tried until its retries ran out."""
    if "retry attempts failed" not in reason:
        return ""
    return ("; check the URL, the endpoint (AWS_ENDPOINT_URL) and the credentials, or set CKPTREPO_STORE_RETRIES "
            "to try longer")


def storage_failure(what: str, reason: str) -> StorageError:
    """The one-line error of an operation the store failed (``reason``: the cause's first line)."""
    return StorageError(f"{what} failed: {reason}{storage_failure_hint(reason)}")


def damaged_object_error(objects: str, reason: str, tensors: list[str]) -> CorruptionError:
    """The one-line error of a load that met a missing or corrupt stored object: which objects, why, the
    first tensors stored in them, and what to run. The read engine (loading/_engine.py) raises it."""
    low = reason.lower()
    kind = "missing" if any(w in low for w in ("missing", "not found", "not_found", "does not exist")) else "corrupt"
    return CorruptionError(f"object {objects} is {kind} ({reason}); affected tensors: {some_names(tensors)}; "
                           f"run `ckptrepo fsck`")


def some_names(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` names, then how many more: what a one-line error or fsck line lists of a damaged
    object's tensors (an object can hold hundreds)."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def os_error_text(err: OSError) -> str:
    """An OS error as words, without Python's ``[Errno N]``: ``Not a directory: 'runs/a'``."""
    where = f": {err.filename!r}" if err.filename is not None else ""
    return f"{err.strerror or type(err).__name__}{where}"


# what to do about an OS error, by its errno: the words the OS gives say what went wrong, not what to do
_OS_ERROR_HINTS = {
    errno.ENOENT: "check the path: it, or a folder on it, does not exist",
    errno.EEXIST: "something is already there; remove it or name a new path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; name another path",
    errno.EISDIR: "it is a folder; name a file",
    errno.EACCES: "you lack the permission; change it, or name a path you may use",
    errno.EPERM: "the system does not permit it; name another path",
    errno.EROFS: "the file system is read-only; write elsewhere",
    errno.ENOSPC: "the disk is full; free space or write elsewhere",
    errno.EFBIG: "the file is too large for the file system; write elsewhere",
    errno.EDQUOT: "the disk quota is used up; free space or write elsewhere",
    errno.ENAMETOOLONG: "a name on the path is too long for the file system; use a shorter one",
    errno.ELOOP: "a symbolic link on the path leads round in a loop; fix the link or name another path",
    errno.EIO: "the device failed; check the disk, or name a path on another one",
}


def os_error_hint(err: OSError) -> str:
    """What to do about ``err``: one clause, for the end of a one-line error."""
    return _OS_ERROR_HINTS.get(err.errno or 0, "check the path and the permissions, or name another path")


def os_error_line(err: OSError) -> str:
    """An OS error in words, then what to do about it: the end of a one-line error."""
    return f"{os_error_text(err)}; {os_error_hint(err)}"


class CheckpointNotFoundError(CkptRepoError, FileNotFoundError):
    """A checkpoint path names nothing loadable: no file and no revision of that name, or a pointer file whose
    version was never committed (a FileNotFoundError too, which frameworks such as Lightning expect)."""


class PointerError(CkptRepoError):
    """A checkpoint pointer file is damaged, or names what its reader may not follow (another repository)."""


class DigestMismatchError(CorruptionError):
    """A piece read whole does not hash to the content digest its manifest records: its stored bytes changed
    after they were written, though every chunk's crc32c may still pass (a crc32c can be restored by design)."""


__all__ = ["ArgumentError", "CheckpointNotFoundError", "CkptRepoError", "ConflictError", "CorruptionError",
           "DetachedHeadError", "DigestMismatchError", "ExchangeError", "FormatVersionError", "LayoutError",
           "MissingDependencyError", "NotARepositoryError", "PointerError", "RefError", "RepositoryExistsError",
           "RetentionError", "RevisionError", "SnapshotFailedError", "StateMismatchError", "StorageError",
           "TrustRequiredError", "UnsupportedValueError", "damaged_object_error", "first_line", "is_storage_failure",
           "os_error_hint", "os_error_line", "os_error_text", "some_names", "storage_failure", "storage_failure_hint",
           "warn"]
