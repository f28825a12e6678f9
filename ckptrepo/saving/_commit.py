"""Committing snapshots: a version exists once its manifest is written and its branch moved onto it.

The snapshotter's commit thread hands each job here, in snapshot order, once
its data is durable. A single process writes the manifest and moves the
branch by compare-and-swap (a branch moved by someone else meanwhile is a
ConflictError and nothing is committed). A distributed snapshot commits in
two phases (parallel/_distributed.py): every rank publishes its part, rank 0 merges
and checks them, writes the manifest, moves the branch and publishes the
outcome the other ranks wait for; a failure on any rank reaches them all.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable

from ckptrepo import faults
from ckptrepo.core import (
    DATA_PREFIX,
    FAILURES_PREFIX,
    FORMAT_VERSION,
    VERSIONS_PREFIX,
    Head,
    Plumbing,
    Version,
    collection_paused,
    first_parent_chain,
    lost_head_branch,
    mark_evicted,
    seal,
)
from ckptrepo.core.schema import (
    SINGLE_PROCESS_LAYOUT,
    Manifest,
    ManifestHeader,
    Piece,
    RankFailure,
    RankPart,
    TensorEntry,
    TensorStatsRecord,
    decode_manifest,
    encode_manifest,
    version_from_manifest,
)
from ckptrepo.errors import (
    CkptRepoError,
    ConflictError,
    DetachedHeadError,
    RefError,
    SnapshotFailedError,
    first_line,
)
from ckptrepo.maintenance import collected_while_committing, own_arrays, undo_collected_commit
from ckptrepo.parallel import GroupHealth, Staging, check_replicas, merge_rank_manifests
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.saving._dedup import DedupIndex, StoredTensor
from ckptrepo.saving._snapshot_job import SnapshotJob
from ckptrepo.saving._startup import Cluster
from ckptrepo.saving._tensor_stats import piece_moments, stats_record
from ckptrepo.saving._writer import WritePlan
from ckptrepo.state import TensorRecord
from ckptrepo.storage import ArrayInfo, write_table

log = logging.getLogger("ckptrepo")


class Committer:
    """Commits one snapshotter's versions on the branch HEAD named when it was made, each on top of the last.

    The branch tip and its generation are read once here and then only moved
    by this committer: a snapshot is written on top of the tip it knew, and the
    compare-and-swap fails if the branch moved in between.
    """

    def __init__(self, plumbing: Plumbing, layout: ParallelLayout | None, rank: int, world_size: int, sharded: bool,
                 commit_timeout_s: float, cluster: Cluster | None = None) -> None:
        base = read_branch_base(plumbing)
        # the commit thread's own connection to the ranks' store: its waits never hold up the training thread's
        self.kv = cluster.kv.connection() if cluster is not None else None
        self.cluster = cluster
        self._answered: str | None = None   # rank 0: the last version whose verdict every rank will have read
        self._last_verdict: str | None = None   # rank 0: the last verdict it published (what closing waits on)
        self._read: str | None = None   # the other ranks: the last verdict they told rank 0 they had read
        self._published: Manifest | None = None   # the manifest of the last version this committer wrote
        self.plumbing = plumbing
        self.layout = layout
        self.rank, self.world_size = rank, world_size
        self.distributed = world_size > 1
        self.sharded = sharded
        self.commit_timeout_s = commit_timeout_s
        # shared by this snapshotter's commits and meetings: a broken group fails them all at once
        self.health = GroupHealth(cluster.kv.connection() if cluster is not None else None)
        self.branch, self.orphan, self.tip, self.generation = base.branch, base.orphan, base.tip, base.generation
        self.conflict: str | None = None   # set once another writer moved the branch under this snapshotter
        # the snapshotter's dedup index (set by it once made: it compares with this committer's tip first)
        self.dedup: DedupIndex | None = None
        faults.point("after_read_head")

    def commit(self, job: SnapshotJob) -> Version:
        """Commit the job's version (its data is durable): its arrays' chunk tables, then its manifest and the
        branch; raises if it cannot be, and then nothing is visible."""
        job.arrays = {d: write_table(self.plumbing.store, info, job.chunk_crcs[d]) for d, info in job.arrays.items()}
        if self.dedup is not None and job.reused:
            self.dedup.check_reused(self.plumbing.store, job, arrays_listed({}, job.reused))
        version = self._commit_sharded(job) if self.sharded or job.sharded else self._commit_single(job)
        if self.dedup is not None:
            self.dedup.remember(job)
        return version

    def _commit_single(self, job: SnapshotJob) -> Version:
        assert job.plan is not None
        manifest = build_manifest(job.vid, self.tip, job.handle.step, job.message, job.metrics, job.records,
                                  job.plan, job.arrays, job.skeleton, written=job.written, reused=job.reused,
                                  meta=job.meta, tensor_stats=stats_record(job),
                                  digests=[job.stored_digest(i) for i in range(len(job.records))])
        return self._publish(job, manifest)

    def _commit_sharded(self, job: SnapshotJob) -> Version:
        """Two-phase commit: publish this rank's part; rank 0 merges, checks and commits (see parallel/_distributed.py).

        A single process (a layout named without torch.distributed) is the only
        rank: its part is merged and checked the same way, without the handshake
        objects in the store.
        """
        assert job.plan is not None
        part = RankPart(
            rank=self.rank, step=job.handle.step, tree=job.skeleton, leaf_names=tuple(job.leaf_names),
            names=tuple((name, dtype, tuple(shape)) for name, dtype, shape in job.names),
            coords=vars(self.layout.coords(self.rank)) if self.layout is not None else None,
            tensors=tuple((r.name, (piece,)) for r, piece in zip(job.records, rank_pieces(job)) if piece is not None),
            arrays=arrays_listed(job.arrays, job.reused), fingerprints=tuple(job.fingerprints),
            moments=piece_moments(job))
        if not self.distributed:
            return self._publish_merged(job, [part])
        staging = self._staging(job.vid)
        staging.publish_rank(part)
        if self.rank != 0:
            try:
                return self._hear_verdict(job, staging)
            finally:
                staging.done_reading()
                self._read = job.vid
        try:
            parts = staging.gather_ranks()
            if self._answered is not None:   # every rank has published this part: each read that verdict
                self._staging(self._answered).forget_outcome(len(self.cluster.nodes) if self.cluster else 0)
            version = self._publish_merged(job, parts)
        except BaseException as err:
            staging.publish_outcome(first_line(err))
            self._last_verdict = job.vid
            raise
        multi = self.cluster is not None and self.cluster.multi_node
        manifest = self._published   # as written: not read back and decoded again
        assert manifest is not None
        staging.publish_outcome(None, manifest, encode_manifest(manifest) if multi else None)
        self._answered = self._last_verdict = job.vid
        return version

    def _moved(self, vid: str) -> Callable[[bytes | None], None]:
        """What follows the move of this committer's branch onto ``vid``: its new tip and generation (None:
        another writer already committed on top of it, so this committer commits nothing more)."""
        def moved(generation: bytes | None) -> None:
            self.tip = vid
            if generation is not None:
                self.generation = generation
            else:   # committed, and another writer committed on top of it before this one read the branch back
                self.conflict = (f"branch {self.branch!r} moved on past version {vid[:12]} (another writer "
                                 f"committed on top of it), so this snapshotter commits nothing more to it: load "
                                 f"the branch tip and snapshot with a new snapshotter, or give each writer a "
                                 f"branch of its own")

        return moved

    def _here(self, array: str) -> bool:
        """Whether this repository holds ``array`` of a version it commits: on a node-local tier, only the
        arrays of its node's ranks (``data/<id>/<rank>/<dtype>``)."""
        if self.cluster is None or not self.cluster.multi_node:
            return True
        rank = array.split("/")[2] if array.count("/") == 3 else ""
        return rank.isdigit() and self.cluster.node_of.get(int(rank)) == self.cluster.node

    def _hear_verdict(self, job: SnapshotJob, staging: Staging) -> Version:
        """A rank other than 0: rank 0's verdict, and on another node than its, the version on this node's
        branch (its leader commits it there; the others wait for that)."""
        header = staging.wait_outcome(lambda: self._on_branch(job.vid))
        cluster = self.cluster
        if cluster is not None and cluster.multi_node and cluster.node != cluster.node_of[0]:
            if cluster.leader:
                try:
                    return self._follow(job, staging)
                finally:   # the node's other ranks wait for it: the version is on their branch, or failed
                    staging.followed(cluster.node)
            # so that after wait() this rank's branch names it
            staging.wait_followed(cluster.node, cluster.nodes[cluster.node][0])
        if header is None:   # rank 0 died after moving the ref: the version is read back from the branch
            return version_from_manifest(self.plumbing.manifest(job.vid), (self.branch,))
        return Version(id=header["id"], parents=tuple(header["parents"]), step=header["step"],
                       time=header["time"], message=header["message"], metrics=dict(header["metrics"]),
                       size=header["size"], refs=(self.branch,), meta=dict(header["meta"] or {}))

    def wait_readers(self) -> None:
        """Rank 0, closing: every other rank has read its last verdict (rank 0's process may serve the ranks'
        store, and its end would cut them off mid-read). Skipped once the group is known broken; a rank that
        does not answer within the deadline is logged, not raised: its versions are committed or not already."""
        if self.rank != 0 or self.kv is None or self._last_verdict is None:
            return
        try:
            self.health.check()
            self._staging(self._last_verdict).wait_readers()
        except SnapshotFailedError as err:
            log.warning("ckptrepo: closing without every rank's word: %s", first_line(err))

    def _staging(self, vid: str) -> Staging:
        assert self.kv is not None
        return Staging(self.kv, vid, self.world_size, self.commit_timeout_s, self.health)

    def _follow(self, job: SnapshotJob, staging: Staging) -> Version:
        """The leader of another node than rank 0's: rank 0 committed the version; commit it on this node's
        repository too (its data here is this node's ranks'; the rest is read from the remote), so that this
        node's history is rank 0's."""
        assert self.cluster is not None and self.cluster.remote is not None
        manifest = decode_manifest(staging.manifest(), job.vid)
        remote = self.cluster.remote

        def moved_away(now: str | None) -> str:
            self.conflict = (f"branch {self.branch!r} of this node moved to {str(now)[:12]} (another writer) "
                             f"while rank 0 committed {job.vid[:12]}; this node commits nothing more to it")
            return self.conflict

        return publish_version(self.plumbing, BranchBase(self.branch, self.tip, self.generation, self.orphan),
                               manifest, moved_away, before_ref=lambda m: mark_evicted(self.plumbing.store,
                                                                                        m.id, remote, spread=True),
                               on_moved=self._moved(job.vid), refuse_existing=False, here=self._here)

    def _on_branch(self, vid: str, depth: int = 1000) -> bool:
        """Whether ``vid`` is on this snapshotter's branch: its tip or one of its last ``depth`` first parents."""
        tip = self.plumbing.refs.branch_tip(self.branch)
        return vid in islice(first_parent_chain(tip, self.plumbing.first_parent), depth)

    def _publish_merged(self, job: SnapshotJob, ranks: list[RankPart]) -> Version:
        """Rank 0: merge and check every rank's part into the version manifest, then publish it."""
        steps = {p.rank: p.step for p in ranks}
        other = next((r for r, s in steps.items() if s != job.handle.step), None)
        if other is not None:   # the version would record rank 0's step for every rank's state
            raise SnapshotFailedError(f"the ranks disagree about the step: rank {self.rank} snapshots step "
                                      f"{job.handle.step}, rank {other} step {steps[other]}; pass every rank the "
                                      f"same step")
        # one bounded call that builds the version's tables from every rank's parts: with the collector on,
        # the objects it keeps set off collections that walk them (docs/decisions/008-gc-pause.md)
        with collection_paused():
            check_replicas(ranks)
            header = version_header(job.vid, self.tip, job.handle.step, job.message, job.metrics, job.meta)
            manifest = merge_rank_manifests(ranks, self.layout, self.world_size, header)
        return self._publish(job, manifest)

    def _publish(self, job: SnapshotJob, manifest: Manifest) -> Version:
        """Write the manifest, then move the branch: the version exists once the ref moved."""
        if self.conflict is not None:
            raise ConflictError(f"version {job.vid[:12]} was not committed: {self.conflict}")
        job.handle.stats.total_s = time.perf_counter() - job.started  # up to the manifest; updated after the ref
        manifest = self._published = manifest.with_stats(job.handle.stats.to_json())
        parent = self.tip
        base = f"version {parent[:12]}" if parent else "an empty branch"

        def moved_away(now: str | None) -> str:
            # every later snapshot of this snapshotter was taken from the diverged state too (those in flight
            # already): none may go on top of the other writer's version, so none is committed
            self.conflict = (f"branch {self.branch!r} moved to {str(now)[:12]} (another writer) while this "
                             f"snapshotter wrote on top of {base}, so it commits nothing more to it: load the branch "
                             f"tip and snapshot with a new snapshotter, or give each writer a branch of its own")
            return self.conflict

        def undone(message: str, generation: bytes | None) -> None:
            if generation is not None:
                self.tip, self.generation = parent, generation
            else:
                self.conflict = message

        def before_ref(m: Manifest) -> None:
            self._recheck_reused(job, m)
            if self.cluster is not None and self.cluster.multi_node:   # the other nodes' data: on the remote
                assert self.cluster.remote is not None
                mark_evicted(self.plumbing.store, m.id, self.cluster.remote, spread=True)

        # a manifest already there is this commit's own (a retried put whose reply was lost): version ids are new
        return publish_version(self.plumbing, BranchBase(self.branch, parent, self.generation, self.orphan),
                               manifest, moved_away, before_ref=before_ref,
                               on_moved=self._moved(job.vid), on_undone=undone, refuse_existing=False,
                               here=self._here)

    def _recheck_reused(self, job: SnapshotJob, manifest: Manifest) -> None:
        """Between the manifest and the ref: the reused arrays again, every rank's (those of the manifest that
        are not this version's own). A prune that began meanwhile either reads this manifest (and keeps what it
        reuses) or has its intent seen here (maintenance/_gc.py prune_version)."""
        own = f"{DATA_PREFIX}{job.vid}/"
        reused = {k: a for k, a in manifest.arrays.items() if not k.startswith(own)}
        if self.dedup is not None and reused:
            self.dedup.check_reused(self.plumbing.store, job, reused, announced=True)

    def publish_failure(self, job: SnapshotJob, err: BaseException) -> None:
        """Distributed: let the other ranks know at once (rank 0 aborts the version; the others stop waiting)."""
        if self.kv is None:
            return
        staging = Staging(self.kv, job.vid, self.world_size, self.commit_timeout_s)
        try:
            if self.rank == 0:
                staging.publish_outcome(first_line(err))
                self._last_verdict = job.vid
            else:
                staging.publish_rank(RankFailure(self.rank, first_line(err)))
                if self._read != job.vid:   # it will not read the verdict: rank 0 need not wait for it
                    staging.done_reading()
        except CkptRepoError as publish_err:
            log.error("ckptrepo: could not publish the failure of %s: %s", job.vid[:12], publish_err)

    def record_failure(self, job: SnapshotJob, cause: str) -> None:
        """Write the failure record that `ckptrepo log --all` and fsck show (rank 0 only, best effort)."""
        if self.rank != 0:
            return
        try:
            self.plumbing.store.put(FAILURES_PREFIX + job.vid, seal({
                "id": job.vid, "step": job.handle.step, "time": time.time(), "branch": self.branch,
                "message": job.message, "error": cause}))
        except Exception as record_err:  # noqa: BLE001 - storage may be what failed; the caller's log line remains
            log.error("ckptrepo: could not record the failure of %s: %s", job.vid[:12], record_err)


