"""Retention rules and garbage collection.

Two kinds of deletion:

* **Prune** a version that is still in the history but no retention rule keeps
  (the newest N per branch, every K-th step, the best N by a metric, tags and
  branch heads):
  its tensor data is deleted, its small manifest stays (so ``log``, metrics and
  parent links survive) and a ``pruned/<id>`` marker says the data is gone.
* **Collect** what no ref reaches: manifests and data of abandoned or
  interrupted snapshots, data without a manifest, old failure records.

Safe against a concurrent writer: nothing younger than the grace period is
collected (a writer in flight has objects no ref points to yet), branch heads
and tagged versions are never pruned by default, and data still referenced by a
kept version is never deleted. Without a grace period a writer's snapshots may
fail: gc names what it collects in its intent, reads the refs (and leftover
data's manifests) again just before it deletes and keeps what they reach then,
and a writer whose branch moved after that read finds its version in the intent
and moves its branch back; one killed before that check leaves a branch naming a
version gc collected (``maintenance/_lost.py``: fsck names it, ``fsck --repair``
lets gc run again).

Safe against damage: gc deletes only what it can prove unreachable in a
repository whose refs and history pass fsck's checks. It stops before deleting
anything, naming the damage, when a ref or manifest cannot be read, a ref or
parent names a missing version (one that ``fsck --repair`` marked lost ends the
walk instead), HEAD's branch is lost while versions exist, parent links form a
cycle, or a ``pruned/`` marker names a branch tip, a tag or a detached HEAD
whose data is still stored (see ``graph_damage``). There is
no trash to undo a gc (docs/decisions/016-gc-refuses-on-damage.md): ``--dry-run``
lists what would go.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from ckptrepo.arguments import check_whole, is_number
from ckptrepo.core import (
    DATA_PREFIX,
    FAILURES_PREFIX,
    HEADS_PREFIX,
    PRUNED_PREFIX,
    PRUNING_PREFIX,
    PRUNING_STALE_S,
    STAGING_PREFIX,
    VERSIONS_PREFIX,
    Head,
    Plumbing,
    children_first,
    every_ref_target,
    find_cycle,
    is_version_id,
    leased_versions,
    lost_head_branch,
    missing_manifest,
    new_version_id,
    parent_cycle_error,
    replaced_refs,
    seal,
    tracking_refs,
    unseal,
    version_id_time,
)
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CorruptionError, RefError, RetentionError, StorageError

DEFAULT_GRACE_S = 3600.0


@dataclass
class GcReport:
    """What gc kept, pruned and collected (or would, with ``dry_run``)."""

    kept: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)           # data deleted, manifest kept
    collected: list[str] = field(default_factory=list)        # unreachable versions deleted entirely
    orphan_data: list[str] = field(default_factory=list)      # data/<id>/ without a manifest
    too_young: list[str] = field(default_factory=list)        # unreferenced, but inside the grace period
    bytes_freed: int = 0          # tensor bytes of the arrays deleted
    stored_bytes_freed: int = 0   # what they took in the store (chunk padding, checksums, indexes: see du)
    dry_run: bool = False
    # a dry run's list: each pruned, collected or leftover id (and each version whose pruning a pass cut short)
    # -> its "step", "time" and the "stored_bytes" that go with it (an array shared by two of them counted with
    # the older; together stored_bytes_freed), so that a dry run can say what goes, in time order. Empty
    # otherwise: a pass that deletes may rescue a version it listed (committed meanwhile)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Retention rules a snapshotter applies in the background, every ``every_commits`` commits.

    The same rules as ``repo.gc(...)``; the grace period protects what a
    concurrent writer (or this snapshotter's next snapshot) has in flight.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_tagged: bool = True
    keep_branch_heads: bool = True
    grace_period_s: float = DEFAULT_GRACE_S
    every_commits: int = 1
    keep_best: int | None = None      # the N versions with the best value of best_metric (Orbax's best_fn)
    best_metric: str | None = None
    best_mode: str = "min"            # "min" (a loss) or "max" (an accuracy)

    def __post_init__(self) -> None:   # refused when the policy is made, not in every background pass after it
        check_rule_counts(self.keep_last, self.keep_every, self.keep_best, self.grace_period_s)
        check_rule_counts(every_commits=self.every_commits)
        check_best_rule(self.keep_best, self.best_metric, self.best_mode)
        for name in ("keep_tagged", "keep_branch_heads"):
            if not isinstance(getattr(self, name), bool):
                raise RetentionError(f"RetentionPolicy({name}=...) is True or False, not {getattr(self, name)!r}")

    def apply(self, plumbing: Plumbing, protect_since: float | None = None,
              known: dict[str, "VersionFacts"] | None = None, keep_also: Collection[str] = ()) -> GcReport:
        return collect(plumbing, self.keep_last, self.keep_every, self.keep_tagged, self.keep_branch_heads,
                       self.grace_period_s, protect_since=protect_since, known=known, keep_best=self.keep_best,
                       best_metric=self.best_metric, best_mode=self.best_mode, keep_also=keep_also)


@dataclass(frozen=True)
class VersionFacts:
    """The little of a manifest that gc needs.

    A snapshotter that applies retention after every commit keeps these
    between passes (``collect(known=...)``), so a pass decodes only the
    manifests committed since the last one (decoding a whole manifest is the
    costly part of a pass) and holds a few objects per version instead of the whole manifest.
    """

    parents: tuple[str, ...]
    step: int | None
    time: float | None
    arrays: tuple[tuple[str, int, int], ...]   # (key, tensor bytes, its layout's bytes) of each array it lists
    referenced: tuple[str, ...]           # the arrays its tensors' pieces point into
    metrics: tuple[tuple[str, float], ...] = ()   # its numeric metrics (keep_best ranks by them)

    @classmethod
    def of(cls, manifest: Manifest) -> "VersionFacts":
        from ckptrepo.storage import layout_bytes
        return cls(manifest.parents, manifest.step, manifest.time,
                   tuple((a.key, a.nbytes, layout_bytes(a)) for a in manifest.arrays.values()),
                   tuple({p.array for t in manifest.tensors for p in t.pieces}),
                   tuple((k, float(v)) for k, v in (manifest.metrics or {}).items()
                         if is_number(v) and not math.isnan(v)))


def reachable_versions(starts: Sequence[str], parents: Mapping[str, Sequence[str]]) -> set[str]:
    """Versions reachable from ``starts`` (ref targets) through parent links (``parents``: each known version's;
    a walk stops at an unknown one)."""
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        vid = stack.pop()
        if vid in seen or vid not in parents:
            continue
        seen.add(vid)
        stack.extend(parents[vid])
    return seen


def staged_ids(plumbing: Plumbing) -> set[str]:
    """The ids with objects under ``staging/``: a distributed start's probes, or an earlier release's commit
    handshake (parts and outcome)."""
    return {k[len(STAGING_PREFIX):].split("/", 1)[0] for k in plumbing.store.list(STAGING_PREFIX)}


def data_version_ids(plumbing: Plumbing) -> set[str]:
    """The versions with a folder under ``data/`` (whether or not a manifest names them); a stray file there (a
    Finder ``.DS_Store``) is no version."""
    return {vid for k in plumbing.store.list(DATA_PREFIX) for vid in [k[len(DATA_PREFIX):].split("/", 1)[0]]
            if is_version_id(vid)}


def _targets(branches: Mapping[str, str], tags: Mapping[str, str], head: Head) -> list[str]:
    return list(branches.values()) + list(tags.values()) + ([head.version] if head.version else [])


def marked_refs(pruned: set[str], data_ids: set[str], branches: Mapping[str, str], tags: Mapping[str, str],
                head: Head) -> dict[str, list[str]]:
    """The versions a ``pruned/`` marker names that a branch, a tag or a detached HEAD points at, and whose
    data is still stored (``data_ids``), each with the refs that name it. A marker says the data is deleted; on
    such a version it is stray, or left by an interrupted gc that pruned ref targets (``--no-keep-branch-heads``,
    ``--no-keep-tagged``): a plain gc would "finish" by deleting live data, and loads refuse it already."""
    names: dict[str, list[str]] = {}
    for b, vid in branches.items():
        names.setdefault(vid, []).append(f"branch {b!r}")
    for t, vid in tags.items():
        names.setdefault(vid, []).append(f"tag {t!r}")
    if head.branch is None and head.version:
        names.setdefault(head.version, []).append("HEAD")
    return {vid: refs for vid, refs in sorted(names.items()) if vid in pruned and vid in data_ids}


def unshared_data(plumbing: Plumbing, pruned: set[str], data_ids: set[str], arrays: Mapping[str, Collection[str]],
                  referenced: Mapping[str, Collection[str]]) -> set[str]:
    """The pruned versions that still store an array of their own that no unpruned version points into: what a
    gc interrupted after its markers leaves. A pruned version's array that another version's pieces use (dedup)
    stays on purpose, and says nothing of an interrupted gc. ``arrays``: each version's array keys;
    ``referenced``: the arrays each version's pieces point into; ``data_ids``: the versions with data stored."""
    live = {a for vid, keys in referenced.items() if vid not in pruned for a in keys}
    out = set()
    for vid in sorted(pruned & data_ids & set(arrays)):
        own = [a for a in arrays[vid] if a.startswith(f"{DATA_PREFIX}{vid}/") and a not in live]
        if own and any(k.startswith(a + "/") for k in plumbing.store.list(f"{DATA_PREFIX}{vid}/") for a in own):
            out.add(vid)
    return out


