"""Checkpoint *files* backed by versions: what a framework that saves to paths needs from a repository.

Frameworks such as Lightning name each checkpoint by a path, check that it exists, list its directory and
delete it when it falls out of their top-k. ``CheckpointFiles`` keeps those paths true while the data lives
in a repository: each save is one asynchronous snapshot, tagged with the file's name (with as many of its
parent directories as keep it apart from another live checkpoint of that name), and once the version
is committed a small *pointer file* is written at the path (JSON: repository, version id, tag; no tensors).
A pointer is written only after its version is committed, so a crash never leaves a path that names nothing.
Removing a path deletes its pointer and its tag, then prunes the version's data (``repo.prune``) once no tag
or branch tip names it. See docs/decisions/027-lightning-checkpointio.md.

This module imports no framework; ``integrations/lightning.py`` adapts it to Lightning's ``CheckpointIO``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ckptrepo
from ckptrepo.core._refs import is_new_ref_name
from ckptrepo.errors import CkptRepoError, RefError, RevisionError, StorageError, first_line

if TYPE_CHECKING:
    from ckptrepo.repository import Repository
    from ckptrepo.saving._capture import Snapshotter
    from ckptrepo.saving._snapshot_job import SnapshotHandle

log = logging.getLogger("ckptrepo")

POINTER_KIND = "ckptrepo-checkpoint"   # the "kind" of a pointer file: what tells it from a framework's own file
POINTER_MAX_BYTES = 64 * 1024          # a pointer is a few hundred bytes; anything longer is not one
_NOT_IN_TAG = re.compile(r"[^A-Za-z0-9._/=+,-]")


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the repository, the version and the tag the save gave it."""

    repository: str
    version: str
    tag: str | None
    step: int | None

    def to_json(self) -> str:
        return json.dumps({"kind": POINTER_KIND, "format": 1, "repository": self.repository,
                           "version": self.version, "tag": self.tag, "step": self.step}, indent=1) + "\n"


def tag_for(path: str | os.PathLike[str], prefix: str = "") -> str | None:
    """The tag of the checkpoint saved at ``path`` when no other checkpoint holds its name: ``prefix`` + its file
    name, each character a ref name cannot hold (a space, ':') as '_' (``epoch=1-step=20.ckpt`` stays as it is);
    None where even that is no valid ref name."""
    candidates = tag_candidates(path, prefix)
    return candidates[0] if candidates else None


def tag_candidates(path: str | os.PathLike[str], prefix: str = "") -> list[str]:
    """The tags a save at ``path`` may take, shortest first: ``prefix`` + its file name (``tag_for``), then with
    its parent directories added one by one (``best/epoch=0-step=10.ckpt``), so that two directories saving
    one file name can each keep a tag. Empty where the file name makes no valid ref name."""
    text = os.fspath(path)
    text = text.split("://", 1)[1] if "://" in text else text
    parts = [p for p in text.replace(os.sep, "/").split("/") if p not in ("", ".")]
    found: list[str] = []
    for n in range(1, len(parts) + 1):
        name = prefix + "/".join(_NOT_IN_TAG.sub("_", p) for p in parts[-n:])
        if is_new_ref_name(name):
            found.append(name)
        elif n == 1:
            return []
    return found


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _remote_fs(path: str) -> tuple[Any, str]:
    """fsspec's file system for a URL such as ``s3://bucket/ck/last.ckpt`` (Lightning installs fsspec), and the
    path in it."""
    import fsspec  # type: ignore[import-untyped]
    fs, where = fsspec.core.url_to_fs(path)
    return fs, where


