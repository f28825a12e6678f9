"""Versions lost to a gc that ran beside a writer: naming them, and the repair that lets gc run again.

A gc whose grace period is shorter than a commit (``--grace 0``) can collect a version after its writer
wrote the manifest and before the branch moved onto it: the manifest and the data go, and then the branch
names the version, and the writer's next snapshots name it as their parent. gc refuses to run past a
missing manifest (the history behind it would look unreachable, and be collected), so it refuses for good.
A writer therefore checks, once its ref moved, whether a gc pass collected its version
(:func:`collected_while_committing`), and moves its branch back if so (:func:`undo_collected_commit`); a
writer killed in between, or one from a release without that check, still leaves the state above.

The repair (``ckptrepo fsck --repair``, :func:`repair_lost`) deletes nothing. It marks each such version
lost (``lost/<id>``, an empty marker like ``pruned/<id>``), where gc's and fsck's walks then stop instead
of refusing; it tags the versions that may have been its parent ``lost/<id12>`` (the newest) and
``lost/<id12>-<id12>``, so that the history before it stays reachable: the parent link was in the
collected manifest, and nothing else tells which one it was. These are the versions no ref reaches, that
no manifest names as a parent, and that are older than the lost one. A branch or detached HEAD that names
the lost version itself moves back to the newest of them, as git's ORIG_HEAD would let a user do by hand.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from ckptrepo.core import (
    DATA_PREFIX,
    LOST_PREFIX,
    TAGS_PREFIX,
    VERSIONS_PREFIX,
    Head,
    Plumbing,
    version_id_time,
)
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CkptRepoError
from ckptrepo.storage import ZARR_JSON

LOST_TAG_PREFIX = "lost/"
COLLECTED_WAIT_S = 120.0   # the longest a writer waits for a gc pass whose intent names its version


@dataclass(frozen=True)
class LostVersion:
    """A version some ref or reachable manifest names whose manifest is gone."""

    vid: str
    named_by: tuple[str, ...]   # "branch 'main'", "HEAD", "version 1d62119692af of branch 'main', as its parent,"
    data_left: bool             # data/<id>/ is still stored (a finished gc pass leaves none)
    marked: bool                # lost/<id> exists: fsck --repair has dealt with it


def named_missing(parents: Mapping[str, Sequence[str]], refs: Mapping[str, str]) -> dict[str, list[str]]:
    """The versions that ``refs`` (description -> version) or the manifests they reach name, and that have no
    manifest (not in ``parents``), each with what names it."""
    named: dict[str, list[str]] = {}
    seen: set[str] = set()
    stack = [(vid, ref, ref) for ref, vid in refs.items()]
    while stack:
        vid, by, ref = stack.pop()
        if vid not in parents:
            if by not in named.setdefault(vid, []):
                named[vid].append(by)
            continue
        if vid in seen:
            continue
        seen.add(vid)
        stack.extend((p, f"version {vid[:12]} of {ref}, as its parent,", ref) for p in parents[vid])
    return dict(sorted(named.items()))


def describe_refs(branches: Mapping[str, str], tags: Mapping[str, str], head: Head,
                  tracking: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ref as a description (what messages name it by) -> the version it names."""
    out = {f"branch {b!r}": vid for b, vid in branches.items()}
    out.update({f"tag {t!r}": vid for t, vid in tags.items()})
    out.update({f"remote-tracking ref {r!r}": vid for r, vid in (tracking or {}).items()})
    if head.branch is None and head.version:
        out["HEAD"] = head.version
    return out


def find_lost(plumbing: Plumbing, parents: Mapping[str, Sequence[str]], refs: Mapping[str, str]) -> list[LostVersion]:
    """Every version the refs or their history name whose manifest is gone (``parents``: every stored
    manifest's), as :class:`LostVersion`."""
    marked = plumbing.lost_ids()
    return [LostVersion(vid, tuple(by), bool(plumbing.store.list(f"{DATA_PREFIX}{vid}/")), vid in marked)
            for vid, by in named_missing(parents, refs).items()
            if not plumbing.store.exists(VERSIONS_PREFIX + vid)]   # committed since the listing: not lost


def lost_line(lost: LostVersion) -> str:
    """What fsck says of a lost version: an error until it is marked, then a warning."""
    short = lost.vid[:12]
    by = ", ".join(lost.named_by)
    if lost.marked:
        return (f"version {short} is lost ({LOST_PREFIX}{lost.vid}): {by} names it, but its manifest is gone; "
                f"gc, fsck and `log` stop there (`REV~N` past it fails), and the versions that may have preceded "
                f"it are tagged {LOST_TAG_PREFIX}{short}* (`ckptrepo log {LOST_TAG_PREFIX}{short}`)")
    cause = ("its data is still stored: restore the manifest from a backup if there is one, or"
             if lost.data_left else
             "its data is gone too, as a gc whose grace period is shorter than a commit (`gc --grace 0` beside a "
             "writer) leaves a version it collects while the writer commits it;")
    return (f"version {short} is missing ({VERSIONS_PREFIX}{lost.vid}), yet {by} names it; {cause} "
            f"`ckptrepo fsck --repair` marks it lost and tags the versions that may have preceded it "
            f"{LOST_TAG_PREFIX}{short}*, deleting nothing (gc refuses to run until then)")


def parent_candidates(lost: str, parents: Mapping[str, Sequence[str]], reachable: set[str]) -> list[str]:
    """The versions that may have been ``lost``'s parent, newest first: stored, no ref reaches them, no manifest
    names them as a parent, and created before it."""
    born = version_id_time(lost) or 0.0
    children_of = {p for ps in parents.values() for p in ps}
    return sorted((vid for vid in parents if vid not in reachable and vid not in children_of
                   and (version_id_time(vid) or 0.0) < born), key=lambda v: (version_id_time(v) or 0.0, v),
                  reverse=True)