def marked_ref_damage(vid: str, refs: Sequence[str]) -> str:
    """One line for a version ``marked_refs`` found."""
    return (f"{PRUNED_PREFIX}{vid} marks version {vid[:12]} ({', '.join(refs)}) as pruned, but its data is still "
            f"stored: if a gc with --no-keep-branch-heads or --no-keep-tagged was interrupted, run it again; "
            f"otherwise the marker is stray: delete {PRUNED_PREFIX}{vid}")


def graph_damage(plumbing: Plumbing, parents: Mapping[str, Sequence[str]], head: Head) -> list[str]:
    """What fsck's ref and history checks find that gc must not run past, beyond unreadable refs and
    manifests and missing versions (raised where they are read): a lost HEAD branch, a parent cycle.
    ``parents``: every version's parents."""
    damage = []
    lost = lost_head_branch(plumbing.store, head, len(parents))
    if lost is not None:
        damage.append(lost)
    cycle = find_cycle(parents)
    if cycle is not None:
        damage.append(str(parent_cycle_error(cycle)))
    damage.extend(f"{key} is an empty folder or a broken link, not a ref: the versions only it reached would look "
                  f"unreachable; restore the ref (`ckptrepo branch` / `ckptrepo tag` NAME ID) or remove it"
                  for key in replaced_refs(plumbing.store)
                  if head.branch is None or key != HEADS_PREFIX + head.branch)   # that one is ``lost`` above
    return damage


