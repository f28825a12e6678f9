"""What a repository knows of its remotes: their URLs, where their branches were, and which versions' data
lives only on one of them.

A remote is another repository (usually on an object store) that versions are pushed to and fetched from, as
in git. Three kinds of record hold what this repository knows of them:

* ``ckptrepo.json``'s ``remotes`` setting: name -> ``{"url": ...}`` (changed by compare-and-swap, like git's
  config);
* remote-tracking refs, ``refs/remotes/<remote>/<branch>``: the version a remote branch was at when last
  pushed or fetched. Every ancestor of one is on that remote, which is what makes a version remote-durable;
* eviction markers, ``evicted/<id>``: this version's own data (``data/<id>/``) may be partly or wholly absent
  here, and is read from the remote the marker names. Local retention after a push and lazy clones write
  them, and so does a node-local tier for each version (``spread``: the other nodes' arrays are on their
  disks until pushed); the marker goes first, the deletes after, so a crash between them leaves data that is merely
  duplicated;
* push failure records, ``failures/push-<remote>/<branch>``: the last background push of that branch to that
  remote failed (a snapshotter's ``push_to``), so its newest versions are committed here but not there yet.
  ``log --all`` and fsck list them beside the failed snapshots; the next push of the branch that succeeds,
  by hand or in the background, removes the record.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Sequence

from ckptrepo.core._manifest import (
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    FAILURES_PREFIX,
    REF_MAX_BYTES,
    decode_config,
    new_version_id,
    read_config,
    seal,
    update_config,
    version_id_time,
)
from ckptrepo.core._refs import check_ref_name, ref_value
from ckptrepo.core._same_store import check_not_itself
from ckptrepo.core.schema import ManifestHeader
from ckptrepo.errors import ArgumentError, CorruptionError, RefError
from ckptrepo.storage.protocol import Store

REMOTE_REFS_PREFIX = "refs/remotes/"
PUSHES_PREFIX = "pushes/"   # on a remote: a push in progress and the versions it copies (see push_lease)
EVICTED_PREFIX = "evicted/"
REMOTES_SETTING = "remotes"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def check_remote_name(name: Any) -> str:
    """A remote's name: one ref-name part (no ``/``), as ``git remote add`` takes."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith((".", ".lock")):
        raise ArgumentError(f"{name!r} is not a remote name; use letters, digits, '.', '_' and '-', "
                            f"e.g. origin")
    return name


# The longest remote URL taken: a path as long as Linux allows, or an object store key prefix many times over;
# the URLs of a repository's remotes live in its config, which readers refuse past CONFIG_MAX_BYTES.
MAX_REMOTE_URL_CHARS = 4096


def check_remote_url(url: str) -> str:
    """A remote's URL as ``remote add`` takes it: text no longer than ``MAX_REMOTE_URL_CHARS``."""
    if not isinstance(url, str) or not url or len(url) > MAX_REMOTE_URL_CHARS or "\0" in url:
        shown = f"{len(url)} characters" if isinstance(url, str) and url else repr(url)[:40]
        raise ArgumentError(f"a remote URL must be 1 to {MAX_REMOTE_URL_CHARS} characters without NUL, not "
                            f"{shown}; check the URL")
    return url


def remotes(store: Store) -> dict[str, str]:
    """Remote name -> URL, as ``ckptrepo.json`` records them."""
    raw = read_config(store)
    cfg = decode_config(raw, store.url) if raw is not None else {}
    found = cfg.get(REMOTES_SETTING) or {}
    if not isinstance(found, dict):
        raise CorruptionError(f"{store.url}: {CONFIG_KEY}'s {REMOTES_SETTING!r} is not a map; fix it by hand or "
                              f"remove it and add the remotes again")
    return {str(k): str(v.get("url")) for k, v in found.items() if isinstance(v, dict) and v.get("url")}


def remote_url(store: Store, name: str) -> str:
    """The URL of remote ``name``; a one-line error naming the remotes there are when it is not one of them."""
    found = remotes(store)
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise RefError(f"no remote named {name!r} (remotes: {known}); add one with `ckptrepo remote add {name} URL`")
    return found[name]


def add_remote(store: Store, name: str, url: str) -> None:
    """Record remote ``name`` at ``url``; refuses a name already taken, as git does, and a URL that names this
    repository's own store (core/_same_store.py)."""
    check_remote_name(name)
    check_remote_url(url)
    check_not_itself(store.url, name, url)
    found = remotes(store)
    if name in found:
        raise RefError(f"remote {name!r} exists (at {found[name]}); remove it first with "
                       f"`ckptrepo remote remove {name}`")
    _write_remotes(store, {**found, name: url})