def refuse_new_root(plumbing: Plumbing, branch: str, orphan: bool) -> None:
    """Refuse a first snapshot on ``branch`` (it has no versions) that would start a new root history in a
    repository that has versions, unless HEAD is an orphan checkout (``checkout --orphan``): the branch's ref
    was lost, deleted, or HEAD names another branch than it should (a damaged byte, a name with a trailing
    newline), and a job resuming from HEAD would start over from scratch, the history out of reach."""
    lost = lost_head_branch(plumbing.store, Head(branch, None, b"", orphan=orphan))
    if lost is not None:
        raise RefError(f"not snapshotting: it would start a new history (no parent) on branch {branch!r}; {lost}")


@dataclass(frozen=True)
class BranchBase:
    """The branch a version goes on and the tip (and its generation) it is committed on top of."""

    branch: str
    tip: str | None
    generation: bytes
    orphan: bool


def read_branch_base(plumbing: Plumbing, branch: str | None = None) -> BranchBase:
    """The branch a new version goes on (``branch``, default HEAD's) and its tip now: what a committer, or
    ``commit_chunks``, moves it from. Read it when the save starts, so that a branch moved during the save is a
    conflict."""
    plumbing.require_atomic_store()   # refused before any data is written, not at the first commit
    head = plumbing.refs.head()
    name = branch if branch is not None else head.branch
    if name is None:
        raise DetachedHeadError(f"HEAD is detached at {str(head.version)[:12]}; create a branch there first: "
                                f"repo.checkout(rev, branch=NAME) or `ckptrepo checkout REV -b NAME`")
    tip, generation = plumbing.refs.branch_tip_with_generation(name)
    orphan = head.orphan and head.branch == name
    if tip is None and branch is None:
        refuse_new_root(plumbing, name, orphan)
    return BranchBase(name, tip, generation, orphan)