def _reachable(plumbing: Plumbing, starts: Sequence[str], facts: dict[str, "VersionFacts"],
               lost: Collection[str] = ()) -> set[str]:
    """The versions reachable from ``starts`` through parent links; a version missing from ``facts`` is read
    (and added to them) before the walk goes on, and gc stops before it deletes anything when its manifest is
    gone, unless ``fsck --repair`` marked it lost (maintenance/_lost.py): the walk ends there.

    Without the manifest that version's data would look like an interrupted
    snapshot's and be collected: a repository that is already damaged would
    lose the bytes a restored manifest could still use. An id missing only
    from gc's listing (committed since, or listed late by an object store) is
    walked through like any other: stopping the walk there would leave its
    whole history unreached, and collected.
    """
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        if vid not in facts:
            if not plumbing.store.exists(VERSIONS_PREFIX + vid):
                if vid in lost:
                    continue
                raise CorruptionError(f"gc stopped before deleting anything: {missing_manifest(vid)}")
            facts[vid] = VersionFacts.of(plumbing.manifest(vid))
        seen.add(vid)
        stack.extend(facts[vid].parents)
    return seen


def check_rule_counts(keep_last: Any = None, keep_every: Any = None, keep_best: Any = None,
                      grace_period_s: Any = 0.0, every_commits: Any = None) -> None:
    """Refuse a count that is not a whole number of at least 1: ``keep_last=-1`` or ``keep_every=0`` would
    otherwise switch retention on and prune all but the branch heads."""
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best),
                        ("every_commits", every_commits)):
        if value is not None:
            check_whole(value, name, 1, error=RetentionError, hint="; leave it out to not use that rule")
    if not isinstance(grace_period_s, (int, float)) or not grace_period_s >= 0:   # NaN too: it compared as 0
        raise RetentionError(f"the grace period must be a number of seconds of at least 0, not {grace_period_s!r}")


