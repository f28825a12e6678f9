"""What a snapshot is before the stages run: its write plan, and for a sharded state its pieces and the one
collective that agrees on them.

``Planner.plan`` runs in ``snapshot()`` or, once dedup has decided what to write, in the capture stage;
either way before any segment is queued. ``Sharding`` runs in ``snapshot()``: every rank calls it the same
number of times, and a rank whose own checks failed still joins the collective, so that every rank raises
at the same call instead of waiting in it until its timeout.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

from ckptrepo.core import DATA_PREFIX, new_version_id, volume
from ckptrepo.errors import LayoutError, SnapshotFailedError, first_line
from ckptrepo.parallel import GroupHealth, Piece, ShardedState, Sharder, all_gather, assign_writers, column_blocks
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.saving._dedup import DedupIndex, dedup_key, piece_id
from ckptrepo.saving._snapshot_job import SnapshotHandle, SnapshotJob
from ckptrepo.saving._tensor_stats import stat_feeds
from ckptrepo.saving._writer import PlanCache, live_residues
from ckptrepo.state import TensorRecord, is_dtensor
from ckptrepo.storage import INNER_BYTES, ArrayInfo


class Planner:
    """Plans one snapshotter's jobs: which segments of which arrays its written records go to."""

    def __init__(self, plans: PlanCache, shard_bytes: int, rank: int, compression: str | None,
                 tensor_stats: bool) -> None:
        self.plans, self.shard_bytes, self.rank = plans, shard_bytes, rank
        self.compression, self.tensor_stats = compression, tensor_stats

    def plan(self, job: SnapshotJob, written: list[int]) -> None:
        """Plan the records to write (all but the reused ones) and account for their segments."""
        records = [job.records[i] for i in written]
        residues = live_residues(records, INNER_BYTES) if job.live else None
        plan = self.plans.get(records, self.shard_bytes, residues)
        job.written = written
        job.plan_index = {ri: pi for pi, ri in enumerate(written)}
        job.arrays = {d: ArrayInfo(f"{DATA_PREFIX}{job.vid}/{self.rank}/{d}", d, n, s, i,
                                   compression=self.compression)
                      for d, (n, s, i) in plan.streams.items()}
        job.chunk_crcs = {d: np.zeros(info.chunks, dtype="<u4") for d, info in job.arrays.items()}
        # CUDA tensors were hashed on their device before (DedupIndex.decide): nothing of theirs is hashed here
        job.hashers = {pi: xxhash.xxh3_128() for pi, ri in enumerate(written)
                       if ri in job.watch and not job.records[ri].tensor.is_cuda}
        # statistics of each whole tensor a single-process snapshot writes (pieces of global tensors: none)
        job.stats, job.feeds = stat_feeds(job, records, job.hashers) if self.tensor_stats else ({}, dict(job.hashers))
        job.handle.stats.bytes = plan.nbytes
        job.remaining = len(plan.segments)
        job.plan = plan
        if job.remaining == 0:
            job.data_done.set()


class JobMaker:
    """Turns a flattened state into the ``SnapshotJob`` the stages run: its version id (agreed by the ranks
    when sharded), its records (this rank's pieces when sharded), dedup's keys, and its plan unless dedup
    may reuse something (then the capture stage plans it once dedup has decided)."""

    def __init__(self, planner: Planner, sharding: Sharding, dedup: DedupIndex | None, live: bool,
                 tensor_stats: bool) -> None:
        self.planner, self.sharding, self.dedup = planner, sharding, dedup
        self.live = live   # a CPU state may be written from where it is (a local store with O_DIRECT)
        self.tensor_stats = tensor_stats

    def keys(self, records: list[TensorRecord], sharded: bool) -> tuple[list[Any], list[Any]]:
        """Dedup's keys and piece ids of an unsharded state's records: taken of the live tensors, before
        ``snapshot()`` copies any (a sharded state's come with its pieces, in ``make``)."""
        if self.dedup is None or sharded:
            return [], []
        return ([dedup_key(r) for r in records],
                [piece_id(r.name, ((0,) * len(r.shape), r.shape)) for r in records])

    def make(self, skeleton: Any, records: list[TensorRecord], local: tuple[ShardedState, list[Piece]] | None,
             keys: list[Any], ids: list[Any], started: float, step: int | None, message: str,
             metrics: dict[str, Any], meta: dict[str, str] | None, tag: str | None, force_tag: bool) -> SnapshotJob:
        vid = new_version_id()
        leaf_names: list[str] = []
        names: list[Any] = []
        boxes: list[Any] = []
        if local is not None:
            vid, records, boxes, leaf_names, names = self.sharding.shard(records, local)
            if self.dedup is not None:   # of this rank's pieces (views of the live tensors)
                keys = [dedup_key(r) for r in records]
                ids = [piece_id(r.name, box) for r, box in zip(records, boxes)]
        job = SnapshotJob(SnapshotHandle(vid, step), skeleton, records, None, message, metrics, started=started,
                          sharded=local is not None, record_stats=self.tensor_stats, meta=meta, tag=tag,
                          force_tag=bool(force_tag), leaf_names=leaf_names, names=names, boxes=boxes, keys=keys,
                          ids=ids, replicas=[] if local is None else [(p.name, p.box, p.view, p.replicated)
                                                                      for p in local[0].pieces if p.replicated])
        # a CPU state to a local store with O_DIRECT is written from where it is (not for CUDA tensors: their
        # bytes must come to the host anyway, and whole-segment DMAs into pinned staging are the cheap way)
        job.live = self.live and not any(r.tensor.is_cuda for r in records)
        if self.dedup is None or not self.dedup.match(job):
            self.planner.plan(job, list(range(len(records))))   # nothing can be reused: plan here, as without dedup
        for dev in {r.tensor.device for r in records if r.tensor.device.type == "cuda"}:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            job.ready.append(ev)
        return job


