"""Versions written as pieces of global tensors by several ranks that coordinate through someone else's protocol.

A framework that plans its own distributed save (torch.distributed.checkpoint, Megatron-core's
dist_checkpointing) already knows which rank writes which box of which global tensor, and already gathers
something from every rank to one coordinator. Such a save needs none of the snapshotter's collectives or its
staging handshake: each rank writes its chunks here (``write_rank_chunks``) into its own flat arrays
``data/<vid>/<rank>/<dtype>``, hands the plain-data ``RankWrite`` to the framework's gather, and the
coordinator commits them all as one version (``commit_chunks``): manifest create-only, then the branch's
compare-and-swap, as every commit does (saving/_commit.py). ``read_chunks`` fills any boxes of a version's
global tensors, reading only the bytes they need.

Every tensor is stored under its global name with its global shape, each chunk a piece of it, and the
version's layout is a single process's: nothing in it is per rank (the framework decided what is
replicated and wrote it once), so the version loads like one saved by one process, unsharded or into any
layout.

With ``dedup``, each chunk's bytes are hashed (xxh3 on the host, WORDSUM on a GPU: saving/_content_hash.py)
and a chunk whose piece of the ``parent`` version (same tensor name and box) holds bytes of the same dtype and
digest points at them instead of being written, as a snapshot's unchanged tensors do (saving/_dedup.py).
Matching by name keeps two tensors from pointing at one piece (a manifest refuses overlapping tensors); a
framework whose names are not yet the stored ones (DCP's FQNs) passes the stored name of each. With
``stats``, each chunk's moments travel to the coordinator, which merges them into the version's per-tensor
statistics as rank 0 of a distributed snapshot does.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import xxhash

from ckptrepo import faults
from ckptrepo.core import Moments, Plumbing, Version, volume
from ckptrepo.core.schema import (
    SINGLE_PROCESS_LAYOUT,
    Manifest,
    Piece,
    TensorStatsRecord,
)
from ckptrepo.errors import (
    LayoutError,
    UnsupportedValueError,
)
from ckptrepo.loading import ReadStats, read_pieces
from ckptrepo.parallel import Piece as TargetPiece
from ckptrepo.parallel import merge_tensor_table
from ckptrepo.saving._commit import BranchBase, publish_version, read_branch_base, version_header
from ckptrepo.saving._content_hash import digest_as, hasher_digest, wordsum_digests
from ckptrepo.saving._dedup import PieceId, StoredTensor, check_reused_arrays, moments_of, piece_id, seed_from
from ckptrepo.saving._tensor_stats import NOT_RECORDED, stat_feeds
from ckptrepo.saving._writer import LIVE_ALIGN, StagingPool, WritePlan, fill_segment, make_plan
from ckptrepo.state import DTYPE_NAMES, TensorRecord
from ckptrepo.storage import ArrayInfo, DirectWriter, chunk_crcs, create_array, itemsize, write_table
from ckptrepo.storage.protocol import Store

log = logging.getLogger("ckptrepo")

__all__ = ["BranchBase", "ChunkRecord", "GlobalChunk", "RankWrite", "commit_chunks", "read_branch_base",
           "read_chunks", "write_rank_chunks"]


@dataclass
class GlobalChunk:
    """A box of global tensor ``name`` (global shape ``gshape``) starting at ``offsets``; ``tensor`` holds its
    elements (shape = the box's sizes): what a rank writes, or the view a read fills."""

    name: str
    gshape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(frozen=True)
class ChunkRecord:
    """One written chunk: its tensor's name, dtype and global shape, and its piece (None: no elements)."""

    name: str
    dtype: str
    gshape: tuple[int, ...]
    piece: Piece | None


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote: plain, picklable data for the framework's gather to the coordinator."""

    rank: int
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)   # array key -> record (with its digest)
    chunks: tuple[ChunkRecord, ...] = ()
    moments: tuple[tuple[str, Any], ...] | None = None   # per chunk (name, Moments.to_raw()) with ``stats``

    @property
    def nbytes(self) -> int:
        return sum(volume(c.piece.box[1]) * itemsize(c.dtype) for c in self.chunks if c.piece is not None)

    # what rank 0 merges of a snapshotter's rank parts too (parallel/_distributed.py merge_tensor_table)
    coords = None   # no pipeline stages: the framework decided what each rank writes

    @property
    def names(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple((c.name, c.dtype, c.gshape) for c in self.chunks)

    @property
    def tensors(self) -> tuple[tuple[str, tuple[Piece, ...]], ...]:
        return tuple((c.name, (c.piece,)) for c in self.chunks if c.piece is not None)


def _dtype_name(t: torch.Tensor, name: str) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise UnsupportedValueError(f"{name}: dtype {t.dtype} is not supported") from None


def _check_chunk(c: GlobalChunk) -> None:
    box_ok = len(c.offsets) == len(c.gshape) == c.tensor.dim() and all(
        0 <= o and o + s <= g for o, s, g in zip(c.offsets, c.tensor.shape, c.gshape))
    if not box_ok:
        raise LayoutError(f"{c.name}: a chunk of shape {list(c.tensor.shape)} at offsets {list(c.offsets)} does not "
                          f"fit in the global shape {list(c.gshape)}")


def write_rank_chunks(plumbing: Plumbing, vid: str, rank: int, chunks: Sequence[GlobalChunk],
                      shard_bytes: int | None = None, *, dedup: bool = False, parent: str | None = None,
                      names: Mapping[str, str] | None = None, stats: bool = False) -> RankWrite:
    """Write this rank's chunks of version ``vid``, coalesced per dtype into ``data/<vid>/<rank>/<dtype>``
    (the snapshotter's plan and segment filling; each array's chunk table and digest), durable on return.
    ``shard_bytes``: the arrays' shard size (default: the snapshotter's). ``dedup``: record each chunk's digest,
    and point a chunk whose bytes equal its piece of version ``parent`` at that piece instead of writing it;
    ``names``: a chunk's tensor name as ``parent`` stores it, where it differs (one absent is not reused).
    ``stats``: report each chunk's moments (``RankWrite.moments``) for ``commit_chunks``' statistics."""
    for c in chunks:
        _check_chunk(c)
    records = [TensorRecord(c.name, c.tensor.detach(), _dtype_name(c.tensor, c.name), tuple(c.tensor.shape))
               for c in chunks]
    ids = [piece_id(c.name if names is None else names.get(c.name, ""), (c.offsets, r.shape))
           for c, r in zip(chunks, records)]
    stored = _parent_pieces(plumbing, parent, set(ids)) if dedup and parent is not None else {}
    digests: list[bytes | None] = [None] * len(records)
    reuse: dict[int, StoredTensor] = {}
    for i, (pid, r) in enumerate(zip(ids, records)):   # only a chunk with a piece to compare is hashed now
        prev = stored.get(pid)
        if prev is not None and r.numel and prev.digest and prev.info.get("dtype") == r.dtype:
            digests[i] = digest_as(prev.digest[0], r.tensor)   # by the algorithm the parent's digest used
            if digests[i] == prev.digest:
                reuse[i] = prev
    written = [i for i in range(len(records)) if i not in reuse]
    hashers: dict[int, Any] = {}
    if dedup:   # the written chunks' digests, for the next save: CPU ones hashed as they are staged
        late = [i for i in written if digests[i] is None and records[i].numel]
        on_device = [i for i in late if records[i].tensor.is_cuda]
        for i, d in zip(on_device, wordsum_digests([records[i].tensor for i in on_device])):
            digests[i] = d
        hashers = {pi: xxhash.xxh3_128() for pi, i in enumerate(written)
                   if digests[i] is None and records[i].numel}
    plan = make_plan([records[i] for i in written], shard_bytes)
    arrays = {dtype: ArrayInfo(f"data/{vid}/{rank}/{dtype}", dtype, numel, shard, inner)
              for dtype, (numel, shard, inner) in plan.streams.items()}
    moments_fed, feeds = stat_feeds(None, [records[i] for i in written], hashers) if stats else ({}, dict(hashers))
    out_arrays = {d: write_table(plumbing.store, info, table) for d, info, table in
                  _write_segments(plumbing.store, plan, arrays, [records[i].tensor for i in written], feeds)}
    for pi, h in hashers.items():
        digests[written[pi]] = hasher_digest(h)
    where: dict[int, tuple[str, int]] = {i: (out_arrays[p.dtype].key, p.offset)
                                         for i, p in zip(written, plan.placements) if p.numel}
    plan_index = {i: pi for pi, i in enumerate(written)}
    out, moments = [], []
    for i, (c, r) in enumerate(zip(chunks, records)):
        piece = None
        if i in reuse:
            prev = reuse[i]
            out_arrays.setdefault(prev.array, ArrayInfo.from_json(prev.array, prev.info))
            piece = Piece((tuple(c.offsets), tuple(r.shape)), prev.array, prev.offset, digests[i])
        elif i in where:
            piece = Piece((tuple(c.offsets), tuple(r.shape)), *where[i], digests[i])
        out.append(ChunkRecord(c.name, r.dtype, tuple(c.gshape), piece))
        if stats:
            moments.append((c.name, _chunk_moments(r, piece, moments_fed.get(plan_index.get(i, -1)))))
    if stats:
        _remember_moments(out, moments)
    return RankWrite(rank, {a.key: a for a in out_arrays.values()}, tuple(out),
                     tuple(moments) if stats else None)


def _parent_pieces(plumbing: Plumbing, parent: str, ids: set[PieceId]) -> dict[PieceId, StoredTensor]:
    """The pieces of version ``parent`` among ``ids`` that a new chunk may point at (saving/_dedup.py). A
    failure to read them only costs this save its dedup, as it costs a snapshot's: everything is written."""
    try:
        manifest = plumbing.manifest(parent)
        return seed_from(manifest, plumbing.data_store(manifest), ids)
    except Exception as err:  # noqa: BLE001 - a store error here must not fail the save
        log.warning("ckptrepo: dedup could not read parent version %s (%s); this save writes every chunk",
                    parent[:12], err)
        return {}


# the moments of the pieces this process wrote or reused last, by stored bytes (array, offset, digest): the next
# save of an unchanged state takes a reused chunk's moments from here instead of reading its bytes again
_recent_moments: OrderedDict[tuple[str, int, bytes], Any] = OrderedDict()
_recent_lock = threading.Lock()   # dcp.async_save writes from a thread of its own
_RECENT_PIECES = 1 << 16


def _chunk_moments(r: TensorRecord, piece: Piece | None, fed: Any) -> Any:
    """A chunk's ``Moments.to_raw()``: from what its staged bytes fed, from the last save's of the same stored
    bytes, or (a reused piece this process has not seen) from its bytes."""
    if fed is not None:
        return fed.moments().to_raw()
    if piece is not None and piece.digest is not None:
        with _recent_lock:
            known = _recent_moments.get((piece.array, piece.offset, piece.digest))
        if known is not None:
            return known
    return moments_of(r) if r.numel else Moments().to_raw()


def _remember_moments(chunks: Sequence[ChunkRecord], moments: Sequence[tuple[str, Any]]) -> None:
    with _recent_lock:
        for c, (_, raw) in zip(chunks, moments):
            if c.piece is not None and c.piece.digest is not None:
                key = (c.piece.array, c.piece.offset, c.piece.digest)
                _recent_moments[key] = raw
                _recent_moments.move_to_end(key)
        while len(_recent_moments) > _RECENT_PIECES:
            _recent_moments.popitem(last=False)


WRITE_BUFFERS = 4   # staging buffers in flight per rank: a shard being filled while others are written

# the last save's staging buffers, kept for the next: a framework saves the same state again and again, and
# fresh buffers cost a page fault per page at every save (the snapshotter keeps its pool for the same reason)
_pool_lock = threading.Lock()
_last_pool: StagingPool | None = None


def _staging_pool(buffer_bytes: int, align: int) -> StagingPool:
    """A pool of ``WRITE_BUFFERS`` buffers of at least ``buffer_bytes``: the last one when it fits, else a new one
    that replaces it (a save still writing from the old one keeps it until its writes are over)."""
    global _last_pool
    with _pool_lock:
        pool = _last_pool
        if pool is None or pool.align != align or not pool.buffer_bytes >= buffer_bytes:
            pool = _last_pool = StagingPool(buffer_bytes, WRITE_BUFFERS, align=align)
        return pool


def _write_segments(store: Store, plan: WritePlan, arrays: dict[str, ArrayInfo], tensors: Sequence[torch.Tensor],
                    feeds: dict[int, Any]) -> list[tuple[str, ArrayInfo, np.ndarray]]:
    """Write every segment of ``plan``, filling the next staging buffer while earlier ones are written (by the
    direct writer on a local store, else TensorStore), all durable on return; each array's chunk table.
    ``feeds`` (plan index -> statistics, digest hasher or both) are fed each tensor's staged bytes, while they
    are in cache."""
    direct = DirectWriter.for_store(store)
    biggest = max((seg.stop - seg.start) * arrays[seg.dtype].itemsize for seg in plan.segments) \
        if plan.segments else 0
    pool = _staging_pool(biggest, LIVE_ALIGN if direct is not None and direct.direct_io else 0)
    handles = {d: create_array(store, info) for d, info in arrays.items()}
    crcs: list[np.ndarray | None] = [None] * len(plan.segments)
    futures: list[tuple[int, Any]] = []

    def source(i: int) -> torch.Tensor:
        return tensors[i].resolve_conj().resolve_neg()

    try:
        for k, seg in enumerate(plan.segments):
            info = arrays[seg.dtype]
            buf = pool.take()
            try:
                view = fill_segment(seg, source, buf, hashers=feeds or None)
                faults.point("before_shard_write")
                fut: Any = None if direct is None else direct.submit(info, seg.start, view)
                if fut is None:
                    crcs[k] = chunk_crcs(info, view)
                    fut = handles[seg.dtype][seg.start:seg.stop].write(view).commit
            except BaseException:
                pool.give(buf)   # the pool outlives this save: a buffer no write holds goes back at once
                raise
            fut.add_done_callback(lambda _f, buf=buf: pool.give(buf))
            futures.append((k, fut))
        for k, fut in futures:
            got = fut.result()
            if isinstance(got, np.ndarray):   # the direct writer's crc32cs; TensorStore's were taken before
                crcs[k] = got
    finally:
        if direct is not None:
            direct.close()
    out = []
    for dtype, info in arrays.items():
        parts = [c for seg, c in zip(plan.segments, crcs) if seg.dtype == dtype and c is not None]
        out.append((dtype, info, np.concatenate(parts)))
    return out


def commit_chunks(plumbing: Plumbing, vid: str, writes: Sequence[RankWrite], tree: Any, world_size: int, *,
                  step: int | None, message: str, metrics: dict[str, Any] | None,
                  meta: dict[str, str] | None = None, base: BranchBase | None = None) -> Version:
    """Commit every rank's chunks as version ``vid`` with skeleton ``tree`` (whose tensor leaves index the
    tensors in the order their names first appear in ``writes``, rank by rank: see ``tensor_order``).

    The chunks must cover each tensor exactly once. ``base``: the branch and tip read when the save started
    (default: HEAD's branch, read now); the commit is a ConflictError if the branch moved since.
    ``world_size`` is the framework's (every rank wrote into arrays of its own); the version records a single
    process's layout, since nothing in it is per rank (docs/decisions/025-dcp-backend.md). ``meta``: free-text
    names and values for the manifest header (``Version.meta``).
    """
    del world_size   # see the docstring: the layout is one process's
    base = base if base is not None else read_branch_base(plumbing)
    tensors, arrays = merge_tensor_table(sorted(writes, key=lambda w: w.rank))
    header = version_header(vid, base.tip, step, message, dict(metrics or {}), dict(meta) if meta else None)
    size = sum(volume(p.box[1]) * arrays[p.array].itemsize for t in tensors for p in t.pieces)
    manifest = Manifest.of(header, size=size, layout=SINGLE_PROCESS_LAYOUT, arrays=arrays, tensors=tensors,
                           tree=tree, tensor_stats=_merged_stats(vid, writes, tensors))
    on = f"version {base.tip[:12]}" if base.tip else "an empty branch"

    def moved_away(now: str | None) -> str:
        return (f"branch {base.branch!r} moved to {str(now)[:12]} (another writer) while this save wrote on top "
                f"of {on}; save again, or give each writer a branch of its own")
    def before_ref(m: Manifest) -> None:   # dedup: what the version reuses is still there (see check_reused_arrays)
        own = f"data/{vid}/"
        reused = {k: a for k, a in m.arrays.items() if not k.startswith(own)}
        if reused:
            check_reused_arrays(plumbing.store, vid, reused, announced=True)
    return publish_version(plumbing, base, manifest, moved_away, before_ref=before_ref)


def _merged_stats(vid: str, writes: Sequence[RankWrite], tensors: Sequence[Any]) -> TensorStatsRecord | None:
    """Each tensor's statistics, merged from the moments of its chunks (each element is in one rank's chunk,
    so counted once); None unless every rank reported them. The change from the parent is zero for a tensor
    whose every piece points into an earlier version (its bytes did not change), as a snapshot records it for
    a reused tensor, and not measured otherwise."""
    if not writes or any(w.moments is None for w in writes):
        return None
    merged = {t.name: Moments() for t in tensors}
    for w in writes:
        for name, raw in w.moments or ():
            if name in merged:
                merged[name].merge(Moments.from_raw(raw))
    own = f"data/{vid}/"
    rows = []
    for t in tensors:
        same = bool(t.pieces) and not any(p.array.startswith(own) for p in t.pieces)
        change = (0.0, 0.0) if same else (NOT_RECORDED, NOT_RECORDED)
        rows.append((*merged[t.name].row(t.numel), *change))
    return TensorStatsRecord.of_rows([t.name for t in tensors], rows)


def tensor_order(writes: Sequence[RankWrite]) -> list[str]:
    """The tensors' names in the order ``commit_chunks`` lists them (their index in a tree's tensor leaves)."""
    return [t.name for t in merge_tensor_table(sorted(writes, key=lambda w: w.rank))[0]]


def read_chunks(source: Plumbing | Store, manifest: Manifest, wants: Sequence[GlobalChunk],
                stats: ReadStats | None = None) -> ReadStats:
    """Fill each wanted box of a global tensor of ``manifest`` into its tensor (of the stored dtype), reading only
    the bytes the boxes need; returns the read statistics."""
    store = source.data_store(manifest) if isinstance(source, Plumbing) else source
    shapes = {t.name: (t.dtype, t.shape) for t in manifest.tensors}
    targets = []
    for w in wants:
        _check_chunk(w)
        if w.name not in shapes:
            raise LayoutError(f"{w.name}: version {manifest.id[:12]} has no tensor of this name")
        dtype, shape = shapes[w.name]
        if tuple(w.gshape) != tuple(shape):
            raise LayoutError(f"{w.name}: wanted as global shape {list(w.gshape)}, saved as {list(shape)}")
        if DTYPE_NAMES.get(w.tensor.dtype) != dtype:
            raise LayoutError(f"{w.name}: wanted as {w.tensor.dtype}, saved as {dtype}; read into a tensor of the "
                              f"saved dtype and cast")
        targets.append(TargetPiece(w.name, dtype, tuple(shape), (tuple(w.offsets), tuple(w.tensor.shape)), w.tensor))
    return read_pieces(store, manifest, targets, stats)
