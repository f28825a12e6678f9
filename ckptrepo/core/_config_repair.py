"""Rebuilding a damaged ``ckptrepo.json`` (``ckptrepo fsck --repair-config``) from what the repository holds.

The config holds little: the format version, the default branch and the creation time. HEAD and branch names
are read with the refs' own parsers (core/_refs.py), so the repair names a default branch exactly when the
repository would put snapshots on it.
"""
from __future__ import annotations

import json
import time
from typing import Any, TypeGuard

from ckptrepo.arguments import is_number, is_whole
from ckptrepo.core._manifest import (
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    FORMAT_VERSION,
    HEAD_KEY,
    HEADS_PREFIX,
    VERSIONS_PREFIX,
    decode_config,
    is_version_id,
    unseal_header,
    version_id_time,
)
from ckptrepo.core._refs import head_target, is_ref_name
from ckptrepo.errors import CorruptionError, FormatVersionError, NotARepositoryError
from ckptrepo.storage.protocol import Store


def repair_config(store: Store) -> list[str]:
    """Rebuild a damaged ``ckptrepo.json`` from what the repository holds, and say what was done (one line
    each); an intact config is left as it is.

    The config holds little: the format version, the default branch and the creation time. What of the
    damaged file still parses is kept; the rest is rebuilt: the format version from the newest version's
    manifest, the default branch from HEAD (or ``main``, or the only branch), the creation time from the
    oldest version id. A store with no HEAD, no branch and no version is no repository, and is refused, so
    that a mistyped URL is never turned into one.
    """
    try:
        raw = store.get(CONFIG_KEY, REPAIR_READ_BYTES)
    except CorruptionError:   # not a regular file, far too large, ...: nothing of it can be kept
        raw = None
    if raw is not None:
        try:
            decode_config(raw, store.url)
            if len(raw) <= CONFIG_MAX_BYTES:
                return [f"{CONFIG_KEY} is intact; nothing to repair"]
        except CorruptionError:
            pass
        except FormatVersionError as err:
            if "reads format" in str(err):   # written by a newer ckptrepo: not damage
                raise
    head = store.get(HEAD_KEY)
    branches = sorted(k[len(HEADS_PREFIX):] for k in store.list(HEADS_PREFIX))
    versions = sorted((t, vid) for k in store.list(VERSIONS_PREFIX) for vid in [k[len(VERSIONS_PREFIX):]]
                      if is_version_id(vid) for t in [version_id_time(vid)] if t is not None)
    if head is None and not branches and not versions:
        raise NotARepositoryError(f"{store.url} holds no HEAD, branch or version: it is no ckptrepo repository, "
                                  f"so there is no config to repair; create one with `ckptrepo init`")
    kept, dropped = _within_bounds(_salvage(raw))
    state = "missing" if raw is None else "damaged" if len(raw) <= CONFIG_MAX_BYTES else \
        f"{len(raw)} bytes, over the {CONFIG_MAX_BYTES} a config may hold"
    done = [f"{CONFIG_KEY} was {state}; rebuilt it", *dropped]
    settings: dict[str, Any] = {}
    if "format_version" in kept:
        version, how = kept["format_version"], "kept from the damaged file"
    else:
        version, how = _newest_format(store, versions), "from the newest version" if versions else "this release's"
    done.append(f"format version {version} ({how})")
    if "default_branch" in kept:
        branch, how = kept["default_branch"], "kept from the damaged file"
    else:
        branch, how = _default_branch(head, branches)
    settings["default_branch"] = branch
    done.append(f"default branch {branch!r} ({how})")
    if "created" in kept:
        created, how = kept["created"], "kept from the damaged file"
    elif versions:
        created, how = versions[0][0], "the time of the oldest version"
    else:
        created, how = time.time(), "now: there are no versions"
    settings["created"] = created
    done.append(f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(created))} ({how})")
    settings.update({k: v for k, v in kept.items() if k not in settings and k != "format_version"})
    store.put(CONFIG_KEY, json.dumps({"format": "ckptrepo", "format_version": version, **settings},
                                     indent=2).encode())
    return done


# the most of a damaged config repair reads to salvage its fields: a config over CONFIG_MAX_BYTES is damage, and
# what of it fits in this much is kept
REPAIR_READ_BYTES = 16 << 20
# what one kept setting may take in a repaired config: a remote's URL (at most MAX_REMOTE_URL_CHARS, see
# core/_remotes.py) fits many times over; a longer one is what made the config too big
_KEPT_SETTING_BYTES = 8 << 10


def _within_bounds(kept: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``kept`` without the settings (or remotes) too big to keep, and a line for each one left out."""
    dropped: list[str] = []
    out = {}
    for k, v in kept.items():
        if k == "remotes" and isinstance(v, dict):
            big = [name for name, r in v.items() if len(json.dumps([name, r])) > _KEPT_SETTING_BYTES]
            dropped.extend(f"remote {str(name)[:40]!r} left out: its record is too big to keep" for name in big)
            v = {name: r for name, r in v.items() if name not in big}
        if len(json.dumps([k, v])) > _KEPT_SETTING_BYTES:
            dropped.append(f"setting {str(k)[:40]!r} left out: too big to keep")
            continue
        out[k] = v
    return out, dropped


def _salvage(raw: bytes | None) -> dict[str, Any]:
    """The fields of a damaged config that still parse and hold a value of the right kind."""
    try:
        cfg = json.loads(raw) if raw is not None else None
    except ValueError:
        return {}
    if not isinstance(cfg, dict):
        return {}
    kept = {k: v for k, v in cfg.items() if k not in ("format", "format_version", "default_branch", "created")}
    version = cfg.get("format_version")
    if _format_version(version):
        kept["format_version"] = version
    branch = cfg.get("default_branch")
    if isinstance(branch, str) and is_ref_name(branch):
        kept["default_branch"] = branch
    created = cfg.get("created")
    if is_number(created) and 0 < created < 1e11:
        kept["created"] = float(created)
    return kept


def _newest_format(store: Store, versions: list[tuple[float, str]]) -> int:
    """The format version the newest version manifest records; this release's if none can be read."""
    if versions:
        try:
            raw = store.get(VERSIONS_PREFIX + versions[-1][1])
            found = unseal_header(raw, "newest manifest").get("format_version") if raw is not None else None
        except CorruptionError:
            found = None
        if _format_version(found):
            return found
    return FORMAT_VERSION


def _format_version(v: Any) -> TypeGuard[int]:
    """Whether ``v`` is a format version this release can record: a whole number from 1 to its own."""
    return is_whole(v) and 1 <= v <= FORMAT_VERSION


def _default_branch(head: bytes | None, branches: list[str]) -> tuple[str, str]:
    """The default branch to record, and where it came from: HEAD's branch (as ``Refs.head`` reads HEAD), else
    ``main``, else the only one."""
    try:
        target = head_target(head) if head is not None else None
    except CorruptionError:   # a damaged HEAD names no branch: the config is rebuilt from the branches
        target = None
    if target is not None:
        return target[0], "the branch HEAD is on"
    if "main" in branches or not branches:
        return "main", "the usual default" if not branches else "a branch of that name exists"
    return branches[0], "the first branch by name"


__all__ = ["repair_config"]
