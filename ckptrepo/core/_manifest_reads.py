"""Reading version manifests and their headers for one repository handle: cached, and batched on object stores.

Manifests never change once written, so a handle caches what it decoded: a
few whole manifests (loads, diffs, the snapshotter's commits) and many
headers (the small fields history walks need, decoded without the tensor
table and tree). On S3 or GCS every read is a round trip, so passes over
many versions read ``HEADER_BATCH`` manifests per request: history walks once
they prove long (``HeaderWalk``), gc, fsck and du always (``iter_manifests``).
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from ckptrepo.core._lru import LruCache
from ckptrepo.core._manifest import VERSIONS_PREFIX, is_version_id, version_id_time
from ckptrepo.core._schema_records import TensorStatsRecord
from ckptrepo.core.schema import (
    Manifest,
    ManifestHeader,
    decode_header,
    decode_header_and_stats,
    decode_manifest,
)
from ckptrepo.errors import CkptRepoError, CorruptionError
from ckptrepo.storage.protocol import Store

# Decoded manifests a handle keeps: enough for `diff`/`load`/`show`. A handle that cached every manifest it
# saw would grow by one manifest per snapshot for the whole run (thousands of Python objects each, walked by
# every full collection of the cyclic GC); of the versions it commits it keeps the header only.
MANIFEST_CACHE_SIZE = 16
HEADER_CACHE_SIZE = 4096
# Headers a long `log` asks storage for at once when it meets one it has not read: that version and the next
# ones in time order, which a newest-first walk mostly needs next. One round trip instead of 64 on S3/GCS.
HEADER_BATCH = 64
WALK_SINGLE_READS = 16   # headers a first-parent walk reads one by one before it reads them in batches


def missing_manifest(vid: str) -> CorruptionError:
    """The error for a version some ref or parent names whose manifest is not in storage."""
    return CorruptionError(f"version {vid[:12]} is referenced but its manifest {VERSIONS_PREFIX}{vid} "
                           f"is missing; run `ckptrepo fsck`")


def parent_cycle_error(cycle: Sequence[str]) -> CorruptionError:
    """The error for versions whose parent links go round (``cycle``: each one's parent next, the first again
    at the end). Only manifests sealed with wrong parents make one: a version is committed on a parent that
    exists, which cannot name it back."""
    shown = " -> ".join(v[:12] for v in cycle[:8]) + (" -> ..." if len(cycle) > 8 else "")
    return CorruptionError(f"versions {shown} form a parent cycle (their manifests are damaged: a version cannot be "
                           f"its own ancestor); restore those manifests from a backup, and run `ckptrepo fsck`")


def children_first(ids: Sequence[str], parents: Mapping[str, Sequence[str]]) -> list[str]:
    """``ids`` in their given order, except that each waits until all its children among them are placed (what
    gc deletes first, and what ``log --graph`` draws first). Versions on a parent cycle, which never become
    ready, come last, in their given order."""
    position = {v: i for i, v in enumerate(ids)}
    children = dict.fromkeys(position, 0)
    for v in ids:
        for p in set(parents[v]):
            if p in children:
                children[p] += 1
    ready = [position[v] for v in ids if children[v] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = ids[heapq.heappop(ready)]
        order.append(v)
        for p in set(parents[v]):
            if p in children:
                children[p] -= 1
                if children[p] == 0:
                    heapq.heappush(ready, position[p])
    placed = set(order)
    return order + [v for v in ids if v not in placed]


def find_cycle(parents: Mapping[str, Sequence[str]]) -> list[str] | None:
    """A parent cycle among the versions of ``parents`` (version -> its parents; links to versions not in it are
    not followed), as ``parent_cycle_error`` takes it; None when there is none. One depth-first pass without
    recursion: linear in versions and links, and no recursion limit on a long history."""
    done: set[str] = set()
    for root in parents:
        if root in done:
            continue
        path: list[str] = [root]          # the versions on the current descent, each below the previous
        on_path = {root}
        todo: list[Iterator[str]] = [iter(parents[root])]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                done.add(last := path.pop())
                on_path.discard(last)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt in done or nxt not in parents:
                continue
            path.append(nxt)
            on_path.add(nxt)
            todo.append(iter(parents[nxt]))
    return None


class ManifestReads:
    """One handle's manifest and header reads (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._manifests: LruCache[str, Manifest] = LruCache(MANIFEST_CACHE_SIZE)
        self._headers: LruCache[str, ManifestHeader] = LruCache(HEADER_CACHE_SIZE)   # a few hundred bytes each

    def manifest(self, vid: str) -> Manifest:
        """The decoded manifest of version ``vid`` (cached: manifests never change)."""
        m = self._manifests.get(vid)
        if m is None:
            m = decode_manifest(self._sealed(vid), vid)
            self._manifests.put(vid, m)
        return m

    def header(self, vid: str) -> ManifestHeader:
        """The small fields of version ``vid``'s manifest (id, parents, step, time, message, metrics, size,
        stats): all that history walks need, decoded without the tensor table and tree (much faster)."""
        h = self._manifests.get(vid) or self._headers.get(vid)
        if h is None:
            h = decode_header(self._sealed(vid), vid)
            self._headers.put(vid, h)
        return h

    def header_cached(self, vid: str) -> bool:
        """Whether ``vid``'s header (or whole manifest) is in this handle's caches."""
        return self._manifests.get(vid) is not None or self._headers.get(vid) is not None

    def newest_first(self) -> list[str]:
        """Every version id in the store, newest first by the creation time its id holds (one listing)."""
        return sorted(self.all_version_ids(), key=lambda v: version_id_time(v) or 0.0, reverse=True)

    def prefetch_headers(self, vid: str, following: Sequence[str]) -> None:
        """Read the headers of ``vid`` and ``following`` that are not cached, concurrently, into the cache.

        Only ``vid`` must be good: a missing or damaged manifest among the others is skipped here and
        reported by ``header`` if a walk ever needs it.
        """
        wanted = [v for v in dict.fromkeys([vid, *following]) if not self.header_cached(v)]
        if not wanted:
            return
        try:
            raws = self.store.get_many([VERSIONS_PREFIX + v for v in wanted])
        except CkptRepoError:   # one of them cannot be read: each is read, and judged, alone when needed
            return
        for v, raw in zip(wanted, raws):
            if raw is None:
                continue
            try:
                self._headers.put(v, decode_header(raw, v))
            except CkptRepoError:
                if v == vid:
                    raise

    def _sealed(self, vid: str) -> bytes:
        raw = self.store.get(VERSIONS_PREFIX + vid)
        if raw is None:
            raise missing_manifest(vid)
        return raw

    def each_manifest(self, vids: Sequence[str]) -> Iterator[tuple[str, Manifest]]:
        """``iter_manifests`` for passes that cannot go on without every manifest (du): the first error
        is raised instead of yielded. fsck, which reports every damaged version, uses ``iter_manifests``."""
        for vid, m in self.iter_manifests(vids):
            if isinstance(m, CkptRepoError):
                raise m
            yield vid, m

    def iter_manifests(self, vids: Sequence[str]) -> Iterator[tuple[str, Manifest | CkptRepoError]]:
        """Each version's decoded manifest, or the error reading it gave, in order; read ``HEADER_BATCH`` at a
        time with concurrent requests, so a pass over the whole repository (gc, fsck, du) on S3 or GCS waits
        for a round trip per batch, not per version. Manifests this handle has cached are not read again;
        those read here are not cached (such a pass reads each once)."""
        vids = list(vids)
        for at in range(0, len(vids), HEADER_BATCH):
            batch = [v for v in vids[at:at + HEADER_BATCH] if self._manifests.get(v) is None]
            try:
                raws: list[Any] = self.store.get_many([VERSIONS_PREFIX + v for v in batch])
            except CkptRepoError:   # a storage error: read one by one, so it is told against its own version
                raws = [None] * len(batch)
                for k, v in enumerate(batch):
                    try:
                        raws[k] = self.store.get(VERSIONS_PREFIX + v)
                    except CkptRepoError as err:
                        raws[k] = err
            fetched = dict(zip(batch, raws))
            for v in vids[at:at + HEADER_BATCH]:
                raw = fetched.get(v)
                try:
                    if v not in fetched:   # cached when the batch was made (read again if evicted since)
                        m = self.manifest(v)
                    elif isinstance(raw, CkptRepoError):
                        raise raw
                    elif raw is None:
                        raise missing_manifest(v)
                    else:
                        m = decode_manifest(raw, v)
                except CkptRepoError as err:
                    yield v, err
                    continue
                yield v, m

    def stat_records(self, vids: Sequence[str]) -> Iterator[tuple[str, TensorStatsRecord | None]]:
        """Each version's capture-time tensor statistics (None for a version written without them), in order,
        read ``HEADER_BATCH`` manifests per round trip and decoded without their tensor tables. A manifest
        that is missing or damaged raises, as reading its header would."""
        vids = list(vids)
        for at in range(0, len(vids), HEADER_BATCH):
            batch = vids[at:at + HEADER_BATCH]
            cached = {v: m.tensor_stats for v in batch if (m := self._manifests.get(v)) is not None}
            wanted = [v for v in batch if v not in cached]
            raws = self.store.get_many([VERSIONS_PREFIX + v for v in wanted]) if wanted else []
            fetched = dict(zip(wanted, raws))
            for v in batch:
                if v in cached:
                    yield v, cached[v]
                    continue
                raw = fetched[v]
                if raw is None:
                    raise missing_manifest(v)
                header, record = decode_header_and_stats(raw, v)
                self._headers.put(v, header)
                yield v, record

    def remember_header(self, manifest: Manifest) -> None:
        """Cache the header of a manifest this process just committed (manifests never change), which `log`,
        revisions and the next snapshot's parent walk use.

        Not the whole manifest: a snapshotter committing every step would keep its last
        ``MANIFEST_CACHE_SIZE`` manifests (thousands of dicts and lists each) alive long enough for the
        cyclic GC to promote them to its oldest generation, where they bring on full collections of the
        whole process, each a long pause of the training loop with a model loaded. A header is a handful of
        objects; a load reads the manifest when it needs it.
        """
        self._headers.put(manifest.id, manifest.header())

    def all_version_ids(self, prefix: str = "") -> list[str]:
        """Every version manifest in storage whose id starts with ``prefix``, reachable or not."""
        return [k[len(VERSIONS_PREFIX):] for k in self.store.list(VERSIONS_PREFIX + prefix)
                if is_version_id(k[len(VERSIONS_PREFIX):])]


