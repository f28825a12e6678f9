"""push, fetch and pull: versions and refs between a repository and its remotes, as git moves commits.

**push** copies to the remote every version the pushed refs reach that it lacks (arrays, then manifests,
parents first: see ``_transfer``), then moves each remote branch by compare-and-swap from the version it
was read at, only as a fast-forward; a remote branch that moved meanwhile, or that holds versions this
repository lacks, rejects the push ("fetch first"). Tags are created there only if absent: a push never moves a tag.
Last, the remote-tracking ref ``refs/remotes/<remote>/<branch>`` records what the remote now holds, which is
what makes a version remote-durable.

**fetch** copies the other way: every version the remote's branches and tags reach that is not here, with
its data, or, lazily, with an eviction marker in place of its data, so that loads read the bytes they need
from the remote (``Plumbing.data_store``). Then it moves the remote-tracking refs and creates the remote's
tags that are not here. **pull** fetches, then fast-forwards the current branch.

Nothing is reachable before all it needs is copied, so an interrupted push or fetch leaves both sides intact;
the next one copies only what is still missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

from ckptrepo import faults
from ckptrepo.core import (
    PRUNED_PREFIX,
    REMOTE_REFS_PREFIX,
    Plumbing,
    PushLease,
    clear_push_failure,
    mark_evicted,
    set_tracking_ref,
    tracking_refs,
)
from ckptrepo.errors import ConflictError, PushRejectedError, RefError
from ckptrepo.remotes._remote import (
    RemoteHistory,
    is_ancestor,
    missing_ancestors,
    open_remote,
    sound_history,
    version_ids,
)
from ckptrepo.remotes._transfer import Progress, VersionCopier


@dataclass
class RefUpdate:
    """One ref a push or fetch looked at: ``old`` -> ``new`` and what happened (``up to date``, ``created``,
    ``fast-forward``)."""

    ref: str
    old: str | None
    new: str
    status: str

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "old": self.old, "new": self.new, "status": self.status}


@dataclass
class SyncResult:
    """What a push, fetch or pull did."""

    remote: str
    url: str
    refs: list[RefUpdate] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    arrays: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"remote": self.remote, "url": self.url, "refs": [r.to_json() for r in self.refs],
                "versions": self.versions, "arrays": self.arrays, "bytes": self.bytes}

    def _count(self, copier: VersionCopier) -> None:
        self.versions = list(copier.tally.versions)
        self.arrays, self.bytes = copier.tally.arrays, copier.tally.bytes


def push(local: Plumbing, remote: str, branches: Sequence[str] | None = None, tags: Sequence[str] = (),
         progress: Progress | None = None, at: dict[str, str] | None = None) -> SyncResult:
    """Push ``branches`` (default: the current one) and ``tags`` to ``remote`` (see the module docstring).
    ``at``: branch -> the version of it to push, instead of its tip (one checked before: a node-local tier's
    rank 0 pushes what the other nodes' arrays were awaited for)."""
    if branches is None:
        current = local.refs.head().branch
        if current is None:
            raise RefError("HEAD is detached: name the branches to push (`ckptrepo push origin BRANCH`)")
        branches = [current]
    tips = {**_targets(branches, local.branch_tip, "branch"), **(at or {})}
    tag_tips = _targets(tags, local.tag_target, "tag")
    there = open_remote(local, remote, create_with_branch=next(iter(tips), None) or "main")
    there.require_atomic_store()   # before any copy: a server that would refuse the ref move gets no data
    result = SyncResult(remote, there.url)
    known = version_ids(local)
    remote_tips = {b: there.refs.branch_tip_with_generation(b) for b in tips}
    for b, (rtip, _) in remote_tips.items():
        if rtip is not None and rtip != tips[b] and not is_ancestor(local, rtip, tips[b], known):
            why = "holds versions this repository lacks" if rtip not in known else "is ahead of it"
            raise PushRejectedError(f"push to {remote} rejected: its branch {b!r} ({rtip[:12]}) {why} (not a "
                                    f"fast-forward); fetch first (`ckptrepo pull {remote}`), then push again")
    for t, target in tag_tips.items():
        rt = there.tag_target(t)
        if rt is not None and rt != target:
            raise PushRejectedError(f"push to {remote} rejected: its tag {t!r} points at {rt[:12]}, here at "
                                    f"{target[:12]}, and a push never moves a tag; delete one of them first")
    todo, newly_reachable = _to_push(local, there, [*tips.values(), *tag_tips.values()],
                                     {rtip for rtip, _ in remote_tips.values() if rtip is not None}, known)
    pruned = {v for v in todo if local.store.exists(PRUNED_PREFIX + v)}
    copier = VersionCopier(local.store, there.store, progress)
    manifests = copier.read_manifests(todo)
    copier.plan_bytes((m for _, m in manifests.values()), lambda v: v not in pruned)
    lease = PushLease(there.store, newly_reachable) if newly_reachable else None
    try:
        for vid in todo:
            if lease is not None:
                lease.renew_if_due()
            raw, m = manifests[vid]
            if vid not in pruned:
                copier.copy_arrays(m, local.data_store(m))
            copier.copy_manifest(vid, raw, pruned=vid in pruned)
        faults.point("push_before_ref")
        _move_remote_refs(local, there, remote, tips, tag_tips, remote_tips, result)
    finally:
        if lease is not None:
            lease.close()
    result._count(copier)
    return result


def _move_remote_refs(local: Plumbing, there: Plumbing, remote: str, tips: dict[str, str], tag_tips: dict[str, str],
                      remote_tips: dict[str, tuple[str | None, bytes]], result: SyncResult) -> None:
    """Last step of a push: each remote branch moved by CAS as a fast-forward, then its tracking ref here; each
    tag created there if absent."""
    for b, tip in tips.items():
        rtip, gen = remote_tips[b]
        if rtip != tip:
            if there.refs.move_branch(b, tip, gen, rtip, there.first_parent) is None:
                raise PushRejectedError(f"push to {remote} rejected: its branch {b!r} moved while pushing (another "
                                        f"writer); fetch first (`ckptrepo pull {remote}`), then push again")
        set_tracking_ref(local.store, remote, b, tip)
        clear_push_failure(local.store, remote, b)
        result.refs.append(RefUpdate(f"refs/heads/{b}", rtip, tip, _status(rtip, tip)))
    for t, target in tag_tips.items():
        rt = there.tag_target(t)
        if rt is None:
            try:
                there.refs.create_tag(t, target)
            except RefError as err:   # created by another pusher meanwhile: fine if it is the same version
                if there.tag_target(t) != target:
                    raise PushRejectedError(f"push to {remote} rejected: {err}") from err
        result.refs.append(RefUpdate(f"refs/tags/{t}", rt, target, "up to date" if rt == target else "created"))


def _targets(names: Sequence[str], target: Callable[[str], str | None], kind: str) -> dict[str, str]:
    """Each branch or tag name (``kind``) -> the version it names here; a name that is not here is refused."""
    out = {}
    for name in names:
        vid = target(name)
        if vid is None:
            raise RefError(f"no {kind} named {name!r} here; list them with `ckptrepo {kind}`")
        out[name] = vid
    return out


def _to_push(local: Plumbing, there: Plumbing, tips: list[str], remote_tips: set[str],
             known: set[str]) -> tuple[list[str], list[str]]:
    """The versions ``tips`` reach that the remote lacks, parents first; and the versions the push makes
    reachable there (those, and any an interrupted push left there unreachable), which its lease names.

    A push that fast-forwards a remote branch finds them by walking back to that branch's tip (everything a
    remote ref reaches is there), without listing the remote's versions: a local tier pushing after every
    snapshot would otherwise list a history of thousands of versions each time. Where any walk ends elsewhere
    (a root: a first push, a new branch forking off old history, a tag on an old version; or a merge), the
    remote's listing decides what is missing."""
    parents = {}

    def parents_of(vid: str) -> tuple[str, ...]:
        parents[vid] = local.header(vid).parents
        return parents[vid]

    walked = missing_ancestors(parents_of, tips, remote_tips, known)
    ends = {p for ps in parents.values() for p in ps} - set(parents)
    if remote_tips and ends <= remote_tips and all(len(ps) == 1 for ps in parents.values()):
        return walked, walked
    return missing_ancestors(lambda v: local.header(v).parents, tips, version_ids(there), known), walked


def _status(old: str | None, new: str) -> str:
    return "up to date" if old == new else "created" if old is None else "fast-forward"


def fetch(local: Plumbing, remote: str, lazy: bool = False, depth: int | None = None,
          progress: Progress | None = None, source: tuple[Plumbing, RemoteHistory] | None = None) -> SyncResult:
    """Fetch every branch and tag of ``remote`` (see the module docstring). ``lazy``: no tensor data is copied,
    loads read it from the remote. ``depth``: data is copied for the newest ``depth`` versions of each branch
    (first parents), the older ones are fetched as lazily; every manifest is fetched either way, so history,
    ``log`` and loads of any version work. A damaged remote is refused before anything is copied
    (``sound_history``). ``source``: the remote as a clone opened and checked it (its headers read once)."""
    present = version_ids(local)
    if source is None:
        there = open_remote(local, remote)
        history = sound_history(there, f"remote {remote!r} ({there.url})", present)
    else:
        there, history = source
    result = SyncResult(remote, there.url)
    branches, tags = history.branches, history.tags
    todo = missing_ancestors(partial(history.parents_of, there), history.tips, present, history.known)
    with_data = set() if lazy else _within_depth(there, branches.values(), depth, set(todo))
    pruned = {v for v in todo if there.store.exists(PRUNED_PREFIX + v)}
    copier = VersionCopier(there.store, local.store, progress)
    manifests = copier.read_manifests(todo)
    copier.plan_bytes((m for _, m in manifests.values()), lambda v: v in with_data and v not in pruned)
    for vid in todo:
        raw, m = manifests[vid]
        if vid in pruned:
            pass
        elif vid in with_data:
            copier.copy_arrays(m, there.data_store(m))
        elif any(t.pieces for t in m.tensors):
            mark_evicted(local.store, vid, remote)
        copier.copy_manifest(vid, raw, pruned=vid in pruned)
    before = tracking_refs(local.store, remote)
    for name in sorted(set(before) - {f"{remote}/{b}" for b in branches}):
        # deleted there: its versions may be collected there too, so nothing here may count them as held
        # (git's fetch --prune; eviction and log's durability trust these refs)
        local.store.delete(REMOTE_REFS_PREFIX + name)
        result.refs.append(RefUpdate(REMOTE_REFS_PREFIX + name, before[name], "", "deleted"))
    for b, tip in branches.items():
        set_tracking_ref(local.store, remote, b, tip)
        old = before.get(f"{remote}/{b}")
        result.refs.append(RefUpdate(f"refs/remotes/{remote}/{b}", old, tip, _status(old, tip)))
    for t, target in tags.items():
        mine = local.tag_target(t)
        if mine is None:
            try:
                local.refs.create_tag(t, target)
            except RefError:   # a branch of that name here, or a clash: git keeps its own ref and says nothing
                continue
            result.refs.append(RefUpdate(f"refs/tags/{t}", None, target, "created"))
    result._count(copier)
    return result


def _within_depth(there: Plumbing, tips: Sequence[str] | Any, depth: int | None, todo: set[str]) -> set[str]:
    """The versions of ``todo`` within ``depth`` first parents of a tip (all of them without a depth)."""
    if depth is None:
        return set(todo)
    out: set[str] = set()
    for tip in tips:
        vid: str | None = tip
        for _ in range(depth):
            if vid is None:
                break
            if vid in todo:
                out.add(vid)
            parents = there.header(vid).parents
            vid = parents[0] if parents else None
    return out


def pull(local: Plumbing, remote: str, lazy: bool = False, progress: Progress | None = None) -> SyncResult:
    """Fetch ``remote``, then fast-forward the current branch to the remote's branch of the same name."""
    head = local.refs.head()
    if head.branch is None:
        raise RefError("HEAD is detached: check out a branch to pull into (`ckptrepo checkout BRANCH`)")
    result = fetch(local, remote, lazy=lazy, progress=progress)
    theirs = tracking_refs(local.store, remote).get(f"{remote}/{head.branch}")
    if theirs is None:
        raise RefError(f"remote {remote!r} has no branch {head.branch!r}; push it first (`ckptrepo push {remote}`)")
    mine, gen = local.refs.branch_tip_with_generation(head.branch)
    known = version_ids(local)
    if mine == theirs or (mine is not None and is_ancestor(local, theirs, mine, known)):
        status = "up to date"
    elif mine is None or is_ancestor(local, mine, theirs, known):
        if local.refs.move_branch(head.branch, theirs, gen, mine, local.first_parent) is None:
            raise ConflictError(f"branch {head.branch!r} moved while pulling (a snapshot landed); pull again")
        status = "fast-forward"
    else:
        raise PushRejectedError(f"branch {head.branch!r} and {remote}/{head.branch} have diverged ({mine[:12]} and "
                                f"{theirs[:12]}); keep both: `ckptrepo checkout {remote}/{head.branch} -b NAME` puts "
                                f"the remote's history on a branch of its own")
    result.refs.append(RefUpdate(f"refs/heads/{head.branch}", mine, theirs, status))
    return result