def repair_lost(plumbing: Plumbing) -> list[str]:
    """Mark every version the refs or their history name whose manifest is gone as lost, tag the versions
    that may have preceded it, and move a branch or detached HEAD that names it to the newest of them (module
    docstring); deletes nothing. Returns one line per thing done. Running it again does nothing more."""
    from ckptrepo.core import tracking_refs
    from ckptrepo.maintenance._gc import reachable_versions

    refs = plumbing.refs
    branches, tags, head = refs.branches(strict=False), refs.tags(strict=False), refs.head()
    described = describe_refs(branches, tags, head, tracking_refs(plumbing.store))
    parents: dict[str, Sequence[str]] = {}
    for vid, m in plumbing.iter_manifests(plumbing.all_version_ids()):
        if isinstance(m, CkptRepoError):
            if plumbing.store.exists(VERSIONS_PREFIX + vid):
                raise m   # a damaged manifest: fsck names it; its parent links are unknown, so nothing is guessed
            continue
        parents[vid] = m.parents
    done: list[str] = []
    # oldest first: the versions after an older lost one are candidates only for the newer ones
    lost = sorted(find_lost(plumbing, parents, described), key=lambda x: (version_id_time(x.vid) or 0.0, x.vid))
    reachable = reachable_versions(list(described.values()), parents)
    for item in lost:
        if not item.marked:
            plumbing.store.put(LOST_PREFIX + item.vid, b"")   # first: a repair killed after it is run again
            done.append(f"marked version {item.vid[:12]} lost ({LOST_PREFIX}{item.vid}), named by "
                        f"{', '.join(item.named_by)}")
        candidates = parent_candidates(item.vid, parents, reachable)
        for i, vid in enumerate(candidates):
            name = f"{LOST_TAG_PREFIX}{item.vid[:12]}" + ("" if i == 0 else f"-{vid[:12]}")
            if plumbing.store.exists(TAGS_PREFIX + name):
                continue
            refs.create_tag(name, vid)
            done.append(f"tagged {vid[:12]} {name}: it may have preceded lost version {item.vid[:12]}, and its "
                        f"history stays")
        reachable |= reachable_versions(candidates, parents)
        if not candidates:
            continue
        for b, vid in branches.items():
            if vid == item.vid:
                tip, gen = refs.branch_tip_with_generation(b)
                if tip == item.vid and refs.move_branch(b, candidates[0], gen, None, lambda _v: None) is not None:
                    done.append(f"moved branch {b!r} from lost version {item.vid[:12]} back to {candidates[0][:12]}")
        now = refs.head(for_update=True)
        if now.branch is None and now.version == item.vid:
            refs.set_head(None, candidates[0], now.generation)
            done.append(f"moved detached HEAD from lost version {item.vid[:12]} back to {candidates[0][:12]}")
    return done


def collected_while_committing(plumbing: Plumbing, vid: str, arrays: Sequence[str]) -> str | None:
    """What a gc pass deleted of version ``vid`` while its branch moved onto it, or None; its writer asks right
    after the move. ``arrays``: the keys of the arrays the version wrote.

    A pass names the versions whose manifest or data (data without a manifest) it deletes in its intent
    (``pruning/``), then reads the refs, or looks for each manifest, again, and deletes (maintenance/_gc.py):
    either that read sees this writer's ref or manifest, and the version is kept, or this check, which comes
    after both, sees the intent, or the pass is over. The writer waits for a pass that names it: the manifest
    goes (collected), or the intent stops naming it (kept). Then the manifest and the first object of each
    array (its ``zarr.json``, created before any shard) tell.
    """
    from ckptrepo.maintenance._gc import collecting
    deadline = time.monotonic() + COLLECTED_WAIT_S
    while vid in collecting(plumbing.store, time.time()) and time.monotonic() < deadline:
        if not plumbing.store.exists(VERSIONS_PREFIX + vid):
            break
        time.sleep(0.02)   # past the deadline: a pass that died holding it; what is stored tells
    if not plumbing.store.exists(VERSIONS_PREFIX + vid):
        return "collected it (manifest and data) while it was committed"
    gone = next((key for key in arrays if not plumbing.store.exists(f"{key}/{ZARR_JSON}")), None)
    return None if gone is None else f"deleted its data ({gone}) as data without a manifest while it was written"


def undo_collected_commit(plumbing: Plumbing, branch: str, vid: str, parent: str | None,
                          generation: bytes | None, what: str) -> tuple[str, bytes | None]:
    """Move ``branch`` back from ``vid``, of which a gc deleted ``what`` (``collected_while_committing``) as it
    was committed, to ``parent``, if it is still at ``generation``. Returns the one line to raise, and the
    branch's new generation (None: not moved back)."""
    moved = None
    if parent is not None and generation is not None:
        moved = plumbing.refs.move_branch(branch, parent, generation, vid, lambda _v: None)
    where = (f"branch {branch!r} is back at {parent[:12]}; take the snapshot again"
             if moved is not None and parent is not None else
             f"branch {branch!r} still names it: run `ckptrepo fsck --repair`, then take the snapshot again")
    return (f"version {vid[:12]} was not committed: a gc with a grace period shorter than a commit (`gc --grace "
            f"0`) {what}; {where}, and give gc a grace period longer than a commit",
            moved.generation if moved is not None else None)


def own_arrays(manifest: Manifest) -> list[str]:
    """The keys of the arrays version ``manifest`` wrote (not those it reuses from other versions)."""
    return [key for key in manifest.arrays if key.startswith(f"{DATA_PREFIX}{manifest.id}/")]

