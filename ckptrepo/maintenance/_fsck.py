"""Repository check: read every object, verify every checksum and every reference.

Errors are things that make a committed version unloadable or a ref dangling,
or that gc must not run past (it refuses on the same ref and history checks,
``_check_graph``): a lost HEAD branch, a parent cycle, a pruned marker on a
ref's version. Warnings are harmless leftovers (data of an interrupted
snapshot, manifests no ref reaches) that ``gc`` collects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ckptrepo.core import (
    DATA_PREFIX,
    VERSIONS_PREFIX,
    Head,
    Plumbing,
    check_coverage,
    check_evicted,
    every_ref_target,
    evicted_ids,
    interrupted_clone,
    lost_head_branch,
    tracking_refs,
    volume,
)
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CkptRepoError, CorruptionError, first_line, is_storage_failure, some_names, storage_failure
from ckptrepo.maintenance._fsck_digests import Checked, PieceDigests
from ckptrepo.maintenance._gc import (
    data_version_ids,
    graph_damage,
    marked_ref_damage,
    marked_refs,
    reachable_versions,
    unshared_data,
)
from ckptrepo.maintenance._lost import describe_refs, find_lost, lost_line
from ckptrepo.storage import ArrayInfo, FrameCheck, StoredShards, chunk_crcs, first_mismatch, open_array, read_table

MISSING_SHARDS_NAMED = 5   # per array; more are counted in one line (a manifest can declare millions)


@dataclass
class FsckReport:
    """What fsck found; ``ok`` is False when any error was found."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    versions: int = 0
    objects: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "errors": self.errors, "warnings": self.warnings, "versions": self.versions,
                "objects": self.objects, "bytes": self.bytes}


def fsck(plumbing: Plumbing, on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None) -> FsckReport:
    """Check the whole repository; never raises for damage, reports it instead.

    ``on_total`` is told the bytes of data the check will read, once the manifests are read and before the
    data is (a progress bar's size); ``on_bytes`` each shard's bytes as it is read.
    """
    report = FsckReport()
    # a writer may commit while fsck runs: the refs read before the listing reach every listed ancestor, and
    # those read after it name versions the listing may lack, which are read before being called missing
    try:
        starts = every_ref_target(plumbing, strict=True)
    except CkptRepoError:   # a damaged ref: _check_refs names it, and reaches through the others
        starts = []
    manifests: dict[str, Manifest] = {}
    for vid, m in plumbing.iter_manifests(plumbing.all_version_ids()):
        if isinstance(m, Manifest):
            manifests[vid] = m
        elif plumbing.store.exists(VERSIONS_PREFIX + vid):
            report.errors.append(str(m))
    lost = plumbing.lost_ids()
    head, refs = _check_refs(plumbing, manifests, report, starts, lost)
    report.versions = len(manifests)
    pruned = plumbing.pruned_ids()
    evicted = evicted_ids(plumbing.store)
    data_ids = data_version_ids(plumbing)
    reachable = reachable_versions(starts, {vid: m.parents for vid, m in manifests.items()})
    held = unshared_data(plumbing, pruned, data_ids, {vid: list(m.arrays) for vid, m in manifests.items()},
                         {vid: {p.array for t in m.tensors for p in t.pieces} for vid, m in manifests.items()})
    marked = _check_graph(plumbing, manifests, head or Head(None, None, b""), refs, pruned, held, report)
    _name_interrupted_clone(plumbing, head, len(manifests), report)
    if on_total is not None:   # gc deleted a pruned version's data on purpose: it is not read
        on_total(sum(a.nbytes for vid, m in manifests.items() if vid not in pruned for a in m.arrays.values()))
    stored: dict[str, set[tuple[str, int, int]]] = {}
    unbound = [vid for vid, m in manifests.items()
               if vid not in pruned and _check_binding(vid, m, manifests, stored, report)]
    if unbound:
        report.warnings.append(f"{len(unbound)} version(s) are not content-bound (written before format 2: "
                               f"{some_names([v[:12] for v in sorted(unbound)])}): their chunks are checked by "
                               f"their own crc32c only, so a shard swapped with another version's goes unseen")
    _check_lost(plumbing, manifests, head, refs, report)
    digests_checked: Checked = set()
    for vid, m in manifests.items():
        _check_parents(vid, m, manifests, reachable, report, lost)
        if vid not in pruned:
            before = len(report.errors)
            _check_version_data(plumbing, vid, m, report, on_bytes, evicted, digests_checked)
            if len(report.errors) > before and plumbing.is_pruned(vid):
                del report.errors[before:]   # pruned by a gc running meanwhile: its data was deleted on purpose

    elsewhere = sorted((evicted & set(manifests)) - pruned)
    check_evicted(plumbing, elsewhere, manifests, reachable, report.errors.append, report.warnings.append)
    if elsewhere:
        report.warnings.append(f"{len(elsewhere)} version(s) keep their data on a remote (evicted after a push, or "
                               f"cloned lazily: {some_names([v[:12] for v in elsewhere])}): what is not here is not "
                               f"checked; run `ckptrepo fsck` on the remote")
    for vid in sorted(set(manifests) - reachable):
        report.warnings.append(f"version {vid[:12]} is not reachable from any branch or tag "
                               f"(an interrupted or abandoned snapshot); gc will remove it")
    for f in plumbing.failures():
        if f.get("remote"):   # a failed background push (core/_remotes.py): committed here, not there
            report.warnings.append(f"branch {f.get('branch')!r} (at {str(f['id'])[:12]}) is not on remote "
                                   f"{f['remote']!r} yet: {f.get('error')}")
            continue
        report.warnings.append(f"snapshot {f['id'][:12]} (step {f.get('step')}) failed and was not committed: "
                               f"{f.get('error')}")
    limbo = sorted((held & set(manifests)) - marked)   # a ref's version: an error above
    if limbo:
        shown = ", ".join(v[:12] for v in limbo[:3]) + (" ..." if len(limbo) > 3 else "")
        report.warnings.append(f"{len(limbo)} version(s) marked pruned still hold data ({shown}): a gc was "
                               f"interrupted after marking them; they do not load, and `ckptrepo gc` finishes "
                               f"deleting their data")
    referenced = {p for m in manifests.values() for p in m.parents} | set(starts)
    for vid in sorted(data_ids - set(manifests)):
        if vid in lost:
            continue            # kept by gc for a restored manifest; _check_lost names the version
        if vid in referenced:   # its manifest was lost (an error above), not an interrupted snapshot's leftover
            report.warnings.append(f"{DATA_PREFIX}{vid}/ is the data of version {vid[:12]}, whose manifest is "
                                   f"missing: it cannot be loaded without it (gc refuses to run until that is "
                                   f"resolved)")
        else:
            report.warnings.append(f"{DATA_PREFIX}{vid}/ has no manifest (an interrupted snapshot); gc will remove it")
    return report