class Sharding:
    """A sharded snapshot's pieces: this rank's part of each global tensor, and which rank writes each."""

    def __init__(self, layout: ParallelLayout | None, rank: int, world_size: int, group: Any,
                 health: GroupHealth) -> None:
        self.layout, self.rank, self.world_size, self.group = layout, rank, world_size, group
        self.health = health   # the snapshotter's commits': a collective that fails marks it broken

    def local_pieces(self, records: list[TensorRecord]) -> tuple[ShardedState, list[Piece]]:
        """This rank's pieces of the global tensors (raises here, before the collective, for a state that does
        not fit the layout)."""
        # without a layout (DTensor placements say what each rank holds) every rank is its own data-parallel slot
        layout = self.layout or ParallelLayout(dp=self.world_size)
        sharded = Sharder(layout, self.rank, self.rank).shard(records)
        return sharded, column_blocks(sharded.pieces)

    def exchange(self, meta: list[tuple[str, Any, int]] | None, failure: Exception | None = None) -> list[Any]:
        """The one collective of a distributed snapshot: every rank's (proposed version id, piece metadata),
        or with ``failure`` this rank's error in place of its metadata."""
        mine = (new_version_id(), meta) if failure is None else \
            (None, f"{type(failure).__name__}: {first_line(failure)}")
        try:
            gathered = all_gather(mine, self.group) if self.world_size > 1 else [mine]
        except Exception as err:   # gloo's "Connection closed by peer": a rank died
            cause = f"the snapshot collective failed: {first_line(err)}"
            self.health.mark_broken(cause)   # the snapshots in flight fail now, not at their timeouts
            raise SnapshotFailedError(f"{cause}; a rank died or the process group is down: restart every rank and "
                                      f"resume from the last committed version") from err
        refused = [(r, g[1]) for r, g in enumerate(gathered) if g[0] is None]
        if refused and failure is None:
            r, why = refused[0]
            raise SnapshotFailedError(f"rank {r} refused this snapshot ({why}); no version was written, "
                                      f"fix the state on that rank")
        return gathered

    def shard(self, records: list[TensorRecord], local: tuple[ShardedState, list[Piece]]) -> \
            tuple[str, list[TensorRecord], list[Any], list[str], list[list[Any]]]:
        """This rank's pieces, the agreed version id, and which pieces this rank writes: (version id, the
        records it writes, their boxes, the stored name of each state tensor, [name, dtype, global shape] of
        each tensor it holds)."""
        sharded, pieces = local
        meta = [(p.name, p.box, volume(p.box[1]) * p.view.element_size()) for p in pieces]
        gathered = self.exchange(meta)
        writes = assign_writers([g[1] for g in gathered])[self.rank]
        mine = [p for p, w in zip(pieces, writes) if w]
        names: dict[str, list[Any]] = {}
        for p in pieces:
            names.setdefault(p.name, [p.name, p.dtype, list(p.gshape)])
        for rec, name, gshape in zip(records, sharded.leaf_names, sharded.gshapes):
            if rec.numel == 0 and gshape is not None:   # no pieces here: listed under its global name and shape
                names.setdefault(name, [name, rec.dtype, list(gshape)])
        return (gathered[0][0], [TensorRecord(p.name, p.view, p.dtype, p.box[1]) for p in mine],
                [[list(p.box[0]), list(p.box[1])] for p in mine], sharded.leaf_names, list(names.values()))


def refuse_spread_dtensors(records: list[TensorRecord]) -> None:
    """A single_process snapshot holds only what this process has: a DTensor spread over several ranks would be
    committed with the other ranks' parts missing, so it is refused before anything is written."""
    for r in records:
        if is_dtensor(r.tensor) and (ranks := r.tensor.device_mesh.size()) > 1:  # type: ignore[attr-defined]
            raise LayoutError(f"{r.name} is a DTensor over {ranks} ranks, and a single_process "
                              f"snapshotter saves only this process's part; snapshot from every rank (no "
                              f"single_process), or gather it first (full_tensor())")


__all__ = ["JobMaker", "Planner", "Sharding", "refuse_spread_dtensors"]