class HeaderWalk:
    """The headers one history walk reads, as ``walk(vid)``: on an object store, in batches once it is long.

    A header not cached is read alone while the walk is short; from the start with ``batch=True``, or after
    ``WALK_SINGLE_READS`` such reads when ``batch`` is None, it is read with the next versions in creation-time
    order (``HEADER_BATCH`` per round trip), which a newest-first walk mostly needs next. The order comes from
    one listing of ``versions/`` (a version id ends with its creation time), which a short walk never pays for:
    listing 100k versions takes 100 requests on S3. ``batch=False``: always one by one.
    """

    def __init__(self, manifests: "ManifestReads", batch: bool | None = None) -> None:
        self.manifests = manifests
        self.batch = batch
        self.reads = 0   # headers this walk read one by one
        self._order: list[str] | None = None
        self._where: dict[str, int] = {}

    def __call__(self, vid: str) -> ManifestHeader:
        manifests = self.manifests
        if self.batch is not False and not manifests.header_cached(vid):
            self.reads += 1
            if self.batch or self.reads > WALK_SINGLE_READS:
                order = self.order()
                i = self._where.get(vid)
                manifests.prefetch_headers(vid, order[i + 1:i + HEADER_BATCH] if i is not None else ())
        return manifests.header(vid)

    def order(self) -> list[str]:
        """Every version id, newest first (listed once per walk): the order batches follow."""
        if self._order is None:
            self._order = self.manifests.newest_first()
            self._where = {v: i for i, v in enumerate(self._order)}
        return self._order

    def chain(self, vid: str | None) -> Iterator[tuple[str, ManifestHeader]]:
        """``vid`` and its first parents, newest first, each with its header; a version met twice is a parent
        cycle, raised as damage (the walk would go round for ever)."""
        for v, h, _ in first_parents(vid, lambda v: (self(v), None)):
            yield v, h


