"""Opening a remote as a repository, and the history questions push and fetch ask of two repositories."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ckptrepo.core import (
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    VERSIONS_PREFIX,
    Head,
    Plumbing,
    check_not_itself,
    encode_config,
    evicted_remote,
    find_cycle,
    init_head,
    is_version_id,
    refuse_if_same_store,
    remote_url,
)
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import NotARepositoryError, RemoteError, StorageError, first_line
from ckptrepo.storage import open_store, untrusted
from ckptrepo.storage.protocol import Store

REPOSITORY_ID = "id"   # ckptrepo.json: the identity a repository shares with its clones and pushes


class RemotePlumbing(Plumbing):
    """A remote (or a clone's source) opened as a repository: everything is read from its own store only.

    Its ``ckptrepo.json`` and eviction markers are the remote's to write, so whoever controls the remote could
    name any URL there; following it would read (with this user's credentials) from a place the user never
    named. A version whose data the remote evicted to its own remote is refused instead, naming that remote."""

    def data_store(self, manifest: Manifest) -> Store:
        for vid in sorted({key.split("/")[1] for key in manifest.arrays if key.count("/") >= 1} | {manifest.id}):
            there = evicted_remote(self.store, vid)
            if there is not None and any(not self.store.exists(f"{key}/zarr.json") for key in manifest.arrays):
                raise RemoteError(f"{self.url} lacks the data of version {manifest.id[:12]}: it lives on that "
                                  f"repository's own remote {there[:40]!r}, which ckptrepo never follows; fetch "
                                  f"or clone the repository that holds it, or pass --lazy")
        return self.store

    def remote_store(self, name: str) -> Store:
        raise RemoteError(f"{self.url} names a remote of its own ({name[:40]!r}), which ckptrepo never follows; "
                          f"fetch or clone the repository that holds its data instead")


def open_remote(local: Plumbing, name: str, create_with_branch: str | None = None) -> Plumbing:
    """Remote ``name`` of ``local`` as a repository handle.

    An empty location is made a repository when ``create_with_branch`` is given (a first push, as to a bare
    repository), its HEAD on that branch. A location holding other objects, or another repository (its
    ``id`` differs and it has versions), is refused: a push would mix two histories. So is this repository
    itself under another name (core/_same_store.py): a push would find it up to date.
    """
    url = remote_url(local.store, name)
    with remote_errors(f"remote {name!r} ({url})", f"fix the URL with `ckptrepo remote remove {name}`, then "
                                                    f"`ckptrepo remote add {name} URL`"):
        return _open_remote(local, name, url, create_with_branch)


def _open_remote(local: Plumbing, name: str, url: str, create_with_branch: str | None) -> Plumbing:
    check_not_itself(local.store.url, name, url)   # a config edited by hand: before anything is created there
    store = local.remote_store(name)
    if store.get(CONFIG_KEY, CONFIG_MAX_BYTES) is None:
        held = store.list("")   # also what says that a bucket does not exist: a read of one absent key does not
        if create_with_branch is None:
            raise NotARepositoryError(f"remote {name!r} ({url}) holds no ckptrepo repository; push to it first, or "
                                      f"fix its URL with `ckptrepo remote remove {name}` and `remote add`")
        if held:
            raise RemoteError(f"remote {name!r} ({url}) holds objects but no ckptrepo repository; point it at an "
                              f"empty prefix (`ckptrepo remote remove {name}`, then `remote add` with another URL)")
        settings = {"created": time.time(), "default_branch": create_with_branch}
        if local.config.get(REPOSITORY_ID):
            settings[REPOSITORY_ID] = local.config[REPOSITORY_ID]
        if not store.put_if_absent(CONFIG_KEY, encode_config(settings)) and store.get(CONFIG_KEY) is None:
            raise StorageError(f"could not create a repository at remote {name!r} ({url}); check that the bucket "
                               f"exists and is writable")
        init_head(store, create_with_branch)
    remote = RemotePlumbing(store)
    mine, theirs = local.config.get(REPOSITORY_ID), remote.config.get(REPOSITORY_ID)
    if mine == theirs:   # this repository, a clone or a push of it: only a probe tells the store itself apart
        refuse_if_same_store(local.store, store, name)
    if mine and theirs and mine != theirs and remote.all_version_ids():
        raise RemoteError(f"remote {name!r} ({url}) holds another repository (id {str(theirs)[:12]}, this one is "
                          f"{str(mine)[:12]}); check the URL, or clone it into a directory of its own")
    return remote


def open_source(url: str) -> Plumbing:
    """The repository at ``url`` that a clone copies, with one-line errors that name it and say what to check."""
    with remote_errors(f"cannot clone {url}", "check the URL"):
        store = untrusted(open_store(url))
        if store.get(CONFIG_KEY, CONFIG_MAX_BYTES) is None:
            store.list("")   # a bucket that does not exist says so here
            raise NotARepositoryError(f"cannot clone {url}: there is no ckptrepo repository there; check the URL")
        return RemotePlumbing(store)


@contextmanager
def remote_errors(label: str, fix: str) -> Iterator[None]:
    """Storage errors met while talking to a remote, named by ``label`` (``remote 'origin' (s3://b/r)``), with
    what to do where the cause says it: a bucket that does not exist, credentials the store refuses. An
    unreachable endpoint's error already says what to check (errors.storage_failure_hint)."""
    try:
        yield
    except StorageError as err:
        raise StorageError(remote_failure(label, first_line(err), fix)) from err


_DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "http_response_code='403'", "http_response_code='401'")


def remote_failure(label: str, reason: str, fix: str) -> str:
    """The one-line message of a remote's storage error ``reason`` (see ``remote_errors``)."""
    if "NoSuchBucket" in reason or "bucket does not exist" in reason:
        return f"{label}: the bucket does not exist ({reason}); create it, or {fix}"
    if any(code in reason for code in _DENIED):
        return (f"{label}: access denied ({reason}); check the credentials: AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://")
    return f"{label}: {reason}"


def version_ids(plumbing: Plumbing) -> set[str]:
    """Every version manifest the repository holds (one listing)."""
    return {k[len(VERSIONS_PREFIX):] for k in plumbing.store.list(VERSIONS_PREFIX)
            if is_version_id(k[len(VERSIONS_PREFIX):])}


def missing_ancestors(parents_of: Callable[[str], Iterable[str]], tips: Iterable[str], present: set[str],
                      known: set[str]) -> list[str]:
    """The versions reachable from ``tips`` (themselves included) that are not ``present``, parents first, so
    that a copy in this order never holds a version without its parents. A parent outside ``known`` (the source
    holds no manifest of it) ends the walk there."""
    out: list[str] = []
    seen: set[str] = set()
    for tip in tips:
        stack: list[tuple[str, bool]] = [(tip, False)]
        while stack:
            vid, expanded = stack.pop()
            if expanded:
                out.append(vid)
                continue
            if vid in seen or vid in present or vid not in known:
                continue
            seen.add(vid)
            stack.append((vid, True))
            stack.extend((p, False) for p in parents_of(vid))
    return out


def is_ancestor(plumbing: Plumbing, ancestor: str, tip: str, known: set[str]) -> bool:
    """Whether ``ancestor`` is ``tip`` or reachable from it through parents (versions outside ``known`` end the
    walk): what makes moving a ref from one to the other a fast-forward."""
    stack, seen = [tip], set()
    while stack:
        vid = stack.pop()
        if vid == ancestor:
            return True
        if vid in seen or vid not in known:
            continue
        seen.add(vid)
        stack.extend(plumbing.header(vid).parents)
    return False


@dataclass
class RemoteHistory:
    """A remote's refs and version listing, as push and fetch read them once."""

    branches: dict[str, str]
    tags: dict[str, str]
    head: Head
    known: set[str]
    parents: dict[str, tuple[str, ...]]   # of each version the check walked (those not here yet)

    def parents_of(self, there: Plumbing, vid: str) -> tuple[str, ...]:
        """``vid``'s parents: as the check walked them, without reading its header again, or from ``there``."""
        walked = self.parents.get(vid)
        return walked if walked is not None else tuple(there.header(vid).parents)

    @property
    def tips(self) -> list[str]:
        """Every version a fetch starts from: branches, tags, and a detached HEAD (as git fetches its commit)."""
        detached = [self.head.version] if self.head.branch is None and self.head.version else []
        return [*self.branches.values(), *self.tags.values(), *detached]


def sound_history(there: Plumbing, label: str, present: set[str] | frozenset[str] = frozenset()) -> RemoteHistory:
    """The refs and versions of ``there`` (named ``label`` in errors), refused in one line unless a copy of them
    would be a sound repository: every ref names a version it holds, no ref name is a folder of another
    (``a`` and ``a/b``), and every version's parents are held and lead back to roots without a cycle. The walk
    stops at the versions ``present`` here (fetched, and checked, before): a fetch reads only new headers.

    A clone or fetch of a damaged remote is refused whole, before anything is copied, rather than cloned in
    part: what is missing there is missing for good, and a partial copy would pass fsck here while its refs
    fail every command (docs/decisions/040-hostile-remotes.md)."""
    branches, tags, head = there.refs.branches(), there.refs.tags(), there.refs.head()
    known = version_ids(there)
    refs = [(f"branch {b!r}", vid) for b, vid in branches.items()] + [(f"tag {t!r}", vid) for t, vid in tags.items()]
    if head.branch is None and head.version:
        refs.append(("detached HEAD", head.version))

    def refuse(problem: str) -> RemoteError:
        return RemoteError(f"{label} is damaged: {problem}; nothing was copied: repair it there first "
                           f"(`ckptrepo --repo {there.url} fsck`)")

    for what, vid in refs:
        if vid not in known:
            raise refuse(f"its {what} names version {vid[:12]}, which it does not hold")
    for kind, names in (("branch", branches), ("tag", tags)):
        for name in names:
            inner = next((o for o in names if o.startswith(name + "/")), None)
            if inner is not None:
                raise refuse(f"its {kind}es {name!r} and {inner!r} cannot both be refs (one would be a folder)")
    parents = _check_ancestry(there, [vid for _, vid in refs], known, set(present), refuse)
    return RemoteHistory(branches, tags, head, known, parents)


def _check_ancestry(there: Plumbing, tips: list[str], known: set[str], done: set[str],
                    refuse: Callable[[str], RemoteError]) -> dict[str, tuple[str, ...]]:
    """Walk back from ``tips`` (each version once, none of ``done``): a parent ``there`` does not hold, or a
    parent cycle among the versions walked, is refused. Returns the parents of the versions walked."""
    parents: dict[str, tuple[str, ...]] = {}
    stack = list(tips)
    while stack:
        vid = stack.pop()
        if vid in done or vid in parents:
            continue
        parents[vid] = tuple(there.header(vid).parents)
        for parent in parents[vid]:
            if parent not in known:
                raise refuse(f"version {vid[:12]} names parent {parent[:12]}, which it does not hold")
        stack.extend(parents[vid])
    cycle = find_cycle(parents)
    if cycle is not None:
        raise refuse(f"version {cycle[0][:12]} is its own ancestor (its parents form a cycle)")
    done.update(parents)
    return parents