def publish_version(plumbing: Plumbing, base: BranchBase, manifest: Manifest, moved_away: Callable[[str | None], str],
                    *, before_ref: Callable[[Manifest], None] | None = None,
                    on_moved: Callable[[bytes | None], None] | None = None,
                    on_undone: Callable[[str, bytes | None], None] | None = None,
                    refuse_existing: bool = True, here: Callable[[str], bool] | None = None) -> Version:
    """Commit ``manifest`` on ``base``: the manifest written create-only, then the branch moved from
    ``base.tip`` by compare-and-swap; the version exists once the ref moved. Every commit goes through here:
    a snapshotter's (``Committer``) and a framework-coordinated save's (saving/_pieces.py).

    A branch that moved since ``base`` is a ConflictError whose reason ``moved_away(tip now)`` words;
    ``before_ref(manifest)`` runs between the manifest and the ref (dedup's recheck), ``on_moved(generation)``
    right after the ref moved (None: another writer already committed on top of it). A version whose data a
    concurrent gc deleted meanwhile is taken off the branch again (maintenance/_lost.py), ``on_undone(why,
    generation the branch has now or None)`` told, and SnapshotFailedError raised. ``refuse_existing``: a
    manifest already there is a ConflictError (False: it is this commit's own, put again). ``here``: which of
    the version's own arrays this repository holds (a node-local tier's: its node's ranks'; default all)."""
    vid = manifest.id
    created = plumbing.store.put_if_absent(VERSIONS_PREFIX + vid, encode_manifest(manifest))
    if not created and refuse_existing:
        raise ConflictError(f"version {vid[:12]} already exists; a save commits a version once")
    faults.point("after_manifest")
    if before_ref is not None:
        before_ref(manifest)
    moved = plumbing.refs.move_branch(base.branch, vid, base.generation, base.tip, plumbing.first_parent)
    if moved is None:
        why = moved_away(plumbing.refs.branch_tip(base.branch))
        raise ConflictError(f"version {vid[:12]} was not committed: {why}")
    if on_moved is not None:
        on_moved(moved.generation)
    faults.point("after_ref")
    deleted = collected_while_committing(plumbing, vid, [a for a in own_arrays(manifest) if here is None or here(a)])
    if deleted is not None:
        message, generation = undo_collected_commit(plumbing, base.branch, vid, base.tip, moved.generation, deleted)
        if on_undone is not None:
            on_undone(message, generation)
        raise SnapshotFailedError(message)
    if base.tip is None and base.orphan:
        try:
            plumbing.refs.settle_orphan(base.branch)
        except CkptRepoError as err:   # committed all the same; HEAD still reads as this branch
            log.warning("ckptrepo: HEAD still says orphan of branch %r: %s", base.branch, err)
    plumbing.remember_header(manifest)
    return version_from_manifest(manifest, (base.branch,))


