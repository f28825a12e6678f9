"""Repository check: read every object, verify every checksum and every reference.

Errors are things that make a committed version unloadable or a ref dangling.
Warnings are harmless leftovers (data of an interrupted snapshot, manifests no
ref reaches) that ``gc`` collects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ckptrepo.core._boxes import check_coverage, volume
from ckptrepo.core._manifest import DATA_PREFIX, PRUNED_PREFIX, VERSIONS_PREFIX
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core._refs import head_branch_lost, head_ref_blocked
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CkptRepoError, first_line, is_storage_failure, some_names, storage_failure
from ckptrepo.maintenance._gc import data_version_ids, pruned_ids, reachable_versions, ref_targets
from ckptrepo.storage._arrays import StoredShards, open_array

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
        starts = ref_targets(plumbing)
    except CkptRepoError:   # a damaged ref: _check_refs names it, and reaches through the others
        starts = []
    manifests: dict[str, Manifest] = {}
    for vid, m in plumbing.iter_manifests(plumbing.all_version_ids()):
        if isinstance(m, Manifest):
            manifests[vid] = m
        elif plumbing.store.exists(VERSIONS_PREFIX + vid):
            report.errors.append(str(m))
    _check_refs(plumbing, manifests, report, starts)
    report.versions = len(manifests)
    pruned = pruned_ids(plumbing)
    if on_total is not None:   # gc deleted a pruned version's data on purpose: it is not read
        on_total(sum(a.nbytes for vid, m in manifests.items() if vid not in pruned for a in m.arrays.values()))
    for vid, m in manifests.items():
        for p in m.parents:
            if p not in manifests:
                report.errors.append(f"version {vid[:12]}: parent {p[:12]} is missing ({VERSIONS_PREFIX}{p})")
        if vid not in pruned:
            before = len(report.errors)
            _check_version_data(plumbing, vid, m, report, on_bytes)
            if len(report.errors) > before and plumbing.store.exists(PRUNED_PREFIX + vid):
                del report.errors[before:]   # pruned by a gc running meanwhile: its data was deleted on purpose

    reachable = reachable_versions(starts, {vid: m.parents for vid, m in manifests.items()})
    for vid in sorted(set(manifests) - reachable):
        report.warnings.append(f"version {vid[:12]} is not reachable from any branch or tag "
                               f"(an interrupted or abandoned snapshot); gc will remove it")
    for f in plumbing.failures():
        report.warnings.append(f"snapshot {f['id'][:12]} (step {f.get('step')}) failed and was not committed: "
                               f"{f.get('error')}")
    data_ids = data_version_ids(plumbing)
    limbo = sorted(pruned & data_ids & set(manifests))
    if limbo:
        shown = ", ".join(v[:12] for v in limbo[:3]) + (" ..." if len(limbo) > 3 else "")
        report.warnings.append(f"{len(limbo)} version(s) marked pruned still hold data ({shown}): a gc was "
                               f"interrupted after marking them; they do not load, and `ckptrepo gc` finishes "
                               f"deleting their data")
    referenced = {p for m in manifests.values() for p in m.parents} | set(starts)
    for vid in sorted(data_ids - set(manifests)):
        if vid in referenced:   # its manifest was lost (an error above), not an interrupted snapshot's leftover
            report.warnings.append(f"{DATA_PREFIX}{vid}/ is the data of version {vid[:12]}, whose manifest is "
                                   f"missing: it cannot be loaded without it (gc refuses to run until that is "
                                   f"resolved)")
        else:
            report.warnings.append(f"{DATA_PREFIX}{vid}/ has no manifest (an interrupted snapshot); gc will remove it")
    return report


def _check_refs(plumbing: Plumbing, manifests: dict[str, Manifest], report: FsckReport, starts: list[str]) -> None:
    """Every ref's version must exist; one committed since the listing is read into ``manifests`` (with its
    ancestors the listing lacks), not reported. The versions the readable refs name are added to ``starts``."""
    def missing(vid: str | None) -> bool:
        tip = True
        while vid is not None and vid not in manifests:
            if not plumbing.store.exists(VERSIONS_PREFIX + vid):
                return tip          # an ancestor's absence is reported as a missing parent below
            try:
                manifests[vid] = plumbing.manifest(vid)
            except CkptRepoError as err:
                report.errors.append(str(err))
                return False
            tip, vid = False, next(iter(manifests[vid].parents), None)
        return False

    for kind in ("branch", "tag"):
        targets, damage = plumbing.refs.read_all(kind, strict=False)
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
        return
    if manifests and head.branch is not None and head_ref_blocked(plumbing.store, head):
        report.errors.append(head_branch_lost(head.branch, len(manifests)))
    if head.branch is None and missing(head.version):
        report.errors.append(f"HEAD points at missing version {str(head.version)[:12]}")
    elif head.version is not None:
        starts.append(head.version)


def _check_version_data(plumbing: Plumbing, vid: str, m: Manifest, report: FsckReport,
                        on_bytes: Callable[[int], None] | None) -> None:
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
        try:
            arr = open_array(plumbing.store, info)
        except Exception as err:  # noqa: BLE001
            _raise_if_unreachable(err, f"opening array {key}")
            report.errors.append(f"version {vid[:12]}: array {key} cannot be opened: {first_line(err)}")
            continue
        stored, missing = StoredShards(plumbing.store, info), 0
        present = stored.present()
        for s in info.shards():
            lo, hi = s * info.shard_elems, min(info.numel, (s + 1) * info.shard_elems)
            # looked at before it is read: a FIFO would block the read, and a shard or index larger than the
            # object would be allocated in full first
            problem = "missing" if s not in present else stored.problem(s)
            if problem is not None:
                missing += 1
                if missing <= MISSING_SHARDS_NAMED:
                    names = [t.name for t in m.tensors for p in t.pieces
                             if p.array == key and p.offset < hi and p.offset + volume(p.box[1]) > lo]
                    what = "missing" if problem == "missing" else f"corrupt ({problem})"
                    report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} is {what}; "
                                         f"tensors: {some_names(names)}")
            else:
                try:
                    arr[lo:hi].read().result()
                except Exception as err:  # noqa: BLE001
                    _raise_if_unreachable(err, f"reading {info.shard_key(s)}")
                    names = [t.name for t in m.tensors for p in t.pieces
                             if p.array == key and p.offset < hi and p.offset + volume(p.box[1]) > lo]
                    report.errors.append(f"version {vid[:12]}: object {info.shard_key(s)} is corrupt or missing "
                                         f"({first_line(err)}); tensors: {some_names(names)}")
            report.objects += 1
            nbytes = (hi - lo) * info.itemsize
            report.bytes += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
        if missing > MISSING_SHARDS_NAMED:
            report.errors.append(f"version {vid[:12]}: array {key} lacks {missing - MISSING_SHARDS_NAMED} more of "
                                 f"its {len(info.shards())} declared shard objects, or holds them damaged")


def _raise_if_unreachable(err: Exception, what: str) -> None:
    """A store that stopped answering ends the check with a StorageError: reporting every object it could not
    read as damaged would be false."""
    if is_storage_failure(reason := first_line(err)):
        raise storage_failure(what, reason) from err