def remove_remote(store: Store, name: str) -> None:
    """Forget remote ``name`` and its remote-tracking refs. Versions whose data lives only there keep their
    markers: loading them then says which remote to add back."""
    found = remotes(store)
    remote_url(store, name)
    del found[name]
    _write_remotes(store, found)
    store.delete_prefix(f"{REMOTE_REFS_PREFIX}{name}/")


def _write_remotes(store: Store, found: dict[str, str]) -> None:
    update_config(store, {REMOTES_SETTING: {k: {"url": v} for k, v in sorted(found.items())}})


def tracking_key(remote: str, branch: str) -> str:
    return f"{REMOTE_REFS_PREFIX}{remote}/{branch}"


def tracking_refs(store: Store, remote: str | None = None) -> dict[str, str]:
    """``remote/branch`` -> version, for one remote or all; a damaged tracking ref is skipped (fetch rewrites it)."""
    prefix = REMOTE_REFS_PREFIX + (f"{remote}/" if remote else "")
    out = {}
    for key in store.list(prefix):
        try:
            vid = ref_value(store.get(key), key)
        except CorruptionError:
            continue
        if vid is not None:
            out[key[len(REMOTE_REFS_PREFIX):]] = vid
    return out


def tracking_tip(store: Store, name: str) -> str | None:
    """The version remote-tracking ref ``REMOTE/BRANCH`` records, or None."""
    key = REMOTE_REFS_PREFIX + name
    return ref_value(store.get(key, REF_MAX_BYTES), key)


def set_tracking_ref(store: Store, remote: str, branch: str, vid: str) -> None:
    """Record that ``remote``'s ``branch`` is at ``vid`` (a plain write: only this repository keeps it)."""
    check_ref_name(branch, "branch")
    store.put(tracking_key(remote, branch), vid.encode())


def evicted_marker(store: Store, vid: str) -> tuple[str, bool] | None:
    """Version ``vid``'s eviction marker: (the remote holding its data where it is absent here, whether it is a
    node-local tier's version, spread over the nodes until pushed); None without one."""
    raw = store.get(EVICTED_PREFIX + vid, CONFIG_MAX_BYTES)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        remote, spread = d.get("remote"), d.get("spread", False)
    except (ValueError, AttributeError):
        remote, spread = None, False
    if not isinstance(remote, str) or not isinstance(spread, bool):
        raise CorruptionError(f"{EVICTED_PREFIX}{vid} is damaged (no remote named); it should read "
                              f'{{"remote": "origin"}} with the remote that holds the data of version {vid[:12]}')
    return remote, spread


def evicted_remote(store: Store, vid: str) -> str | None:
    """The remote holding version ``vid``'s data when its marker says it may be absent here; None otherwise."""
    marker = evicted_marker(store, vid)
    return None if marker is None else marker[0]


def evicted_ids(store: Store) -> set[str]:
    """Every version with an eviction marker (one listing)."""
    return {k[len(EVICTED_PREFIX):] for k in store.list(EVICTED_PREFIX)}


def mark_evicted(store: Store, vid: str, remote: str, spread: bool = False) -> None:
    """Say that version ``vid``'s data is read from ``remote`` where it is absent here (before deleting any).
    ``spread``: a node-local tier's version, whose other nodes' arrays reach the remote when pushed: until
    then it is not on the remote, and that is no damage."""
    store.put(EVICTED_PREFIX + vid, json.dumps({"remote": remote, **({"spread": True} if spread else {})}).encode())


def remote_holders(store: Store, shown: Sequence[ManifestHeader],
                   header: Callable[[str], ManifestHeader]) -> dict[str, tuple[str, ...]]:
    """Version id -> the remotes holding it (those a remote-tracking ref of reaches), for the versions ``shown``.

    Each remote's walk starts at its tracking refs' tips and goes back only while versions are no older than the
    oldest one shown: a parent is never newer than its child (the order ``log`` lists by), so nothing past that
    point can be shown. ``log -n 10`` thus reads about the headers it lists, however long the history.
    """
    if not shown:
        return {}
    tips: dict[str, list[str]] = {}
    for name, vid in tracking_refs(store).items():
        tips.setdefault(name.split("/", 1)[0], []).append(vid)
    wanted = {h.id for h in shown}
    oldest = min(h.time for h in shown)
    held: dict[str, list[str]] = {}
    for remote in sorted(tips):
        stack, seen, found = list(tips[remote]), set(), 0
        while stack and found < len(wanted):
            vid = stack.pop()
            if vid in seen:
                continue
            seen.add(vid)
            try:
                h = header(vid)
            except CorruptionError:   # a tracking ref or parent naming a missing version: fsck names it
                continue
            if h.time < oldest:
                continue
            if vid in wanted:
                held.setdefault(vid, []).append(remote)
                found += 1
            stack.extend(h.parents)
    return {vid: tuple(names) for vid, names in held.items()}