def _check_parents(vid: str, m: Manifest, manifests: dict[str, Manifest], reachable: set[str],
                   report: FsckReport, lost: set[str]) -> None:
    """Each parent of a version must exist. A version no ref reaches whose parent is gone is no damage: an older
    gc, which deleted unreachable manifests in id order, left that when interrupted, and the next gc collects
    it; for a version some ref reaches it is history lost (gc then refuses to run)."""
    for p in m.parents:
        if p in manifests or p in lost:   # a lost one is named once, by _check_lost
            continue
        if vid in reachable:
            report.errors.append(f"version {vid[:12]}: parent {p[:12]} is missing ({VERSIONS_PREFIX}{p})")
        else:
            report.warnings.append(f"version {vid[:12]}, which no ref reaches, names parent {p[:12]}, whose manifest "
                                   f"is gone: an interrupted gc leaves this; the next `ckptrepo gc` removes it")


def _name_interrupted_clone(plumbing: Plumbing, head: Head | None, versions: int, report: FsckReport) -> None:
    """A clone killed midway has versions and no branch under HEAD yet: said as what it is, with how to finish it,
    instead of as a lost HEAD branch."""
    line = interrupted_clone(plumbing.config, plumbing.url)
    if line is not None:
        lost = lost_head_branch(plumbing.store, head, versions) if head is not None else None
        report.errors[:] = [line] + [e for e in report.errors if e != lost]


def _check_graph(plumbing: Plumbing, manifests: dict[str, Manifest], head: Head, refs: dict[str, dict[str, str]],
                 pruned: set[str], data_ids: set[str], report: FsckReport) -> set[str]:
    """The ref and history checks gc refuses to run past (see ``graph_damage``; HEAD's only when it could be
    read), and pruned markers on the versions the readable ``refs`` (by kind, as ``_check_refs`` read them)
    point at whose data is still stored (``marked_refs``), which are returned."""
    parents = {vid: m.parents for vid, m in manifests.items()}
    report.errors.extend(graph_damage(plumbing, parents, head))
    marked = marked_refs(pruned, data_ids, refs["branch"], refs["tag"], head)
    report.errors.extend(marked_ref_damage(vid, refs) for vid, refs in marked.items())
    return set(marked)


