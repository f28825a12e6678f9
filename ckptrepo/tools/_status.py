"""What ``ckptrepo status`` reports, and the names shell completion offers for a revision.

Status reads only small objects and listings: HEAD and its version's header,
the failure records (``failures/``), and the ids of snapshots that have data
(``data/``; or an earlier release's handshake, ``staging/``) but no manifest yet. Such a
snapshot is in flight (still being written or committed) or was abandoned by a
process that died; gc deletes the abandoned ones once they are older than its
grace period, so status says how old each one is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ckptrepo.core import DATA_PREFIX, STAGING_PREFIX, Plumbing, is_version_id, version_id_time
from ckptrepo.errors import CkptRepoError
from ckptrepo.maintenance import data_version_ids, staged_ids
from ckptrepo.tools._width import natural_key

PROBE_NAME = "probe-"   # staging/<id>/probe-<rank>: a distributed snapshotter's start (saving/_startup.py)


@dataclass
class Uncommitted:
    """A snapshot with data or rank parts in storage and no manifest: in flight, or abandoned."""

    id: str
    started: float | None      # from the id; None if the id carries no time
    distributed: bool          # several ranks' arrays, or rank parts under staging/

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RepoStatus:
    """HEAD, where it points, and the snapshots that are not (yet) versions."""

    url: str
    branch: str | None                     # None: detached
    head: str | None                       # HEAD's version; None on a branch without versions
    head_step: int | None = None
    head_time: float | None = None
    versions: int = 0                      # manifests in storage, reachable or not
    uncommitted: list[Uncommitted] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    damage: str | None = None              # HEAD cannot be read: what is wrong with it

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "branch": self.branch, "head": self.head, "head_step": self.head_step,
                "head_time": self.head_time, "versions": self.versions,
                "uncommitted": [u.to_json() for u in self.uncommitted], "failures": self.failures,
                "damage": self.damage}


def repo_status(plumbing: Plumbing) -> RepoStatus:
    """The status of the repository ``plumbing`` opened; damage to HEAD is reported in it, not raised."""
    versions = set(plumbing.all_version_ids())
    status = RepoStatus(plumbing.url, None, None, versions=len(versions))
    try:
        head = plumbing.refs.head()
        status.branch = head.branch
        status.head = plumbing.head_version()
        if status.head is not None:
            header = plumbing.header(status.head)
            status.head_step, status.head_time = header.step, header.time
    except CkptRepoError as err:
        status.damage = str(err)
    failures = plumbing.failures()
    failed = {f.get("id") for f in failures}
    status.failures = failures
    # a distributed start's probe objects are no snapshot: only rank parts (an earlier release's handshake) are
    staged = {v for v in staged_ids(plumbing) if is_version_id(v) and any(
        not k.rsplit("/", 1)[-1].startswith(PROBE_NAME) for k in plumbing.store.list(f"{STAGING_PREFIX}{v}/"))}
    pending = (data_version_ids(plumbing) | staged) - versions - failed
    status.uncommitted = sorted((Uncommitted(v, version_id_time(v), v in staged or _ranks_written(plumbing, v) > 1)
                                 for v in pending), key=lambda u: u.started or 0.0, reverse=True)
    return status


def _ranks_written(plumbing: Plumbing, vid: str) -> int:
    """How many ranks' arrays snapshot ``vid`` has under ``data/<id>/<rank>/``: more than one is a distributed
    snapshot's."""
    prefix = f"{DATA_PREFIX}{vid}/"
    return len({k[len(prefix):].split("/", 1)[0] for k in plumbing.store.list(prefix) if "/" in k[len(prefix):]})


def age(t: float | None, now: float | None = None) -> str:
    """How long ago ``t`` was, in the largest whole unit ("3 s", "5 min", "2 h", "4 d")."""
    if t is None:
        return "?"
    s = max(0.0, (time.time() if now is None else now) - t)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{int(s // span)} {unit}"
    return f"{int(s)} s"


SHORT_ID = 12   # as log prints ids; unique in practice (80 random bits lead each id)
ID_PREFIX = 4   # the fewest hex digits a revision may name an id by (core/_revisions.py)


def revision_names(plumbing: Plumbing, incomplete: str) -> list[str]:
    """What a revision starting with ``incomplete`` may be: HEAD, branches, tags, and short ids, in that order.
    Ids are offered once ``incomplete`` is a prefix of at least ``ID_PREFIX`` hex digits (the shortest a
    revision takes), so that a plain TAB lists names, not hundreds of ids."""
    names = ["HEAD"] + sorted(plumbing.refs.branches(strict=False), key=natural_key) + \
        sorted(plumbing.refs.tags(strict=False), key=natural_key)
    out = [n for n in dict.fromkeys(names) if n.startswith(incomplete)]
    prefix = incomplete.lower()
    if len(prefix) >= ID_PREFIX and all(c in "0123456789abcdef" for c in prefix):
        out += sorted({vid[:SHORT_ID] for vid in plumbing.ids_with_prefix(prefix)})
    return out


__all__ = ["RepoStatus", "SHORT_ID", "Uncommitted", "age", "repo_status", "revision_names"]