def check_best_rule(keep_best: Any, best_metric: Any, best_mode: Any) -> None:
    """Refuse a best-N rule that cannot rank: no metric, a metric that is not a name, or a mode other than min
    or max, and a metric or mode given without ``keep_best`` (a rule that would silently do nothing)."""
    if best_metric is not None and not isinstance(best_metric, str):
        raise RetentionError(f"best_metric is the name of a metric (e.g. 'loss'), not {best_metric!r}")
    if best_mode not in ("min", "max"):
        raise RetentionError(f"best_mode must be a mode of min or max ('min' for a loss, 'max' for an accuracy), "
                             f"not {best_mode!r}")
    if best_metric is not None and keep_best is None:
        raise RetentionError(f"a metric ({best_metric!r}) ranks versions only for keep_best; add keep_best=N "
                             f"(--keep-best N), or leave the metric out")
    if keep_best is not None and best_metric is None:
        raise RetentionError(f"keeping the best {keep_best} versions needs a metric to rank them by; e.g. "
                             f"keep_best={keep_best}, best_metric='loss', best_mode='min' "
                             f"(`ckptrepo gc --keep-best {keep_best} --metric loss --mode min`)")


def collect(plumbing: Plumbing, keep_last: int | None = None, keep_every: int | None = None, keep_tagged: bool = True,
            keep_branch_heads: bool = True, grace_period_s: float = DEFAULT_GRACE_S,
            dry_run: bool = False, protect_since: float | None = None,
            known: dict[str, VersionFacts] | None = None, keep_best: int | None = None,
            best_metric: str | None = None, best_mode: str = "min", keep_also: Collection[str] = ()) -> GcReport:
    """Apply the retention rules and collect garbage; see the module docstring.

    Without ``keep_last``/``keep_every`` every version in the history is kept
    and only unreachable objects are collected. ``keep_last N`` keeps the N
    newest versions of each branch's first-parent history, ``keep_every K``
    the versions whose step is a multiple of K, ``keep_best B`` (with
    ``best_metric`` and ``best_mode`` "min" or "max") the B versions of the
    history whose metric is best among those that still have their data
    (versions without it are not ranked). ``protect_since`` (unix
    seconds): nothing created at or after it is collected, whatever the grace
    period (a snapshotter protects the snapshots it has in flight this way).
    ``known``: facts of earlier passes, brought up to date here (manifests never change).
    """
    check_rule_counts(keep_last, keep_every, keep_best, grace_period_s)
    check_best_rule(keep_best, best_metric, best_mode)
    now = time.time()
    report = GcReport(dry_run=dry_run)
    # the refs before the listing: a version committed after this read is young, and its ancestors are reached
    # from these refs; read after, a new tip missing from the listing cut its whole history off from the walk
    branches = plumbing.refs.branches()
    tags = plumbing.refs.tags()
    head = plumbing.refs.head()
    tracking = tracking_refs(plumbing.store)   # what a remote holds: kept here like a branch (see every_ref_target)
    facts = _facts(plumbing, {} if known is None else known)
    already_pruned = plumbing.pruned_ids()
    damage = graph_damage(plumbing, {vid: f.parents for vid, f in facts.items()}, head)
    if damage:
        raise CorruptionError(f"gc stopped before deleting anything: {damage[0]}")
    lost = plumbing.lost_ids()
    reachable = _reachable(plumbing, _targets(branches, tags, head) + list(tracking.values()), facts, lost)

    retention = keep_last is not None or keep_every is not None or keep_best is not None
    keep: set[str] = set()
    if not retention:
        keep = set(reachable)
    if keep_branch_heads:
        keep.update(branches.values())
        keep.update(tracking.values())
        if head.version:
            keep.add(head.version)
    if keep_tagged:
        keep.update(tags.values())
    if keep_last is not None:
        for tip in list(branches.values()) + ([head.version] if head.version else []):
            vid: str | None = tip
            n = 0
            while vid is not None and vid in facts and n < keep_last:
                keep.add(vid)
                n += 1
                parents = facts[vid].parents
                vid = parents[0] if parents else None
    if keep_every:
        keep.update(v for v in reachable if (step := facts[v].step) is not None and step % keep_every == 0)
    if keep_best is not None:
        keep.update(_best(facts, reachable - already_pruned, keep_best, str(best_metric), best_mode))
    keep.update(keep_also)   # whatever the rules: a local tier's versions not on its remote yet
    keep &= reachable
    data_ids = data_version_ids(plumbing)
    # a marker on a ref's version whose data is stored: finishing that prune deletes live data, unless these
    # very rules prune the version too (the rerun of an interrupted --no-keep-branch-heads pass)
    unfinished_ids = unshared_data(plumbing, already_pruned, data_ids,
                                   {v: [a for a, _, _ in f.arrays] for v, f in facts.items()},
                                   {v: f.referenced for v, f in facts.items()})
    for vid, refs in marked_refs(already_pruned, unfinished_ids, branches, tags, head).items():
        if vid in keep:
            raise CorruptionError(f"gc stopped before deleting anything: {marked_ref_damage(vid, refs)}")

    def young(vid: str, t: float | None) -> bool:
        born = version_id_time(vid)
        return t is None or now - t < grace_period_s or \
            (protect_since is not None and (born is None or born >= protect_since))

    # a version marked pruned has no loadable data, kept or not (a tag put on it since does not bring it back)
    live_arrays = {key for vid in keep - already_pruned for key in facts[vid].referenced}
    for vid in sorted(reachable):
        if vid in keep:
            report.kept.append(vid)
        elif vid not in already_pruned:
            report.pruned.append(vid)
    # a push copying into this repository: its versions are older than their ids say (see open_push_lease)
    leased, stale_leases = leased_versions(plumbing.store, now)
    for vid in sorted(set(facts) - reachable):
        if young(vid, facts[vid].time) or vid in leased:
            report.too_young.append(vid)
        else:
            report.collected.append(vid)
    for vid in sorted(data_ids - set(facts) - lost):   # a lost version's data: a restored manifest uses it
        young_data = young(vid, version_id_time(vid)) or vid in leased
        (report.too_young if young_data else report.orphan_data).append(vid)
    # pruned by a pass that was killed after its markers and before (all of) its deletes: finished now, by any
    # pass (a plain gc keeps every reachable version, and would leave such data on disk, unloadable, for good)
    unfinished = sorted(already_pruned & data_ids & reachable)

    # read again just before the deletes: a push that began since the listing copies into what it names
    leased_now, _ = leased_versions(plumbing.store, time.time())
    for found in (report.collected, report.orphan_data):
        held = [vid for vid in found if vid in leased_now]
        found[:] = [vid for vid in found if vid not in leased_now]
        report.too_young.extend(held)
    # a manifest too young to collect may be a commit under way (its ref not moved yet): what it points into,
    # other versions' arrays included (dedup), stays
    live_arrays.update(key for vid in report.too_young if vid in facts for key in facts[vid].referenced)
    doomed_arrays = {key: (nbytes, layout) for vid in report.pruned + report.collected + unfinished
                     for key, nbytes, layout in facts[vid].arrays
                     if key not in live_arrays and key.split("/")[1] not in leased_now}
    from ckptrepo.storage import stored_bytes
    report.bytes_freed = sum(nbytes for nbytes, _ in doomed_arrays.values())
    stored = {key: stored_bytes(plumbing.store, key, layout) for key, (_, layout) in doomed_arrays.items()}
    # a leftover's bytes are what data/<id>/ takes (on a local store; an object store is not asked, and says 0)
    leftovers = {vid: stored_bytes(plumbing.store, f"{DATA_PREFIX}{vid}", 0) for vid in report.orphan_data}
    report.stored_bytes_freed = sum(stored.values()) + sum(leftovers.values())
    if dry_run:   # only a dry run lists: a pass that deletes may still rescue a listed version
        report.details = _details(report, facts, stored, leftovers, unfinished)
        return report

    doomed = set(doomed_arrays)

    def mark_and_unlist() -> list[str]:
        # a writer may have moved a ref onto a version listed here since the refs were read (the grace period
        # is what protects it; with none, the intent, written before this read, names the versions to collect,
        # and a writer whose ref moves after it waits for this pass, see maintenance/_lost.py)
        rescued = committed_meanwhile(plumbing, report.collected, facts)
        for vid in rescued:
            report.collected.remove(vid)
            report.kept.append(vid)
            doomed.difference_update(facts[vid].referenced)
        for vid in report.pruned:
            # mark first: a crash leaves data, never a lie. Empty: a full disk still takes an empty file, where a
            # marker with content would fail, and gc, the way to free space, would free nothing
            plumbing.store.put(PRUNED_PREFIX + vid, b"")
        # children first: a gc killed midway never leaves a manifest whose parent it deleted (fsck: damage)
        for vid in children_first(report.collected, {v: facts[v].parents for v in report.collected}):
            plumbing.store.delete(VERSIONS_PREFIX + vid)              # manifest before data: never a dangling manifest
            plumbing.store.delete(PRUNED_PREFIX + vid)
        # data without a manifest: a manifest written since the listing is a commit under way (checked after the
        # intent that names it, as the refs above: a writer that sees the intent checks its data)
        for vid in list(report.orphan_data):
            if plumbing.store.exists(VERSIONS_PREFIX + vid):
                report.orphan_data.remove(vid)
                report.too_young.append(vid)
                report.stored_bytes_freed -= leftovers[vid]
                rescued.append(vid)
                continue
            plumbing.store.delete_prefix(f"{DATA_PREFIX}{vid}/")
        return rescued

    kept = delete_arrays_announced(plumbing, "gc-" + new_version_id(), doomed, set(facts), mark_and_unlist,
                                   versions=report.collected + report.orphan_data)
    kept |= set(doomed_arrays) - doomed
    if kept:   # reused by snapshots committed meanwhile (dedup): not freed after all
        report.bytes_freed -= sum(doomed_arrays[k][0] for k in kept)
        report.stored_bytes_freed -= sum(stored[k] for k in kept)
    for key in stale_leases:
        plumbing.store.delete(key)
    for key, (born, _, _) in _intents(plumbing.store):   # the intents of prunes that died midway
        if now - born >= PRUNING_STALE_S:
            plumbing.store.delete(key)
    for key in plumbing.store.list(FAILURES_PREFIX):
        vid = key[len(FAILURES_PREFIX):]
        if vid not in facts and not young(vid, version_id_time(vid)):
            plumbing.store.delete(key)
    # the commit handshakes of distributed snapshots, once stale
    for vid in sorted(staged_ids(plumbing)):
        if not young(vid, version_id_time(vid)):
            plumbing.store.delete_prefix(f"{STAGING_PREFIX}{vid}/")
    return report