def _check_refs(plumbing: Plumbing, manifests: dict[str, Manifest], report: FsckReport,
                starts: list[str], lost: set[str]) -> tuple[Head | None, dict[str, dict[str, str]]]:
    """Every ref's version must exist; one committed since the listing is read into ``manifests`` (with its
    ancestors the listing lacks), not reported. The versions the readable refs name are added to ``starts``.
    Returns HEAD, or None when it cannot be read (reported), and the readable refs by kind."""
    def missing(vid: str | None) -> bool:
        tip = True
        while vid is not None and vid not in manifests:
            if not plumbing.store.exists(VERSIONS_PREFIX + vid):
                # an ancestor's absence is reported as a missing parent below; a lost one by _check_lost
                return tip and vid not in lost
            try:
                manifests[vid] = plumbing.manifest(vid)
            except CkptRepoError as err:
                report.errors.append(str(err))
                return False
            tip, vid = False, next(iter(manifests[vid].parents), None)
        return False

    refs: dict[str, dict[str, str]] = {}
    for kind in ("branch", "tag"):
        targets, damage = plumbing.refs.read_all(kind, strict=False)
        refs[kind] = targets
        report.errors.extend(damage)   # damaged: named, and the other refs still checked
        for name, vid in targets.items():
            if missing(vid):
                report.errors.append(f"{kind} {name!r} points at missing version {vid[:12]}")
            else:
                starts.append(vid)
    try:
        head = plumbing.refs.head()
    except CkptRepoError as err:
        report.errors.append(str(err))
        return None, refs
    if head.branch is None and missing(head.version):
        report.errors.append(f"HEAD points at missing version {str(head.version)[:12]}")
    elif head.version is not None:
        starts.append(head.version)
    return head, refs


def _check_lost(plumbing: Plumbing, manifests: dict[str, Manifest], head: Head | None,
                refs: dict[str, dict[str, str]], report: FsckReport) -> None:
    """Name each version a readable ref or its history names whose manifest is gone, and why (a gc beside the
    writer that committed it, maintenance/_lost.py): an error until ``fsck --repair`` marks it lost, then a
    warning."""
    parents = {vid: m.parents for vid, m in manifests.items()}
    described = describe_refs(refs["branch"], refs["tag"], head or Head(None, None, b""),
                              tracking_refs(plumbing.store))
    for lost in find_lost(plumbing, parents, described):
        (report.warnings if lost.marked else report.errors).append(lost_line(lost))


def _check_version_data(plumbing: Plumbing, vid: str, m: Manifest, report: FsckReport,
                        on_bytes: Callable[[int], None] | None, evicted: set[str], digests_checked: Checked) -> None:
    arrays = m.arrays
    for t in m.tensors:
        for piece in t.pieces:
            info = arrays.get(piece.array)
            if info is None or piece.offset + volume(piece.box[1]) > info.numel:
                report.errors.append(f"version {vid[:12]}: tensor {t.name} points outside its array {piece.array}")
    try:
        check_coverage({t.name: (t.shape, [p.box for p in t.pieces]) for t in m.tensors})
    except CkptRepoError as err:
        report.errors.append(f"version {vid[:12]}: {err}")
    for key, info in arrays.items():
        if (vid in evicted or key.split("/")[1] in evicted) and not plumbing.store.exists(f"{key}/zarr.json"):
            continue   # on the remote the eviction marker names (a warning above)
        try:
            arr = open_array(plumbing.store, info)
        except Exception as err:  # noqa: BLE001
            _raise_if_unreachable(err, f"opening array {key}")
            report.errors.append(f"version {vid[:12]}: array {key} cannot be opened: {first_line(err)}")
            continue
        stored, missing = StoredShards(plumbing.store, info), 0
        present = stored.present()
        try:
            table = read_table(plumbing.store, info)
        except CorruptionError as err:
            report.errors.append(f"version {vid[:12]}: {err}")
            continue
        digests = PieceDigests(m, info, digests_checked)   # fed each shard's bytes as read, in order
        frames = FrameCheck(plumbing.store, info) if info.compression is not None else None
        for s in info.shards():
            lo, hi = s * info.shard_elems, min(info.numel, (s + 1) * info.shard_elems)
            # looked at before it is read: a FIFO would block the read, and a shard or index larger than the
            # object would be allocated in full first
            problem = "missing" if s not in present else stored.problem(s)
            if problem is not None:
                missing += 1
                if missing <= MISSING_SHARDS_NAMED:
                    what = "missing" if problem == "missing" else f"corrupt ({problem})"
                    report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} is {what}; "
                                         f"tensors: {some_names(_names_in(m, key, lo, hi))}")
                digests.feed(lo, hi, None)
            else:
                digests.feed(lo, hi, _check_shard(arr, table, vid, m, info, s, report, frames))
            report.objects += 1
            nbytes = (hi - lo) * info.itemsize
            report.bytes += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
        report.errors.extend(digests.errors)
        if missing > MISSING_SHARDS_NAMED:
            report.errors.append(f"version {vid[:12]}: array {key} lacks {missing - MISSING_SHARDS_NAMED} more of "
                                 f"its {len(info.shards())} declared shard objects, or holds them damaged")


