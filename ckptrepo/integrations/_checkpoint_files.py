"""Checkpoint *files* backed by versions: what a framework that saves to paths needs from a repository.

Frameworks such as Lightning name each checkpoint by a path, check that it exists, list its directory and
delete it when it falls out of their top-k. ``CheckpointFiles`` keeps those paths true while the data lives
in a repository: each save is one asynchronous snapshot, tagged with the file's name (with as many of its
parent directories as keep it apart from another live checkpoint of that name), and once the version
a small *pointer file* is written at the path before ``save`` returns (JSON: repository, version id, tag, the
path's previous version; no tensors; ``_pointer_files.py``), so the path exists at once, as a framework's own
file would. The version may still be in flight then: a load in this process waits for it, and after a crash
a pointer whose version was never committed loads the path's previous version, or says it was never
committed. The commit makes the pointer durable with its version; a failed save puts the previous pointer back.
A pointer is followed only into this repository. Removing a path deletes its pointer and its tag, then prunes
the version's data (``repo.prune``) once no tag or branch tip names it, and only a version saved for that
path. See docs/decisions/027-lightning-checkpointio.md.

This module imports no framework; ``integrations/lightning.py`` adapts it to Lightning's ``CheckpointIO``.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from itertools import islice
from typing import TYPE_CHECKING, Any

import ckptrepo
from ckptrepo.core import LANDED_WALK, VERSIONS_PREFIX, first_parent_chain, is_new_ref_name
from ckptrepo.errors import (
    CheckpointNotFoundError,
    CkptRepoError,
    NotARepositoryError,
    PointerError,
    RefError,
    RevisionError,
    StorageError,
    first_line,
)
from ckptrepo.integrations._pointer_files import (
    Pointer,
    delete_file,
    file_exists,
    is_remote,
    local,
    path_key,
    read_pointer,
    sync_pointer,
    write_pointer,
)

if TYPE_CHECKING:
    from ckptrepo.core.schema import ManifestHeader
    from ckptrepo.repository import Repository
    from ckptrepo.saving import SnapshotHandle, Snapshotter

log = logging.getLogger("ckptrepo")

_NOT_IN_TAG = re.compile(r"[^A-Za-z0-9._/=+,-]")


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


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def _header(repo: Repository, vid: str) -> ManifestHeader | None:
    """The header of version ``vid`` of ``repo``; None when its manifest is not there (a save still in flight, or
    one a crash stopped before its manifest)."""
    if not repo.plumbing.store.exists(VERSIONS_PREFIX + vid):
        return None
    return repo.plumbing.header(vid)


def _tag_target(repo: Repository, tag: str) -> str | None:
    """The version tag ``tag`` names; None when there is none or its ref cannot be read (the full check that
    follows reads every tag and says why)."""
    try:
        return repo.plumbing.tag_target(tag)
    except CkptRepoError:
        return None


def _is_committed(repo: Repository, vid: str, tag: str | None = None) -> bool:
    """Whether version ``vid`` is committed: its manifest is there and a tag, or a branch's recent history, holds
    it (a crash between the manifest and the branch's move leaves a manifest no history holds, which gc collects).
    ``tag``: the checkpoint's own tag, which holds it in the usual case, asked first (one ref read, where the
    other tags and the branches' histories are many)."""
    if _header(repo, vid) is None:
        return False
    if tag is not None and _tag_target(repo, tag) == vid:
        return True
    tips = set(repo.branches().values())
    if vid in tips or vid in set(repo.tags().values()):
        return True
    # as far back as the committer looks for a version that landed
    return any(vid in islice(first_parent_chain(tip, repo.plumbing.first_parent), LANDED_WALK) for tip in tips)


class CheckpointFiles:
    """Checkpoint paths over one repository's versions: ``save`` (asynchronous), ``load``, ``remove``, ``wait``.

    ``url``: the repository (created on the first save if there is none). ``tag_prefix`` goes before every
    tag, to keep runs that share a repository and their file names apart. ``snapshotter_options`` go to
    ``repo.snapshotter()`` (``host_memory``, ``max_in_flight``, ...). The snapshotter runs without dedup: a
    removed checkpoint is pruned at once, and a snapshot in flight that reused its arrays would fail.
    It pickles as its settings (a process launcher hands it to new processes): saves in flight stay here.
    """

    def __init__(self, url: str | os.PathLike[str], tag_prefix: str = "", **snapshotter_options: Any) -> None:
        self.url = _absolute(ckptrepo.repository.repo_url(url))   # a pointer holds it: valid from any directory
        if not isinstance(tag_prefix, str):
            raise ckptrepo.ArgumentError(f"tag_prefix is text (such as 'run7/'), not {tag_prefix!r}")
        self.tag_prefix = tag_prefix
        self._options = {**snapshotter_options, "dedup": False}
        self._start()

    def _start(self) -> None:
        self._repo: Repository | None = None
        self._snap: Snapshotter | None = None
        self._lock = threading.Lock()
        self._prune_lock = threading.Lock()
        self._pending: dict[str, list[threading.Event]] = {}   # path -> its saves whose commit has not finished
        self._releasable: list[str] = []   # versions of removed checkpoints, pruned once nothing names them
        self._errors: list[CkptRepoError] = []   # failures on the commit thread, raised by the next call
        self._claims: dict[str, str] = {}   # tag -> the path this process last saved under it (in flight too)
        # a save in flight -> the committed pointer its path held before (put back if it fails, released when it
        # commits), and -> the later save of the same path that replaced its pointer while it was in flight
        self._priors: dict[str, Pointer | None] = {}
        self._successors: dict[str, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "tag_prefix": self.tag_prefix, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.tag_prefix, self._options = state["url"], state["tag_prefix"], state["options"]
        self._start()

    # ---- the repository and its snapshotter ----------------------------------------------------------------
    @property
    def repo(self) -> Repository:
        if self._repo is None:
            self._repo = ckptrepo.init(self.url, exist_ok=True)
        return self._repo

    def _existing_repo(self) -> Repository:
        """The repository, for a read: CheckpointNotFoundError when there is none yet (nothing saved)."""
        if self._repo is not None:
            return self._repo
        try:
            return ckptrepo.open(self.url)
        except NotARepositoryError:
            raise CheckpointNotFoundError(f"no checkpoint has been saved into {self.url} yet (no repository there); "
                                          f"pass the path of a checkpoint that exists") from None

    @property
    def snapshotter(self) -> Snapshotter:
        if self._snap is None:
            self._snap = self.repo.snapshotter(**self._options)
        return self._snap

    @property
    def current_snapshotter(self) -> Snapshotter | None:
        """The snapshotter saves go through now; None before the first save and after ``close``."""
        return self._snap

    def _ours(self, pointer: Pointer) -> bool:
        return pointer.repository == self.url or (self._repo is not None and pointer.repository == self._repo.url)

    def names_ours(self, pointer: Pointer) -> bool:
        """Whether ``pointer`` names a version of this repository saved under this ``tag_prefix``."""
        return self._ours(pointer) and (pointer.tag or "").startswith(self.tag_prefix)

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self, state: Any, path: str | os.PathLike[str], step: int | None = None, message: str = "",
             wait_captured: bool = True) -> SnapshotHandle:
        """Start one snapshot of ``state``, tagged after ``path``'s file name (see ``_choose_tag``), and write the
        pointer at ``path`` naming it. Returns once the state is captured (``wait_captured``), not written; the
        commit makes the pointer durable with the version."""
        self._raise_failures()
        path = os.fspath(path)
        key = path_key(path)
        tag = self._choose_tag(path, key)
        prior, replaces = self._prior(path)
        handle = self.snapshotter.snapshot(state, step=step, message=message or f"checkpoint {os.path.basename(path)}",
                                           tag=tag, force_tag=True, meta={"path": key})
        pointer = Pointer(self.repo.url, handle.id, tag, step, prior.version if prior is not None else None)
        done = threading.Event()
        with self._lock:
            self._pending.setdefault(key, []).append(done)
            self._priors[handle.id] = prior
            if replaces is not None:
                self._successors[replaces] = handle.id
        try:
            write_pointer(path, pointer, sync=False)
        except Exception as err:   # an OSError, or a remote file system's own error
            with self._lock:   # the save in flight keeps the path: its pointer is still the one there
                if replaces is not None and self._successors.get(replaces) == handle.id:
                    del self._successors[replaces]
            handle.add_done_callback(lambda h: self._finish(path, done, h.id))
            raise StorageError(f"cannot write checkpoint file {path}: {first_line(err)}; its version "
                               f"{handle.id[:12]} is saved all the same (tag {tag}): load it by its id") from None
        finally:
            if wait_captured:
                handle.wait_captured()
        # after the pointer is written: a save that failed at once must find it there to put the prior back
        handle.add_done_callback(lambda h: self._committed(h, path, pointer, done))
        return handle

    def _prior(self, path: str) -> tuple[Pointer | None, str | None]:
        """The committed pointer of this repository ``path`` holds (what a failed save there puts back), and the
        save in flight whose pointer is there (None if none): a save of the same path while another is in
        flight takes that one's prior until it commits."""
        old = self._current(path)   # a damaged pointer is overwritten, never followed
        if old is None or not self._owns(path, old):
            return None, None
        with self._lock:
            if old.version in self._priors:
                return self._priors[old.version], old.version
        if _is_committed(self.repo, old.version, old.tag):
            return (old, None) if self._saved_for(old.version, path) else (None, None)
        # a save a crash stopped before its commit: the path held its previous version
        if old.previous is not None and _is_committed(self.repo, old.previous, old.tag) \
                and self._saved_for(old.previous, path):
            return Pointer(old.repository, old.previous, old.tag, None), None
        return None, None

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
            in_flight = claim is not None and path_key(claim) in self._pending
        if claim is not None and path_key(claim) == key:
            return False
        try:
            if claim is not None and (in_flight or self._names(claim, tag, None)):
                return True
            vid = tags.get(tag)
            if vid is None:
                return False
            other = self.repo.version(vid).meta.get("path")
            return other is not None and path_key(other) != key and self._names(other, tag, vid)
        except CkptRepoError as err:   # a pointer or header that cannot be read: leave that tag where it is
            log.debug("ckptrepo: tag %s stays where it is: %s", tag, err)
            return True

    def _names(self, path: str, tag: str, vid: str | None) -> bool:
        """Whether the pointer at ``path`` is one of this repository's under ``tag`` (of version ``vid``)."""
        pointer = read_pointer(path)
        return pointer is not None and self._ours(pointer) and pointer.tag == tag \
            and (vid is None or pointer.version == vid)

    def _committed(self, handle: SnapshotHandle, path: str, pointer: Pointer, done: threading.Event) -> None:
        """Commit thread: make a committed save's pointer durable and release the version it replaced; put the
        prior pointer back for a failed one."""
        vid = pointer.version
        with self._lock:
            prior = self._priors.pop(vid, None)
            successor = self._successors.pop(vid, None)
        try:
            try:
                handle.result()
                ok = True
            except CkptRepoError:   # the snapshotter raises it from the next call
                ok = False
            with self._lock:
                if successor is not None and successor in self._priors:   # it replaced this pointer meanwhile
                    self._priors[successor] = pointer if ok else prior
            if not ok:
                if successor is None and self._current(path) == pointer:
                    if prior is not None:
                        write_pointer(path, prior)
                    else:
                        delete_file(path)
                return
            if successor is None and self._current(path) == pointer:
                sync_pointer(path)
            if prior is not None and prior.version != vid and self._saved_for(prior.version, path):
                if prior.tag != pointer.tag:   # the path took a shorter name, freed meanwhile: its old tag goes too
                    self._drop_tag(prior.tag, prior.version)
                self._release(prior.version)   # overwritten (last.ckpt): as on disk, the old data goes once unnamed
            self._prune_released()
        except Exception as err:  # noqa: BLE001 - the commit thread must go on; the next call raises it
            failure = StorageError(f"snapshot {vid[:12]} of checkpoint file {path}: the file could not be "
                                   f"{'made durable' if handle.done() else 'put back'}: {first_line(err)}; "
                                   f"load the version by its id")
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)
        finally:
            self._finish(path, done, vid)

    def _current(self, path: str) -> Pointer | None:
        try:
            return read_pointer(path)
        except PointerError:
            return None

    def _saved_for(self, vid: str, path: str) -> bool:
        """Whether version ``vid`` of this repository was saved for the checkpoint at ``path`` (its header's
        ``meta`` path): only such a version may be pruned when that path is overwritten or removed."""
        try:
            header = _header(self.repo, vid)
        except CkptRepoError as err:
            log.debug("ckptrepo: version %s stays: %s", vid[:12], err)
            return False
        saved = (header.meta or {}).get("path") if header is not None else None
        return isinstance(saved, str) and path_key(saved) == path_key(path)

    def _finish(self, path: str, done: threading.Event, vid: str | None = None) -> None:
        key = path_key(path)
        with self._lock:
            if vid is not None:
                self._priors.pop(vid, None)
                self._successors.pop(vid, None)
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
        of another checkpoint's pointer (``save_last="link"``), and a pointer into another repository or to a
        version not saved for this path: only a version saved for this path is ever pruned."""
        path = os.fspath(path)
        self._wait_for(path)   # a save of this path still in flight: its outcome first
        linked = not is_remote(path) and os.path.islink(local(path))
        pointer = None if linked else self._current(path)
        delete_file(path)
        if pointer is None or not self._owns(path, pointer):
            return
        with self._lock:
            if pointer.tag is not None and self._claims.get(pointer.tag) is not None \
                    and path_key(self._claims[pointer.tag]) == path_key(path):
                del self._claims[pointer.tag]
        versions = [pointer.version]
        if pointer.previous is not None and not _is_committed(self.repo, pointer.version, pointer.tag):
            versions.append(pointer.previous)   # its save never committed: the path held the previous version
        for vid in versions:
            if self._saved_for(vid, path):
                self._drop_tag(pointer.tag, vid)
                self._release(vid)
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
        """Whether the pointer at ``path`` is one its save wrote there (not a copy of another checkpoint's) into
        this repository: only then may its tag and data go with the file."""
        mine: list[str | None] = [*tag_candidates(path, self.tag_prefix)] or [None]
        return self._ours(pointer) and pointer.tag in mine

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
        """The repository and version id ``where`` names: a pointer file into this repository, a revision of it
        (``@20``, a tag, an id, ``HEAD``), or a checkpoint file name (``best/epoch=0-step=10.ckpt``) whose tag is
        there; None for a file that is not a pointer (the framework's own format). CheckpointNotFoundError when
        it names nothing, PointerError for a pointer into another repository."""
        self.wait()   # a checkpoint just saved is loadable at once
        text = os.fspath(where)
        pointer = read_pointer(text)
        if pointer is not None:
            if not self._ours(pointer):
                raise PointerError(f"checkpoint file {text} names the repository {pointer.repository[:200]!r}, not "
                                   f"this one ({self.url}); a pointer is followed only into its plugin's own "
                                   f"repository: open that one to load it")
            repo = self._existing_repo()
            return repo, self._committed_version(repo, text, pointer)
        if file_exists(text):
            return None
        repo = self._existing_repo()
        for rev in (text, *reversed(tag_candidates(text, self.tag_prefix))):   # the most specific name first
            try:
                return repo, repo.resolve(rev)
            except RevisionError:
                continue
        raise CheckpointNotFoundError(f"{text} is no checkpoint file, and no revision, tag or file name of "
                                      f"{self.url}; pass a checkpoint path, a tag or a revision such as @STEP "
                                      f"(see `ckptrepo log`)")

    @staticmethod
    def _committed_version(repo: Repository, text: str, pointer: Pointer) -> str:
        """The version the pointer at ``text`` stands for: its own once committed; if a crash stopped its save
        first, the version the path held before (as a file a crash interrupted keeps its old content)."""
        if _is_committed(repo, pointer.version, pointer.tag):
            return pointer.version
        if pointer.previous is not None and _is_committed(repo, pointer.previous, pointer.tag):
            log.warning("ckptrepo: %s: version %s was never committed (its save stopped first); loading the one "
                        "it was to replace, %s", text, pointer.version[:12], pointer.previous[:12])
            return pointer.previous
        raise CheckpointNotFoundError(f"{text} names version {pointer.version[:12]}, which was never committed (the "
                                      f"process saving it stopped first, or is saving it still); resume from "
                                      f"another checkpoint (see `ckptrepo log`)")

    def load(self, where: str | os.PathLike[str], device: Any = None) -> Any:
        """The state ``where`` names (see ``resolve``); None for a file that is not a pointer."""
        found = self.resolve(where)
        if found is None:
            return None
        repo, vid = found
        return repo.load(vid, device=device)

    # ---- waiting ---------------------------------------------------------------------------------------------
    def in_flight(self, path: str | os.PathLike[str]) -> bool:
        """Whether a save of ``path`` has not finished its commit yet."""
        with self._lock:
            return path_key(os.fspath(path)) in self._pending

    def _wait_for(self, path: str) -> None:
        with self._lock:
            waiting = list(self._pending.get(path_key(path), ()))
        for done in waiting:
            done.wait()

    def wait(self) -> None:
        """Block until every save so far is committed and its pointer durable; raise the first failure."""
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