T = TypeVar("T")


def first_parent_chain(vid: str | None, first_parent: Callable[[str], str | None]) -> Iterator[str]:
    """``vid`` and its first parents, newest first, each parent asked of ``first_parent`` only once the version
    before it was taken (a walk that stops early reads no further); a version met twice is a parent cycle, raised
    as damage, where the walk would go round for ever. The history's readers (revisions, logs, trajectories) and
    the bounded walks that look for one version (a commit that landed, a snapshot on its branch) go through here."""
    walked: list[str] = []
    seen: set[str] = set()
    while vid is not None:
        if vid in seen:
            raise parent_cycle_error(walked[walked.index(vid):] + [vid])
        seen.add(vid)
        walked.append(vid)
        yield vid
        vid = first_parent(vid)


def first_parents(vid: str | None, visit: Callable[[str], tuple[ManifestHeader, T]]
                  ) -> Iterator[tuple[str, ManifestHeader, T]]:
    """``vid`` and its first parents, newest first, with what ``visit`` reads of each (its header, and
    anything else); a version met twice is a parent cycle, raised as damage."""
    visited: dict[str, ManifestHeader] = {}

    def parent(v: str) -> str | None:
        parents = visited.pop(v).parents
        return parents[0] if parents else None
    for v in first_parent_chain(vid, parent):
        h, extra = visit(v)
        visited[v] = h
        yield v, h, extra