def _check_shard(arr: Any, table: np.ndarray | None, vid: str, m: Manifest, info: ArrayInfo, s: int,
                 report: FsckReport, frames: FrameCheck | None = None) -> np.ndarray | None:
    """Read shard ``s`` through TensorStore (which checks each chunk's crc32c) and check its chunks against the
    array's chunk table; returns its bytes when they passed (None otherwise). A compressed shard's chunks must
    first declare their own size (``frames``): TensorStore inflates a chunk before it compares sizes."""
    lo, hi = s * info.shard_elems, min(info.numel, (s + 1) * info.shard_elems)
    try:
        bomb = frames.problem((lo, hi)) if frames is not None else None
        if bomb is not None:
            report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} is corrupt (inner chunk {bomb[0]}: "
                                 f"{bomb[1]}); tensors: {some_names(_names_in(m, info.key, lo, hi))}")
            return None
        data = arr[lo:hi].read().result()
        bad = None if table is None else \
            first_mismatch(table, lo // info.inner_elems, chunk_crcs(info, data.view(np.uint8)))
    except Exception as err:  # noqa: BLE001
        _raise_if_unreachable(err, f"reading {info.shard_key(s)}")
        report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} is corrupt or missing "
                             f"({first_line(err)}); tensors: {some_names(_names_in(m, info.key, lo, hi))}")
        return None
    if bad is not None:
        report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} holds data its manifest does not "
                             f"name (inner chunk {lo // info.inner_elems + bad} is another version's or stale); "
                             f"tensors: {some_names(_names_in(m, info.key, lo, hi))}")
        return None
    return data.view(np.uint8)


def _names_in(m: Manifest, key: str, lo: int, hi: int) -> list[str]:
    """The tensors with elements in ``[lo, hi)`` of array ``key``."""
    return [t.name for t in m.tensors for p in t.pieces
            if p.array == key and p.offset < hi and p.offset + volume(p.box[1]) > lo]


def _check_binding(vid: str, m: Manifest, manifests: dict[str, Manifest],
                   stored: dict[str, set[tuple[str, int, int]]], report: FsckReport) -> bool:
    """Check what binds version ``vid``'s pieces to their bytes; returns whether it is not content-bound.

    A format-2 version's own arrays carry the digest of their chunk table; a piece that points into another
    version's array (dedup) must be one of that version's own pieces, byte for byte where it starts and ends:
    a re-sealed manifest can point anywhere in a valid array, and the bytes there verify."""
    own = f"{DATA_PREFIX}{vid}/"
    unbound = False
    for key, info in m.arrays.items():
        if info.digest is None:
            if key.startswith(own) and (m.format_version or 1) >= 2:
                report.errors.append(f"version {vid[:12]}: array {key} has no chunk-table digest, which format "
                                     f"{m.format_version} requires: the manifest is damaged")
            unbound = True
    for t in m.tensors:
        for p in t.pieces:
            if p.array.startswith(own):
                continue
            owner = manifests.get(p.array[len(DATA_PREFIX):].split("/", 1)[0])
            if owner is None or (p.array, p.offset, volume(p.box[1])) not in _stored_pieces(owner, stored):
                report.errors.append(f"version {vid[:12]}: tensor {t.name} points into {p.array} at element "
                                     f"{p.offset}, where {'no version' if owner is None else 'its version'} "
                                     f"stored a piece of that size: the manifest is damaged")
    return unbound


def _stored_pieces(m: Manifest, cache: dict[str, set[tuple[str, int, int]]]) -> set[tuple[str, int, int]]:
    """(array, offset, elements) of every piece version ``m`` wrote into its own arrays (kept in ``cache``)."""
    got = cache.get(m.id)
    if got is None:
        own = f"{DATA_PREFIX}{m.id}/"
        got = cache[m.id] = {(p.array, p.offset, volume(p.box[1]))
                                for t in m.tensors for p in t.pieces if p.array.startswith(own)}
    return got


def _raise_if_unreachable(err: Exception, what: str) -> None:
    """A store that stopped answering ends the check with a StorageError: reporting every object it could not
    read as damaged would be false."""
    if is_storage_failure(reason := first_line(err)):
        raise storage_failure(what, reason) from err