def _details(report: GcReport, facts: dict[str, VersionFacts], stored: Mapping[str, int],
             leftovers: Mapping[str, int], unfinished: list[str]) -> dict[str, dict[str, Any]]:
    """The step, time and stored bytes of each version gc prunes or collects (or finishes pruning) and of
    each leftover data set, oldest first, adding up to ``stored_bytes_freed``. A version's bytes are those of
    its arrays that go and that no older one of them listed; a leftover's are ``leftovers``'."""
    out: dict[str, dict[str, Any]] = {}
    for vid in report.pruned + report.collected + unfinished:
        out[vid] = {"step": facts[vid].step, "time": facts[vid].time, "stored_bytes": 0}
    for vid in report.orphan_data:
        out[vid] = {"step": None, "time": version_id_time(vid), "stored_bytes": leftovers[vid]}
    ordered = sorted(out, key=lambda v: (out[v]["time"] is None, out[v]["time"] or 0.0, v))
    counted: set[str] = set()
    for vid in ordered:
        if vid in facts:
            for key, _, _ in facts[vid].arrays:
                if key in stored and key not in counted:
                    counted.add(key)
                    out[vid]["stored_bytes"] += stored[key]
    return {vid: out[vid] for vid in ordered}


def committed_meanwhile(plumbing: Plumbing, candidates: Collection[str],
                        facts: Mapping[str, VersionFacts]) -> list[str]:
    """The ``candidates`` (versions about to be collected) that the refs, read again now, reach: committed by a
    writer after gc first read the refs. Versions missing from ``facts`` (committed since the listing) are
    walked through by their headers."""
    if not candidates:
        return []
    seen: set[str] = set()
    stack = every_ref_target(plumbing, strict=True)
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        seen.add(vid)
        if vid in facts:
            stack.extend(facts[vid].parents)
        elif plumbing.store.exists(VERSIONS_PREFIX + vid):
            stack.extend(plumbing.header(vid).parents)
    return sorted(seen.intersection(candidates))


