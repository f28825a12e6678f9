"""Distributed snapshots: who writes which replica, and the two-phase commit through the ranks' store.

At ``snapshot()`` time (on the training thread, a meeting every rank makes
in the same order: saving/_prepare.py) the ranks agree on rank 0's new
version id; their pieces are exchanged only when one changed. Every rank then
computes the same writer assignment, so each data-parallel replica is written
once in total, spread over its holders by size, with no further communication.

The commit needs no collective at all, so background threads never touch the
process group the training loop uses. It goes through the ranks' key-value
store (torch.distributed's c10d store, parallel/_kv.py), never the object
store: each rank writes its data and then sets its *rank part* (or one
carrying its error); rank 0 waits for all of them, checks that the pieces
cover every tensor exactly once, writes the version manifest, moves the ref,
and sets its verdict, which the other ranks wait for. A rank that dies never
sets its part: rank 0 gives up at the commit timeout, naming it, so no
version appears, and every rank gets the error. What must survive a crash
(data, manifest, ref) is in the repository; the handshake is not.

A group that lost a rank stays broken: once one snapshot learns it (a rank
missing at the timeout, rank 0's verdict missing, a snapshot's meeting
missing a rank), the snapshotter's ``GroupHealth`` says so, wakes the waits in
progress, and every snapshot still in flight fails at once with that cause
instead of waiting out a timeout of its own.
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from ckptrepo.core import DATA_PREFIX, Box, Moments, check_coverage, collection_paused, seal, unseal, volume
from ckptrepo.core.schema import (
    MERGED_ORDER,
    LayoutRecord,
    Manifest,
    ManifestHeader,
    Piece,
    RankFailure,
    RankPart,
    RankRecord,
    TensorEntry,
    TensorStatsRecord,
    decode_rank_part,
    encode_rank_part,
)
from ckptrepo.errors import LayoutError, SnapshotFailedError
from ckptrepo.parallel._kv import GroupStore, ranks_text
from ckptrepo.state import (
    DICT,
    LIST,
    NDARRAY,
    ODICT,
    SCALAR,
    STATEFUL,
    TENSOR,
    TORCH_DTYPES,
    TUPLE,
    key_str,
    unflatten,
)
from ckptrepo.storage import ArrayInfo

if TYPE_CHECKING:
    from ckptrepo.parallel.layout import ParallelLayout

_FAILED = 1 << 32   # added to the arrival counter by a rank that publishes a failure


def process_group_rank() -> tuple[int, int]:
    """(rank, world size) of the default torch.distributed group; (0, 1) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (metadata only: ids, names, boxes)."""
    import torch.distributed as dist
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def assign_writers(metas: Sequence[Sequence[tuple[str, Box, int]]]) -> list[list[bool]]:
    """For each rank and each of its pieces ``(name, box, nbytes)``, whether that rank writes it.

    A piece held identically by several ranks (a replica) is written by the
    holder with the fewest bytes assigned so far, biggest pieces first; the
    result depends only on ``metas``, so every rank computes the same one.
    """
    holders: dict[tuple[str, Box], list[tuple[int, int]]] = {}
    sizes: dict[tuple[str, Box], int] = {}
    for r, meta in enumerate(metas):
        for j, (name, box, nbytes) in enumerate(meta):
            key = (name, (tuple(box[0]), tuple(box[1])))
            holders.setdefault(key, []).append((r, j))
            sizes[key] = nbytes
    load = [0] * len(metas)
    writes = [[False] * len(m) for m in metas]
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        r, j = min(holders[key], key=lambda h: (load[h[0]], h[0]))
        writes[r][j] = True
        load[r] += sizes[key]
    return writes


class GroupHealth:
    """Whether one snapshotter's process group is known to be broken, and why.

    Shared by all the snapshotter's snapshots: the commits run one after the
    other, so without it each snapshot in flight behind a dead rank would wait
    out its own commit timeout. Broken stays broken: a rank that missed a
    commit is dead or stuck, and waiting for it again only delays the error.
    Rank 0 still commits a version whose parts are all in, since every rank
    that published a part waits for its verdict.

    A rank's staged *failure* does not break the group: that rank is alive
    and answered, so its error fails only that snapshot, promptly.
    """

    def __init__(self, waker: GroupStore | None = None) -> None:
        self._cause: str | None = None
        self._lock = threading.Lock()
        # a connection of its own: the thread that breaks the group is not the one blocked in the wait it wakes,
        # and a store client serves one request at a time (parallel/_kv.py)
        self._waker = waker
        self._wakes: dict[int, str] = {}
        self._next = 0

    def mark_broken(self, cause: str) -> None:
        """Record the first cause; later ones are consequences of it. A wait registered with ``waking`` is
        woken, so that it fails now instead of at its deadline."""
        with self._lock:
            if self._cause is None:
                self._cause = cause
            wakes = list(self._wakes.values())
        waker = self._waker
        if waker is None:
            return
        for key in wakes:
            try:
                waker.set(key, b"1")
            except Exception:  # noqa: BLE001 - the store may be what broke: the wait then ends at its deadline
                pass

    def waking(self, key: str | None, token: int | None = None) -> int:
        """Register the key whose setting ends a wait in progress (the commit thread's, the training thread's)
        and return its token; with None and the token, remove it."""
        with self._lock:
            if key is None:
                self._wakes.pop(token if token is not None else -1, None)
                return -1
            self._next += 1
            self._wakes[self._next] = key
            return self._next

    def check(self) -> None:
        """Raise, with the first cause, if the group is known to be broken."""
        cause = self._cause
        if cause is not None:
            raise SnapshotFailedError(f"the process group is broken ({cause}); restart every rank and resume from "
                                      f"the last committed version")


class Staging:
    """The commit handshake of one distributed version, through the ranks' key-value store (parallel/_kv.py):
    ``v/<id>/part/<rank>`` per rank, a counter whose last arrival opens ``v/<id>/open``, then rank 0's verdict
    ``v/<id>/outcome`` (and, for the other nodes' repositories, the manifest ``v/<id>/manifest``)."""

    def __init__(self, kv: GroupStore, vid: str, world_size: int, timeout_s: float,
                 health: GroupHealth | None = None) -> None:
        self.kv = kv
        self.vid = vid
        self.prefix = f"v/{vid}/"
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.health = health if health is not None else GroupHealth()

    def _part_key(self, rank: int) -> str:
        return f"{self.prefix}part/{rank}"

    def publish_rank(self, part: RankPart | RankFailure) -> None:
        """This rank's part (or failure): a failure opens the gate at once, so rank 0 need not wait for the
        others to learn the snapshot failed."""
        self.kv.set(self._part_key(part.rank), encode_rank_part(part))
        failed = isinstance(part, RankFailure)
        total = self.kv.add(f"{self.prefix}in", 1 + (_FAILED if failed else 0))
        if failed or total % _FAILED == self.world_size:
            self.kv.set(f"{self.prefix}open", b"1")

    def gather_ranks(self) -> list[RankPart]:
        """Rank 0: wait for every rank's part; raise on a rank's error, at the timeout, or as soon as the group
        is known to be broken (rank 0 then publishes the abort, so the other ranks agree)."""
        self.health.check()
        keys = [self._part_key(r) for r in range(self.world_size)]

        def missing() -> str:
            late = [r for r in self.kv.absent(keys)]
            self.health.mark_broken(f"{ranks_text(late)} did not finish their part of snapshot {self.vid[:12]} "
                                    f"within {self.timeout_s:.0f} s")
            return f"{ranks_text(late)} did not finish their part"
        wake = self.health.waking(f"{self.prefix}open")
        try:
            self.kv.wait([f"{self.prefix}open"], self.timeout_s, missing,
                         " (a rank died or is stuck); nothing was committed")
        finally:
            self.health.waking(None, wake)
        self.health.check()
        total = self.kv.add(f"{self.prefix}in", 0)
        present = [r for r in range(self.world_size)] if total == self.world_size else \
            [r for r, k in enumerate(keys) if self.kv.has(k)]
        raws = self.kv.get_many([keys[r] for r in present])
        # a record per piece of every rank: with the collector on, they set off collections that walk them all
        with collection_paused():
            parts = [decode_rank_part(raw, f"rank {r}'s part") for r, raw in zip(present, raws)]
        failed = next((p for p in parts if isinstance(p, RankFailure)), None)
        if failed is not None:
            raise SnapshotFailedError(f"rank {failed.rank} failed: {failed.error}")
        for k in keys:
            self.kv.delete(k)
        for k in ("in", "open"):
            self.kv.delete(self.prefix + k)
        return [p for p in parts if isinstance(p, RankPart)]

    def publish_outcome(self, error: str | None, header: ManifestHeader | None = None,
                        manifest: bytes | None = None) -> None:
        """Rank 0's verdict, with the committed version's ``header`` (what the other ranks' handles report);
        with ``manifest``, the encoded manifest the other nodes' leaders commit too."""
        if manifest is not None:
            self.kv.set(f"{self.prefix}manifest", manifest)
        fields = None if header is None else {
            "id": header.id, "parents": list(header.parents), "step": header.step, "time": header.time,
            "message": header.message, "metrics": header.metrics, "size": header.size, "meta": header.meta}
        self.kv.set(f"{self.prefix}outcome", seal({"error": error, "header": fields}))

    def forget_outcome(self, nodes: int = 0) -> None:
        """Rank 0, once every rank has read the verdict (each has published its part of a later snapshot)."""
        for k in ("outcome", "manifest", "read", "all-read", *(f"node{n}" for n in range(nodes))):
            self.kv.delete(self.prefix + k)

    def done_reading(self) -> None:
        """A rank other than 0 has read all it needs of this commit from the store: rank 0, whose process may
        serve the store (a launcher without torchrun's agent), may end once every rank has."""
        if self.kv.add(f"{self.prefix}read", 1) == self.world_size - 1:
            self.kv.set(f"{self.prefix}all-read", b"1")

    def wait_readers(self) -> None:
        """Rank 0, before its snapshotter closes: wait for every other rank's ``done_reading``."""
        self.kv.wait([f"{self.prefix}all-read"], self.timeout_s,
                     lambda: f"{self.world_size - 1 - self.kv.add(f'{self.prefix}read', 0)} rank(s) did not read "
                             f"rank 0's verdict on {self.vid[:12]}")

    def followed(self, node: int) -> None:
        """A node's leader has committed (or failed to commit) the version on its node's repository."""
        self.kv.set(f"{self.prefix}node{node}", b"1")

    def wait_followed(self, node: int, leader: int) -> None:
        """A rank of another node than rank 0's: wait for its leader's ``followed``."""
        self.kv.wait([f"{self.prefix}node{node}"], self.timeout_s,
                     lambda: f"this node's first rank ({leader}) did not record version {self.vid[:12]}")

    def manifest(self) -> bytes:
        """A node leader: the manifest rank 0 published with its verdict."""
        return self.kv.get(f"{self.prefix}manifest")

    def wait_outcome(self, landed: Callable[[], bool]) -> dict[str, Any] | None:
        """Other ranks: wait for rank 0's verdict; raise its error, or at the timeout unless ``landed()``
        says the version is on its branch (rank 0 died between moving the ref and publishing its verdict).

        Only rank 0 decides, so this wait is not cut short when the group breaks: rank 0 may still commit a
        version whose parts are all in, which this rank would then have reported as failed. A verdict missing
        at the timeout breaks the group, though: the snapshots behind this one fail at once."""
        grace = min(30.0, max(5.0, self.timeout_s))   # rank 0 waits timeout_s for the ranks, then merges
        key = f"{self.prefix}outcome"
        try:
            self.kv.wait([key], self.timeout_s + grace, lambda: "rank 0 gave no verdict")
        except SnapshotFailedError:
            self.health.mark_broken(f"rank 0 gave no verdict on snapshot {self.vid[:12]} within "
                                    f"{self.timeout_s + grace:.0f} s")
            if landed():
                return None
            raise SnapshotFailedError(f"rank 0 did not commit or abort within {self.timeout_s + grace:.0f} s, "
                                      f"and the version is not on the branch; it was not committed") from None
        outcome = unseal(self.kv.get(key), key)
        if outcome.get("error"):
            raise SnapshotFailedError(outcome["error"])
        header: dict[str, Any] | None = outcome.get("header")
        return header


def merge_rank_manifests(ranks: Sequence[RankPart], layout: "ParallelLayout | None", world_size: int,
                         header: ManifestHeader) -> Manifest:
    """Rank 0: the version manifest of ``header``, with the layout, arrays, tensor table and tree from every
    rank's part.

    Tensors are listed in rank order (pipeline stages in order), each with
    the pieces all ranks wrote; the pieces must cover each tensor exactly once.
    The top-level ``tree`` is the unsharded view (rank 0's structure with each
    parameter section holding every global tensor), which ``show`` and the
    inspection tools read; every rank's own tree is kept under ``layout.ranks``.
    """
    tensors, arrays = merge_tensor_table(ranks)
    own = f"{DATA_PREFIX}{header.id}/"
    index = {t.name: i for i, t in enumerate(tensors)}
    sections = layout.rules.all_sections() if layout is not None and layout.rules is not None else ()
    records = tuple(RankRecord(p.rank, p.coords, p.tree, p.leaf_names) for p in ranks)
    if layout is None:
        lay = LayoutRecord(world_size, records)
    else:
        lay = LayoutRecord(world_size, records, layout.tp, layout.pp, layout.dp, layout.zero,
                           layout.rules.to_json() if layout.rules is not None else None)
    return Manifest.of(header, layout=lay, arrays=arrays, tensors=tensors, key_order=MERGED_ORDER,
                       tensor_stats=merged_stats(ranks, tensors),
                       size=sum(volume(p.box[1]) * TORCH_DTYPES[t.dtype].itemsize for t in tensors for p in t.pieces
                                if p.array.startswith(own)),   # the bytes it wrote: not the pieces it reuses
                       tree=full_tree(ranks[0].tree, ranks[0].leaf_names, tensors, index, sections))


class TablePart(Protocol):
    """What ``merge_tensor_table`` reads of one rank's part: a snapshotter's ``RankPart``, or the ``RankWrite``
    of a rank in a framework-coordinated save (saving/_pieces.py)."""

    @property
    def rank(self) -> int: ...
    @property
    def coords(self) -> dict[str, int] | None: ...
    @property
    def names(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]: ...
    @property
    def tensors(self) -> tuple[tuple[str, tuple[Piece, ...]], ...]: ...
    @property
    def arrays(self) -> dict[str, ArrayInfo]: ...


def merge_tensor_table(parts: Sequence[TablePart]) -> tuple[tuple[TensorEntry, ...], dict[str, ArrayInfo]]:
    """The version's tensor table and arrays from every rank's part, in the parts' order: each tensor listed
    where a rank first names it, with the pieces all ranks wrote of it, which must cover it exactly once.
    Ranks that disagree about a tensor's dtype or shape, or pipeline stages that both hold one, are refused:
    bytes of one dtype would load as another's, and only one stage's copy would be kept."""
    declared: dict[str, tuple[str, tuple[int, ...], int]] = {}   # name -> (dtype, shape, the first rank listing it)
    pieces: dict[str, list[Piece]] = {}
    stage_of = {p.rank: (p.coords or {}).get("pp", 0) for p in parts}
    # a snapshotter's parts (with coordinates) are cut by its layout's rules; a framework's save has none
    same = "the same dtype and rules" if any(p.coords is not None for p in parts) else "the same dtype"
    for part in parts:
        for name, dtype, shape in part.names:
            seen_dtype, seen_shape, first = declared.setdefault(name, (dtype, shape, part.rank))
            pieces.setdefault(name, [])
            if stage_of[first] != stage_of[part.rank]:   # replicas live within a stage: one copy would be kept
                raise LayoutError(f"{name}: pipeline stages {stage_of[first]} and {stage_of[part.rank]} both hold "
                                  f"a tensor of this name, and only one copy would be kept; name the layers with "
                                  f"the rules' layer_prefix so that each stage's become global layer numbers, or "
                                  f"give each stage's tensor a name of its own")
            if (seen_dtype, seen_shape) != (dtype, shape):   # bytes of one dtype would load as another's
                raise LayoutError(f"{name}: the ranks disagree about this tensor: rank {first} holds it as "
                                  f"{seen_dtype} {list(seen_shape)}, rank {part.rank} as {dtype} {list(shape)}; "
                                  f"give every rank {same}")
    arrays: dict[str, ArrayInfo] = {}
    for part in parts:
        arrays.update(part.arrays)
        for name, mine in part.tensors:
            pieces[name].extend(mine)
    check_coverage({n: (declared[n][1], [p.box for p in ps]) for n, ps in pieces.items()})
    return tuple(TensorEntry(n, dtype, shape, tuple(pieces[n])) for n, (dtype, shape, _) in declared.items()), arrays


def merged_stats(ranks: Sequence[RankPart], tensors: Sequence[TensorEntry]) -> TensorStatsRecord | None:
    """The version's per-tensor statistics from the moments of every piece the ranks wrote (each element is
    written by one rank, so each is counted once); None when a rank recorded none."""
    if any(p.moments is None for p in ranks):
        return None
    merged = {t.name: Moments() for t in tensors}
    for part in ranks:
        for name, raw in part.moments or ():
            if name in merged:
                merged[name].merge(Moments.from_raw(raw))
    unmeasured = (math.nan, math.nan)   # the change from the parent: not measured for distributed snapshots
    return TensorStatsRecord.of_rows([t.name for t in tensors],
                                     [(*merged[t.name].row(t.numel), *unmeasured) for t in tensors])


def full_tree(tree: Any, leaf_names: Sequence[str], tensors: Sequence[TensorEntry], index: dict[str, int],
              sections: Sequence[str]) -> Any:
    """A rank's skeleton with tensor leaves pointing at global entries and sections holding every global tensor."""
    def section(path: str) -> Any:
        items = [[[SCALAR, t.name[len(path) + 1:]], [TENSOR, i]] for i, t in enumerate(tensors)
                 if t.name.startswith(path + "/")]
        return [DICT, items]

    def walk(node: Any, path: str) -> Any:
        if path in sections:
            return section(path)
        tag = node[0]
        if tag in (DICT, ODICT):
            out = []
            for k, v in node[1]:
                key = key_str(unflatten(k, lambda i, n: None))
                out.append([k, walk(v, f"{path}/{key}" if path else key)])
            return [tag, out]
        if tag in (LIST, TUPLE):
            return [tag, [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node[1])]]
        if tag == STATEFUL:
            return [tag, node[1], walk(node[2], path)]
        if tag in (TENSOR, NDARRAY):
            name = leaf_names[node[1]]
            return [tag, index[name]] if name in index else [SCALAR, None]
        return node

    try:
        return walk(tree, "")
    finally:
        walk = None  # type: ignore[assignment]  # noqa: F841 - it calls itself through its closure cell: a cycle


__all__ = ["GroupHealth", "Staging", "all_gather", "assign_writers", "full_tree",
           "merge_rank_manifests", "process_group_rank"]
