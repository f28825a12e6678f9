"""What a snapshot is before the stages run: its write plan, and for a sharded state its pieces and the one
collective that agrees on them.

``Planner.plan`` runs in ``snapshot()`` or, once dedup has decided what to write, in the capture stage;
either way before any segment is queued. ``Sharding`` runs in ``snapshot()``: every rank calls it the same
number of times, and a rank whose own checks failed still joins the collective, so that every rank raises
at the same call instead of waiting in it until its timeout.
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from ckptrepo.core import DATA_PREFIX, new_version_id, volume
from ckptrepo.errors import LayoutError, SnapshotFailedError, first_line
from ckptrepo.parallel import (
    DeadlineError,
    GroupHealth,
    GroupStore,
    Piece,
    ShardedState,
    Sharder,
    assign_writers,
    column_blocks,
    ranks_text,
)
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
            vid, records, boxes, leaf_names, names = self.sharding.shard(records, local, step)
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
    """A sharded snapshot's pieces: this rank's part of each global tensor, and which rank writes each.

    Under torch.distributed every ``snapshot()`` meets the other ranks once, through the ranks' key-value
    store (parallel/_kv.py): a constant number of requests per rank that agree on rank 0's version id, check
    that the ranks snapshot the same step, and count the ranks whose pieces changed since their last
    snapshot. The pieces themselves are exchanged only when one did (the first snapshot, a new structure or
    layout), as DCP caches its save plan: the writer assignment depends on nothing else.
    """

    def __init__(self, layout: ParallelLayout | None, rank: int, world_size: int, kv: GroupStore | None,
                 timeout_s: float, health: GroupHealth) -> None:
        self.layout, self.rank, self.world_size = layout, rank, world_size
        self.kv, self.timeout_s = kv, timeout_s
        self.health = health   # the snapshotter's commits': a meeting that fails marks it broken
        self.seq = 0
        self._cached: tuple[bytes, list[bool]] | None = None   # (this rank's pieces' fingerprint, what it writes)
        self.full_exchanges = 0
        self._last_full: str | None = None   # the last meeting whose pieces were exchanged (rank 0 deletes them)

    def local_pieces(self, records: list[TensorRecord]) -> tuple[ShardedState, list[Piece]]:
        """This rank's pieces of the global tensors (raises here, before the meeting, for a state that does
        not fit the layout)."""
        # without a layout (DTensor placements say what each rank holds) every rank is its own data-parallel slot
        layout = self.layout or ParallelLayout(dp=self.world_size)
        sharded = Sharder(layout, self.rank, self.rank).shard(records)
        return sharded, column_blocks(sharded.pieces)

    def exchange(self, meta: list[tuple[str, Any, int]] | None, step: int | None,
                 failure: Exception | None = None) -> tuple[str, list[bool]]:
        """The one meeting of a distributed snapshot: (rank 0's version id, which of this rank's pieces it
        writes). With ``failure``, this rank's error goes in place of its pieces and every rank raises."""
        if self.kv is None:
            return new_version_id(), assign_writers([meta or []])[0]
        self.seq += 1
        name = f"s/{self.seq}"
        kv = self.kv
        stamp = f"{step}".encode()
        try:
            if self.rank == 0:
                kv.set(f"{name}/vid", new_version_id().encode())
            error = None if failure is None else f"{type(failure).__name__}: {first_line(failure)}"
            other_step = kv.first(f"{name}/step", stamp) != stamp
            mark = None if meta is None else xxhash.xxh3_128_digest(msgpack.packb(meta))
            changed = self._cached is None or self._cached[0] != mark
            try:   # a group known broken here: every rank learns it at this meeting, not at its deadline
                self.health.check()
            except SnapshotFailedError as broken:
                error = error or first_line(broken)
            wake = self.health.waking(f"{name}/open")
            try:
                changes, refused = kv.arrive(name, self.timeout_s, {"error": error, "step": step}, changed,
                                             error is not None or other_step,
                                             f"snapshot number {self.seq} of this snapshotter",
                                             "; a rank died, or the ranks do not all call snapshot() the same "
                                             "number of times")
            finally:
                self.health.waking(None, wake)
            self.health.check()   # woken: the group broke meanwhile (a commit found a rank missing)
            if refused:
                if failure is not None:
                    raise failure
                every = kv.payloads(name)
                why = next(((r, p["error"]) for r, p in enumerate(every) if p["error"]), None)
                if why is not None:
                    raise SnapshotFailedError(f"rank {why[0]} refused this snapshot ({why[1]}); no version was "
                                              f"written, fix the state on that rank")
                # the version would record rank 0's step for every rank's state
                other = next(r for r, p in enumerate(every) if p["step"] != every[0]["step"])
                raise SnapshotFailedError(f"the ranks disagree about the step: rank 0 snapshots step "
                                          f"{every[0]['step']}, rank {other} step {every[other]['step']}; pass "
                                          f"every rank the same step")
            kv.forget(name, own_only=True)
            if self.rank == 0 and self.seq > 1:   # every rank is past the previous meeting: it reached this one
                self._forget(f"s/{self.seq - 1}")
            if changes:
                writes = self._full_exchange(name, meta or [])
                self._cached = (mark or b"", writes)
            assert self._cached is not None
            return kv.get(f"{name}/vid").decode(), self._cached[1]
        except SnapshotFailedError as err:
            if isinstance(err, DeadlineError):   # a rank died or stopped snapshotting: the group is broken
                self.health.mark_broken(first_line(err))
            raise

    def _full_exchange(self, name: str, meta: list[tuple[str, Any, int]]) -> list[bool]:
        """Every rank's pieces, and the writer assignment they give (the same on every rank)."""
        kv = self.kv
        assert kv is not None
        self.full_exchanges += 1
        self._last_full = name
        kv.set(f"{name}/meta/{self.rank}", msgpack.packb(meta))
        keys = [f"{name}/meta/{r}" for r in range(self.world_size)]
        kv.wait(keys, self.timeout_s, lambda: f"{ranks_text(kv.absent(keys))} did not send their pieces")
        metas = [msgpack.unpackb(raw) for raw in kv.get_many(keys)]
        return assign_writers([[(n, (tuple(b[0]), tuple(b[1])), nb) for n, b, nb in m] for m in metas])[self.rank]

    def _forget(self, name: str) -> None:
        """Rank 0: the shared keys of a meeting every rank has left (each is at the next one)."""
        assert self.kv is not None
        for k in ("vid", "step", "n", "open"):
            self.kv.delete(f"{name}/{k}")
        for r in range(self.world_size) if self._last_full == name else ():
            self.kv.delete(f"{name}/meta/{r}")

    def shard(self, records: list[TensorRecord], local: tuple[ShardedState, list[Piece]], step: int | None) -> \
            tuple[str, list[TensorRecord], list[Any], list[str], list[list[Any]]]:
        """This rank's pieces, the agreed version id, and which pieces this rank writes: (version id, the
        records it writes, their boxes, the stored name of each state tensor, [name, dtype, global shape] of
        each tensor it holds)."""
        sharded, pieces = local
        meta = [(p.name, [list(p.box[0]), list(p.box[1])], volume(p.box[1]) * p.view.element_size())
                for p in pieces]
        vid, writes = self.exchange(meta, step)
        mine = [p for p, w in zip(pieces, writes) if w]
        names: dict[str, list[Any]] = {}
        for p in pieces:
            names.setdefault(p.name, [p.name, p.dtype, list(p.gshape)])
        for rec, name, gshape in zip(records, sharded.leaf_names, sharded.gshapes):
            if rec.numel == 0 and gshape is not None:   # no pieces here: listed under its global name and shape
                names.setdefault(name, [name, rec.dtype, list(gshape)])
        return (vid, [TensorRecord(p.name, p.view, p.dtype, p.box[1]) for p in mine],
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