def _key(path: str) -> str:
    """One spelling per checkpoint file, for matching a remove with the saves of that path still in flight."""
    return path if _is_remote(path) else os.path.abspath(_local(path))


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``; None when there is no file there, or one that is not a pointer (a framework's
    own checkpoint, which its own loader reads)."""
    path = os.fspath(path)
    try:
        if _is_remote(path):
            fs, where = _remote_fs(path)
            if not fs.isfile(where):
                return None
            with fs.open(where, "rb") as f:
                raw = f.read(POINTER_MAX_BYTES + 1)
        else:
            with open(_local(path), "rb") as f:   # noqa: PTH123 - a path or a file:// URL
                raw = f.read(POINTER_MAX_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as err:
        raise StorageError(f"cannot read checkpoint file {path}: {first_line(err)}") from None
    if len(raw) > POINTER_MAX_BYTES or not raw.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("kind") != POINTER_KIND:
        return None
    if not isinstance(doc.get("repository"), str) or not isinstance(doc.get("version"), str):
        raise CkptRepoError(f"checkpoint file {path} is a damaged ckptrepo pointer (no repository or version); "
                            f"delete it, or load the version by its tag or id")
    step = doc.get("step")
    tag = doc.get("tag")
    return Pointer(doc["repository"], doc["version"], tag if isinstance(tag, str) else None,
                   step if isinstance(step, int) and not isinstance(step, bool) else None)


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write the pointer at ``path``, creating its directory; on a local disk by rename, so a reader sees the
    old pointer or the new one, never half of one."""
    path = os.fspath(path)
    text = pointer.to_json()
    if _is_remote(path):
        fs, where = _remote_fs(path)
        fs.makedirs(os.path.dirname(where), exist_ok=True)
        with fs.open(where, "w") as f:
            f.write(text)
        return
    path = _local(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:   # noqa: PTH123
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def delete_file(path: str | os.PathLike[str]) -> None:
    """Delete the file (or directory: a framework's own sharded checkpoint) at ``path`` if there is one."""
    path = os.fspath(path)
    if _is_remote(path):
        fs, where = _remote_fs(path)
        if fs.exists(where):
            fs.rm(where, recursive=True)
        return
    path = _local(path)
    if os.path.isdir(path):
        import shutil
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def file_exists(path: str | os.PathLike[str]) -> bool:
    path = os.fspath(path)
    if _is_remote(path):
        fs, where = _remote_fs(path)
        return bool(fs.exists(where))
    return os.path.exists(_local(path))


class CheckpointFiles:
    """Checkpoint paths over one repository's versions: ``save`` (asynchronous), ``load``, ``remove``, ``wait``.

    ``url``: the repository (created on the first save if there is none). ``tag_prefix`` goes before every
    tag, to keep runs that share a repository and their file names apart. ``snapshotter_options`` go to
    ``repo.snapshotter()`` (``host_memory``, ``max_in_flight``, ...). The snapshotter runs without dedup: a
    removed checkpoint is pruned at once, and a snapshot in flight that reused its arrays would fail.
    """

    def __init__(self, url: str | os.PathLike[str], tag_prefix: str = "", **snapshotter_options: Any) -> None:
        self.url = _absolute(ckptrepo.repository.repo_url(url))   # a pointer holds it: valid from any directory
        if not isinstance(tag_prefix, str):
            raise ckptrepo.ArgumentError(f"tag_prefix is text (such as 'run7/'), not {tag_prefix!r}")
        self.tag_prefix = tag_prefix
        self._options = {**snapshotter_options, "dedup": False}
        self._repo: Repository | None = None
        self._snap: Snapshotter | None = None
        self._lock = threading.Lock()
        self._prune_lock = threading.Lock()
        self._pending: dict[str, list[threading.Event]] = {}   # path -> its saves whose pointer is not written yet
        self._releasable: list[str] = []   # versions of removed checkpoints, pruned once nothing names them
        self._errors: list[CkptRepoError] = []   # failures on the commit thread, raised by the next call
        self._claims: dict[str, str] = {}   # tag -> the path this process last saved under it (in flight too)

    # ---- the repository and its snapshotter ----------------------------------------------------------------
    @property
    def repo(self) -> Repository:
        if self._repo is None:
            self._repo = ckptrepo.init(self.url, exist_ok=True)
        return self._repo

    @property
    def snapshotter(self) -> Snapshotter:
        if self._snap is None:
            self._snap = self.repo.snapshotter(**self._options)
        return self._snap

    @property
    def current_snapshotter(self) -> Snapshotter | None:
        """The snapshotter saves go through now; None before the first save and after ``close``."""
        return self._snap

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self, state: Any, path: str | os.PathLike[str], step: int | None = None, message: str = "",
             wait_captured: bool = True) -> SnapshotHandle:
        """Start one snapshot of ``state``, tagged after ``path``'s file name (see ``_choose_tag``); the pointer at
        ``path`` is written once it is committed. Returns once the state is captured (``wait_captured``), not
        written."""
        self._raise_failures()
        path = os.fspath(path)
        key = _key(path)
        tag = self._choose_tag(path, key)
        handle = self.snapshotter.snapshot(state, step=step, message=message or f"checkpoint {os.path.basename(path)}",
                                           tag=tag, force_tag=True, meta={"path": path})
        done = threading.Event()
        with self._lock:
            self._pending.setdefault(key, []).append(done)
        handle.add_done_callback(lambda h: self._committed(h, path, tag, done))
        if wait_captured:
            handle.wait_captured()
        return handle

    def _choose_tag(self, path: str, key: str) -> str | None:
        """The tag of a save at ``path``: the shortest of ``tag_candidates`` that no *other* live checkpoint holds.
        A save to the same path moves its tag (``last.ckpt``); a tag another path's pointer still names (a second
        ``ModelCheckpoint`` directory, same file name) stays there, or moving it would leave that checkpoint
        untagged, for gc to prune while its file is still there."""
        candidates = tag_candidates(path, self.tag_prefix)
        if not candidates:
            return None
        tags = self.repo.tags()
        chosen = next((t for t in candidates if not self._held_elsewhere(t, key, tags)), candidates[-1])
        with self._lock:
            self._claims[chosen] = path
        return chosen

    def _held_elsewhere(self, tag: str, key: str, tags: dict[str, str]) -> bool:
        """Whether a checkpoint at another path than ``key`` holds ``tag``: saved by this process and still in
        flight or named by its pointer, or saved earlier (the version's ``meta`` path) and named by its pointer."""
        with self._lock:
            claim = self._claims.get(tag)
            in_flight = claim is not None and _key(claim) in self._pending
        if claim is not None and _key(claim) == key:
            return False
        try:
            if claim is not None and (in_flight or self._names(claim, tag, None)):
                return True
            vid = tags.get(tag)
            if vid is None:
                return False
            other = self.repo.version(vid).meta.get("path")
            return other is not None and _key(other) != key and self._names(other, tag, vid)
        except CkptRepoError as err:   # a pointer or header that cannot be read: leave that tag where it is
            log.debug("ckptrepo: tag %s stays where it is: %s", tag, err)
            return True

    def _names(self, path: str, tag: str, vid: str | None) -> bool:
        """Whether the pointer at ``path`` is one of this repository's under ``tag`` (of version ``vid``)."""
        pointer = read_pointer(path)
        return pointer is not None and pointer.repository == self.url and pointer.tag == tag \
            and (vid is None or pointer.version == vid)

    def _committed(self, handle: SnapshotHandle, path: str, tag: str | None, done: threading.Event) -> None:
        """Commit thread: write the pointer of a committed save, and prune the version it replaces."""
        try:
            version = handle.result()
        except CkptRepoError:   # the snapshotter raises it from the next call; no pointer to a version not there
            self._finish(path, done)
            return
        try:
            old = read_pointer(path)
            write_pointer(path, Pointer(self.repo.url, version.id, tag, version.step))
            if old is not None and old.version != version.id and self._owns(path, old):
                if old.tag != tag:   # the path took a shorter name, freed meanwhile: its old tag goes with its version
                    self._drop_tag(old.tag, old.version)
                self._release(old.version)   # overwritten (last.ckpt): as on disk, the old data goes once unnamed
            self._prune_released()
        except Exception as err:  # noqa: BLE001 - the commit thread must go on; the next call raises it
            failure = StorageError(f"version {version.id[:12]} is committed, but its checkpoint file {path} was not "
                                   f"written: {first_line(err)}; load it by its id")
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)
        finally:
            self._finish(path, done)

    def _finish(self, path: str, done: threading.Event) -> None:
        key = _key(path)
        with self._lock:
            waiting = self._pending.get(key, [])
            if done in waiting:
                waiting.remove(done)
            if not waiting:
                self._pending.pop(key, None)
        done.set()

    # ---- remove ----------------------------------------------------------------------------------------------
    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path``: its pointer and tag at once, its version's data once no tag or
        branch tip names it. A file that is no pointer is deleted as the framework would; so is a link or a copy
        of another checkpoint's pointer (``save_last="link"``), whose version stays with that checkpoint."""
        path = os.fspath(path)
        self._wait_for(path)   # a save of this path still in flight would write its pointer after the delete
        linked = not _is_remote(path) and os.path.islink(_local(path))
        pointer = None if linked else read_pointer(path)
        delete_file(path)
        if pointer is None or not self._owns(path, pointer):
            return
        with self._lock:
            if pointer.tag is not None and self._claims.get(pointer.tag) is not None \
                    and _key(self._claims[pointer.tag]) == _key(path):
                del self._claims[pointer.tag]
        self._drop_tag(pointer.tag, pointer.version)
        self._release(pointer.version)
        self._prune_released()

    def _drop_tag(self, tag: str | None, vid: str) -> None:
        """Delete ``tag`` if it still names ``vid`` (a later save elsewhere may have taken the name since)."""
        if tag is None or self.repo.tags().get(tag) != vid:
            return
        try:
            self.repo.delete_tag(tag)
        except RefError as err:   # deleted meanwhile by someone else: nothing left to do
            log.debug("ckptrepo: tag %s: %s", tag, err)

    def _owns(self, path: str, pointer: Pointer) -> bool:
        """Whether the pointer at ``path`` is the one its save wrote there (not a copy of another checkpoint's)
        into this repository: only then do its tag and data go with the file."""
        mine: list[str | None] = [*tag_candidates(path, self.tag_prefix)] or [None]
        return pointer.repository == self.url and pointer.tag in mine

    def _release(self, vid: str) -> None:
        with self._lock:
            if vid not in self._releasable:
                self._releasable.append(vid)

    def _prune_released(self) -> None:
        """Prune the removed checkpoints' versions that no tag names and that are no branch tip (the newest
        version stays until a later commit moves the branch on)."""
        with self._lock:
            candidates = list(self._releasable)
        if not candidates:
            return
        with self._prune_lock:   # the commit thread's callbacks and the training thread's removes
            self._prune(candidates)

    def _prune(self, candidates: list[str]) -> None:
        repo = self.repo
        named = set(repo.tags().values()) | set(repo.branches().values())
        for vid in candidates:
            if vid in named:
                continue
            try:
                repo.prune(vid)
            except RefError as err:
                log.debug("ckptrepo: version %s stays for now: %s", vid[:12], err)
                continue
            except CkptRepoError as err:   # gone already (gc): nothing left to free
                log.debug("ckptrepo: version %s: %s", vid[:12], err)
            with self._lock:
                if vid in self._releasable:
                    self._releasable.remove(vid)

    # ---- load ------------------------------------------------------------------------------------------------
    def resolve(self, where: str | os.PathLike[str]) -> tuple[Repository, str] | None:
        """The repository and version id ``where`` names: a pointer file, a revision of this repository (``@20``,
        a tag, an id, ``HEAD``), or a checkpoint file name (``best/epoch=0-step=10.ckpt``) whose tag is here; None
        for a file that is not a pointer (the framework's own format). RevisionError when it names nothing."""
        self.wait()   # a checkpoint just saved is loadable at once: its pointer is written when committed
        text = os.fspath(where)
        pointer = read_pointer(text)
        if pointer is not None:
            repo = self.repo if pointer.repository == self.url or (self._repo is not None and
                                                                   pointer.repository == self._repo.url) \
                else ckptrepo.open(pointer.repository)
            return repo, pointer.version
        if file_exists(text):
            return None
        repo = ckptrepo.open(self.url)
        for rev in (text, *reversed(tag_candidates(text, self.tag_prefix))):   # the most specific name first
            if rev is None:
                continue
            try:
                return repo, repo.resolve(rev)
            except RevisionError:
                continue
        raise RevisionError(f"{text} is no checkpoint file, and no revision, tag or file name of {self.url}; "
                            f"pass a checkpoint path, a tag or a revision such as @STEP (see `ckptrepo log`)")

    def load(self, where: str | os.PathLike[str], device: Any = None) -> Any:
        """The state ``where`` names (see ``resolve``); None for a file that is not a pointer."""
        found = self.resolve(where)
        if found is None:
            return None
        repo, vid = found
        return repo.load(vid, device=device)

    # ---- waiting ---------------------------------------------------------------------------------------------
    def _wait_for(self, path: str) -> None:
        with self._lock:
            waiting = list(self._pending.get(_key(path), ()))
        for done in waiting:
            done.wait()

    def wait(self) -> None:
        """Block until every save so far is committed and its pointer written; raise the first failure."""
        if self._snap is not None:
            try:
                self._snap.wait()
            finally:
                with self._lock:
                    waiting = [d for events in self._pending.values() for d in events]
                for done in waiting:
                    done.wait()
        self._prune_released()
        self._raise_failures()

    def close(self) -> None:
        """Wait (see ``wait``) and stop the snapshotter's threads; the next save starts another."""
        try:
            self.wait()
        finally:
            snap, self._snap = self._snap, None
            if snap is not None:
                snap.close()

    def _raise_failures(self) -> None:
        with self._lock:
            if not self._errors:
                return
            first = self._errors[0]
            self._errors.clear()
        raise first


__all__ = ["CheckpointFiles", "Pointer", "read_pointer", "tag_candidates", "tag_for", "write_pointer"]