def _best(facts: dict[str, VersionFacts], candidates: set[str], n: int, metric: str, mode: str) -> list[str]:
    """The ``n`` candidates with the lowest (``mode`` "min") or highest value of ``metric``; ties go to the newer.

    A metric that no candidate records is an error rather than an empty rule: a misspelt name would
    otherwise prune every version the other rules do not keep.
    """
    ranked = []
    for vid in candidates:
        value = dict(facts[vid].metrics).get(metric)
        if value is not None:
            ranked.append((value if mode == "min" else -value, -(version_id_time(vid) or 0.0), vid))
    if not ranked:
        recorded = sorted({k for vid in candidates for k, _ in facts[vid].metrics})
        raise RetentionError(f"no version with data records metric {metric!r}; recorded: "
                             f"{', '.join(recorded) or 'none'}; pick one of those")
    return [vid for _, _, vid in sorted(ranked)[:n]]


def _facts(plumbing: Plumbing, known: dict[str, VersionFacts]) -> dict[str, VersionFacts]:
    """Every version's facts, from ``known`` where it has them; ``known`` is brought up to date (new versions
    added, deleted ones dropped)."""
    ids = plumbing.all_version_ids()
    for vid in set(known) - set(ids):
        del known[vid]
    gone = set()
    for vid, m in plumbing.iter_manifests([vid for vid in ids if vid not in known]):
        if isinstance(m, Manifest):
            known[vid] = VersionFacts.of(m)
        elif plumbing.store.exists(VERSIONS_PREFIX + vid):
            raise m
        else:
            gone.add(vid)      # deleted since the listing (another gc collected it): not damage
    return {vid: known[vid] for vid in ids if vid not in gone}