def version_header(vid: str, parent: str | None, step: int | None, message: str,
                   metrics: dict[str, Any], meta: dict[str, str] | None = None) -> ManifestHeader:
    """The fields every version manifest starts with, single-process or merged from ranks (docs/format.md);
    ``size`` is the merge's or ``build_manifest``'s to fill in."""
    return ManifestHeader(format_version=FORMAT_VERSION, id=vid, parents=(parent,) if parent else (), step=step,
                          time=time.time(), message=message, metrics=metrics, host=socket.gethostname(), size=0,
                          meta=meta)


def rank_pieces(job: SnapshotJob) -> list[Piece | None]:
    """A sharded job's piece of each record, written or reused, with its digest (None: no element)."""
    assert job.plan is not None
    out: list[Piece | None] = []
    for i, box in enumerate(job.boxes):
        box = (tuple(box[0]), tuple(box[1]))
        prev = job.reused.get(i)
        if prev is not None:
            out.append(Piece(box, prev.array, prev.offset, prev.digest))
            continue
        p = job.plan.placements[job.plan_index[i]]
        out.append(Piece(box, job.arrays[p.dtype].key, p.offset, job.stored_digest(i)) if p.numel else None)
    return out


def arrays_listed(arrays: dict[str, ArrayInfo], reused: dict[int, StoredTensor]) -> dict[str, ArrayInfo]:
    """By key, the arrays a version's pieces point into: those it wrote (``arrays``, by dtype), and those of the
    pieces it reuses."""
    listed = {a.key: a for a in arrays.values()}
    for s in reused.values():
        if s.array not in listed:
            listed[s.array] = ArrayInfo.from_json(s.array, s.info)
    return listed