def push_failure_key(remote: str, branch: str) -> str:
    """Where the failure of the last push of ``branch`` to ``remote`` is recorded (see the module docstring):
    among the failed snapshots' records, under a name no version id takes, which gc leaves alone."""
    return f"{FAILURES_PREFIX}push-{remote}/{branch}"


def record_push_failure(store: Store, remote: str, branch: str, tip: str | None, step: int | None,
                        error: str) -> None:
    """Record that pushing ``branch`` (at ``tip``) to ``remote`` failed with ``error``; best effort is the
    caller's (storage may be what failed)."""
    store.put(push_failure_key(remote, branch), seal({
        "id": tip or "", "step": step, "time": time.time(), "branch": branch, "message": "", "remote": remote,
        "error": error}))


def clear_push_failure(store: Store, remote: str, branch: str) -> None:
    """Forget a failed push of ``branch`` to ``remote``: a push of it has succeeded since."""
    key = push_failure_key(remote, branch)
    if store.exists(key):
        store.delete(key)


# How long a push's lease holds without being renewed: a push renews it while it copies, so only a push killed
# midway leaves one, which then holds its versions' leftovers from gc this long at most.
PUSH_LEASE_S = 3600.0


class PushLease:
    """Records, on the remote a push copies into, the versions it is copying, until the push ends.

    gc judges leftover data by its version id's time, and a pushed version may be older than the grace period
    (or gc may run with none): without a lease, a gc on the remote would collect a version mid-push (its
    arrays before the manifest is there, or its manifest before the ref moves). Each lease's key is a fresh
    version id, so its age reads like any id's; it holds for ``PUSH_LEASE_S`` whatever gc's grace period, and
    a long push renews it."""

    def __init__(self, store: Store, vids: list[str]) -> None:
        self.store, self.body = store, json.dumps(sorted(vids)).encode()
        self.key = self._open()

    def _open(self) -> str:
        key = PUSHES_PREFIX + new_version_id()
        self.store.put(key, self.body)
        self.opened = time.time()
        return key

    def renew_if_due(self) -> None:
        """A fresh lease in place of one half its life old (the new one first: never a moment without)."""
        if time.time() - self.opened > PUSH_LEASE_S / 2:
            old, self.key = self.key, self._open()
            self.store.delete(old)

    def close(self) -> None:
        self.store.delete(self.key)


def leased_versions(store: Store, now: float) -> tuple[set[str], list[str]]:
    """The versions pushes in progress are copying (their leases younger than ``PUSH_LEASE_S``), and the keys of
    stale leases (a push killed midway), which gc deletes."""
    held: set[str] = set()
    stale: list[str] = []
    for key in store.list(PUSHES_PREFIX):
        born = version_id_time(key[len(PUSHES_PREFIX):])
        if born is None or now - born >= PUSH_LEASE_S:
            stale.append(key)
            continue
        try:
            named = json.loads(store.get(key) or b"[]")   # a first push of a long history names thousands
        except (ValueError, CorruptionError):
            named = []
        if isinstance(named, list):
            held.update(v for v in named if isinstance(v, str))
    return held, stale


CLONING_SETTING = "cloning"   # ckptrepo.json: a clone in progress, {"url": ..., "remote": ...}; null once done


def interrupted_clone(config: dict[str, Any], target: str) -> str | None:
    """The one line that says ``config``'s repository (at ``target``) is a clone killed midway and how to finish
    it (remotes/_clone.py); None for any other repository."""
    cloning = config.get(CLONING_SETTING)
    if not isinstance(cloning, dict) or not isinstance(cloning.get("url"), str):
        return None
    url = cloning["url"][:300]
    return (f"{target} is an interrupted clone of {url} (its refs are not set yet); finish it by running the "
            f"same clone again: `ckptrepo clone {url} {target}`")