def prune_version(plumbing: Plumbing, vid: str) -> int:
    """Delete the data of version ``vid`` now, as a retention pass prunes it (module docstring): mark it pruned,
    then delete the arrays no other unpruned version points into. Returns the bytes freed.

    Refused for a version a tag, a branch tip, HEAD or a remote-tracking ref names, and for one a push is copying:
    those are what a user or a remote still loads. Every other version's manifest is read (facts), since any of
    them, committed or in flight, may share an array through dedup.
    """
    refs = plumbing.refs
    head = refs.head()
    named = [f"tag {t!r}" for t, v in refs.tags().items() if v == vid] + \
        [f"branch {b!r}" for b, v in refs.branches().items() if v == vid] + \
        [f"remote-tracking ref {r!r}" for r, v in tracking_refs(plumbing.store).items() if v == vid] + \
        (["HEAD"] if head.version == vid else [])
    if named:
        raise RefError(f"version {vid[:12]} is named by {named[0]}, so its data stays; delete or move that ref "
                       f"first (`ckptrepo tag -d NAME`)")
    leased, _ = leased_versions(plumbing.store, time.time())
    if vid in leased:
        raise RefError(f"version {vid[:12]} is being pushed right now; prune it once the push is done")
    already = plumbing.pruned_ids()
    if vid in already:
        return 0
    facts = _facts(plumbing, {})
    if vid not in facts:
        raise RefError(f"version {vid[:12]} has no manifest here; nothing to prune")
    live = {key for other, f in facts.items() if other != vid and other not in already for key in f.referenced}
    doomed = {key: nbytes for key, nbytes, _ in facts[vid].arrays if key not in live}
    # a snapshot in flight may reuse one of these arrays (dedup) and commit at any moment. The intent, written
    # first, lists them: a commit checks it after writing its manifest and fails rather than point at deleted
    # bytes; the manifests written before that check are read again here, and what they use is kept
    kept = delete_arrays_announced(plumbing, vid, set(doomed), set(facts),
                                   lambda: plumbing.store.put(PRUNED_PREFIX + vid, b""))   # marker first, as collect
    return sum(n for key, n in doomed.items() if key not in kept)