def build_manifest(vid: str, parent: str | None, step: int | None, message: str, metrics: dict[str, Any],
                   records: list[TensorRecord], plan: WritePlan, arrays: dict[str, ArrayInfo],
                   skeleton: Any, written: list[int] | None = None,
                   reused: dict[int, StoredTensor] | None = None, meta: dict[str, str] | None = None,
                   tensor_stats: TensorStatsRecord | None = None,
                   digests: list[bytes | None] | None = None) -> Manifest:
    """The version manifest for a single-process snapshot (see docs/format.md).

    ``plan`` covers the ``written`` records (default: all); a ``reused`` record's
    piece points at bytes an earlier version stored, and that array is listed
    in ``arrays`` too. ``size`` counts only the bytes this version wrote.
    ``digests``: per record, the content digest of its stored bytes, if taken.
    """
    reused = reused or {}
    placement = dict(zip(range(len(records)) if written is None else written, plan.placements))
    listed = arrays_listed(arrays, reused)

    def pieces(i: int, r: TensorRecord) -> tuple[Piece, ...]:
        box = ((0,) * len(r.shape), tuple(r.shape))
        digest = digests[i] if digests is not None else None
        if i in reused:
            return (Piece(box, reused[i].array, reused[i].offset, digest),)
        p = placement[i]
        return (Piece(box, arrays[p.dtype].key, p.offset, digest),) if p.numel else ()

    header = version_header(vid, parent, step, message, metrics, meta)
    return Manifest.of(header, size=plan.nbytes, layout=SINGLE_PROCESS_LAYOUT, arrays=listed,
                       tensors=tuple(TensorEntry(r.name, r.dtype, tuple(r.shape), pieces(i, r))
                                     for i, r in enumerate(records)),
                       tree=skeleton, tensor_stats=tensor_stats)
