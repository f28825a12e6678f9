"""Whether a remote is the repository itself, under another spelling.

A remote that is this repository's own store (its path again, a symlink to it, a ``file://`` URL of it, a bind
mount, or one of two names an object store answers to) holds every object this repository holds: a push finds
it "up to date", and local retention then deletes the only copy of the data it believes the remote keeps. An
``id`` in ``ckptrepo.json`` cannot tell the two apart, since clones and pushes carry their origin's id.

Two checks, from cheap to sure:

* ``same_location``: the URLs name the same place, or one inside the other (real paths, with symlinks
  resolved and the directories compared by device and inode; bucket, prefix and endpoint for object stores).
  Nothing is contacted: ``remote add`` and a snapshotter's start run it.
* ``probe_same_store``: a fresh object written here is looked for there. It finds what no spelling shows (an
  object store reached through two endpoints, a directory mounted twice), and runs where the remote is
  contacted anyway: each push and fetch, and local retention right before it deletes. The probe is an empty
  push lease (``pushes/<fresh id>``, core/_remotes.py), which holds no version and which gc collects if a crash
  leaves it.
"""
from __future__ import annotations

import os
from typing import Any

from ckptrepo.core._manifest import new_version_id
from ckptrepo.errors import RemoteError, StorageError
from ckptrepo.storage import kvstore_spec_from_url
from ckptrepo.storage.protocol import Store

PROBE_PREFIX = "pushes/"   # the push leases' prefix: an empty lease names no version (see the module docstring)
_PROBE_BODY = b"[]"


def location_spec(url: str) -> dict[str, Any] | None:
    """The kvstore spec of ``url`` (nothing is opened), or None when it is not a URL ckptrepo reads."""
    try:
        return kvstore_spec_from_url(url)
    except StorageError:
        return None


def _real_dir(path: str) -> str:
    return os.path.realpath(path.rstrip("/") or "/")


def same_location(here: str, there: str) -> str | None:
    """Why URL ``there`` is the store at ``here`` or overlaps it (a short phrase), or None when it does not."""
    a, b = location_spec(here), location_spec(there)
    if a is None or b is None or a.get("driver") != b.get("driver"):
        return None
    if a["driver"] == "file":
        pa, pb = _real_dir(a["path"]), _real_dir(b["path"])
        if pa == pb:
            return "is this repository's own directory"
        try:
            if os.path.samefile(pa, pb):
                return "is this repository's own directory (mounted or linked elsewhere)"
        except OSError:
            pass   # one of them does not exist (yet): not the same directory
        if os.path.commonpath([pa, pb]) in (pa, pb):
            return "is inside this repository's directory" if pb.startswith(pa) else \
                "holds this repository's directory"
        return None
    keys = ("bucket", "endpoint") if a["driver"] in ("s3", "gcs") else ()
    if any(a.get(k) != b.get(k) for k in keys):
        return None
    pa, pb = str(a.get("path", "")).strip("/"), str(b.get("path", "")).strip("/")
    if pa == pb:
        return "is this repository's own location"
    if not pa or not pb or pb.startswith(pa + "/") or pa.startswith(pb + "/"):
        return "overlaps this repository's location (one prefix holds the other)"
    return None


def check_not_itself(local_url: str, name: str, url: str) -> None:
    """Refuse remote ``name`` at ``url`` when its URL names this repository's store (see ``same_location``)."""
    why = same_location(local_url, url)
    if why is not None:
        raise RemoteError(f"remote {name!r} ({url}) {why}: a repository cannot be its own remote (a push would "
                          f"copy nothing, and local retention would delete the only copy); use another location")


def probe_same_store(local: Store, remote: Store) -> bool:
    """Whether ``remote`` is ``local``'s store: a fresh object written here is read back there."""
    key = PROBE_PREFIX + new_version_id()
    local.put(key, _PROBE_BODY)
    try:
        return remote.get(key, len(_PROBE_BODY) + 1) == _PROBE_BODY
    finally:
        local.delete(key)


def refuse_if_same_store(local: Store, remote: Store, name: str) -> None:
    """Raise RemoteError when remote ``name``'s store is ``local``'s own (see ``probe_same_store``)."""
    check_not_itself(local.url, name, remote.url)
    if probe_same_store(local, remote):
        raise RemoteError(f"remote {name!r} ({remote.url}) is this repository's own store under another name: "
                          f"a repository cannot be its own remote (local retention would delete the only copy); "
                          f"point it elsewhere with `ckptrepo remote remove {name}` and `remote add`")


__all__ = ["check_not_itself", "location_spec", "probe_same_store", "refuse_if_same_store", "same_location"]