def delete_arrays_announced(plumbing: Plumbing, name: str, doomed: set[str], known: Collection[str],
                            before: Callable[[], Collection[str] | None],
                            versions: Collection[str] = ()) -> set[str]:
    """Delete the ``doomed`` arrays without pulling them from under a snapshot that reuses one (dedup) and
    commits meanwhile; returns the arrays kept for such snapshots.

    The intent ``pruning/<name>``, written first, lists them; a commit checks it after writing its manifest
    (saving/_dedup.py) and fails rather than point at deleted bytes. After ``before`` (markers, manifest
    deletes), the manifests written since the caller listed ``known`` ones are read, and what they use is kept:
    a commit either wrote its manifest before this read, or sees the intent.

    ``versions``: the versions whose manifests or data ``before`` deletes, also listed in the intent, for a
    writer whose ref moves onto one meanwhile (maintenance/_lost.py); those ``before`` returns it kept after
    all, and the intent is written again without them.
    """
    intent: str | None = PRUNING_PREFIX + name
    try:
        plumbing.store.put(PRUNING_PREFIX + name, seal({"time": time.time(), "arrays": sorted(doomed),
                                                        "versions": sorted(versions)}))
    except StorageError:
        # a full disk takes no intent, and then no commit's manifest either: nothing can land meanwhile, and
        # gc, what a user runs to free space, must still free it
        intent = None
    kept: set[str] = set()
    try:
        rescued = before()
        if versions and rescued and intent is not None:
            plumbing.store.put(intent, seal({"time": time.time(), "arrays": sorted(doomed),
                                             "versions": sorted(set(versions) - set(rescued))}))
        for _new, m in plumbing.iter_manifests([v for v in plumbing.all_version_ids() if v not in known]):
            if isinstance(m, Manifest):
                kept.update(p.array for t in m.tensors for p in t.pieces if p.array in doomed)
        for key in sorted(doomed - kept):
            plumbing.store.delete_prefix(key + "/")
    finally:
        if intent is not None:
            plumbing.store.delete(intent)
    return kept


def _intents(store: Any) -> list[tuple[str, tuple[float, list[str], list[str]]]]:
    """Every intent (``pruning/<name>``): its key, when it was written, the arrays it lists and the versions
    whose manifests it deletes."""
    out = []
    for key in store.list(PRUNING_PREFIX):
        raw = store.get(key)
        if raw is None:
            continue
        try:
            intent = unseal(raw, key)
            out.append((key, (float(intent["time"]), [a for a in intent["arrays"] if isinstance(a, str)],
                              [v for v in intent.get("versions", ()) if isinstance(v, str)])))
        except (CorruptionError, KeyError, TypeError, ValueError, AttributeError):
            out.append((key, (0.0, [], [])))   # torn by a crash: that prune is over
    return out


def collecting(store: Any, now: float) -> set[str]:
    """The versions whose manifests gc passes in progress are deleting (intents younger than
    ``PRUNING_STALE_S``)."""
    return {v for _, (t, _, versions) in _intents(store) if now - t < PRUNING_STALE_S for v in versions}


def pruning_arrays(store: Any, now: float) -> set[str]:
    """The arrays prunes in progress are deleting (intents younger than ``PRUNING_STALE_S``)."""
    return {a for _, (t, arrays, _) in _intents(store) if now - t < PRUNING_STALE_S for a in arrays}
