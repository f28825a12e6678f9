"""The one read engine behind every load and every inspection tool: a plan of reads, executed.

A plan is a list of :class:`Read`: an element range ``[start, stop)`` of one
flat array of a version, and where those elements go (the subclass says:
a whole tensor for plain loads, a box of a target view for layout loads).
Executing a plan

* coalesces it per array into runs: reads that follow each other up to
  ``RUN_BYTES``, and any read that shares an inner chunk with the run before
  it (so that chunk is read once);
* reads each run, at most ``INFLIGHT_BYTES`` of runs at a time, either
  directly from the shard files (:class:`ckptrepo.storage._localread.DirectReader`:
  ``preadv`` straight into the destination's memory, crc32c checked there) when the
  store offers local files, or through TensorStore (one byte-range read per
  read, all issued together in one ``ts.Batch``; the zarr array checks the
  crc32c of each inner chunk it touches);
* hands each read its elements: in place (the direct reader wrote them where the
  read said), or as a buffer the read scatters from (TensorStore's result, or a
  scratch buffer the direct reader filled).

The fallback rule, the only one: a run the direct reader cannot read (it is
unavailable for the store, the run's geometry or destinations are unusual, the
array's ``zarr.json`` disagrees with the manifest, or any read task meets
something unexpected: a missing object, a bad checksum, a short read) is read
again, whole, through TensorStore, which judges it. So every error, and its
message, is TensorStore's, turned by :func:`_read_error` into one that names the
damaged storage objects and the tensors in them, or into a StorageError when the
store failed us.

``ReadStats`` counts what a layout load needed and asked for;
:func:`kvstore_bytes_read` what storage actually delivered.
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from ckptrepo.errors import (
    CorruptionError,
    damaged_object_error,
    first_line,
    is_storage_failure,
    some_names,
    storage_failure,
)
from ckptrepo.loading._digest_check import DigestFeed, check_read, check_reads, check_rows
from ckptrepo.storage import (
    ArrayInfo,
    DirectReader,
    FrameCheck,
    StoredShards,
    Unexpected,
    bytes_read,
    checkable,
    chunk_crcs,
    first_mismatch,
    foreign_chunk_error,
    local_bytes_read,
    open_array,
    read_table,
)
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:   # imported where used: a plan of numpy reads from local files needs neither (diff, stats)
    import tensorstore as ts
    import torch

RUN_BYTES = 8 << 20          # reads that follow each other are coalesced up to this; a bigger read stands alone
INFLIGHT_BYTES = 512 << 20   # runs in flight at once: bounds TensorStore's result buffers and the scratch
DIRECT_READS = True          # stores with local files: verified preadv reads (_localread); False: always TensorStore
LIST_BEFORE_BYTES = 1 << 30  # on a store without local files, a plan reading this much of an array lists its shards


@dataclass
class ReadStats:
    """Bytes a load needed, the bytes it asked storage for, and how many reads."""

    needed_bytes: int = 0
    requested_bytes: int = 0
    spans: int = 0
    runs: int = 0


def kvstore_bytes_read() -> int:
    """Bytes this process has read from storage so far: every TensorStore kvstore driver's own counter
    (file, s3, gcs, memory) plus the direct local-file paths' (tensor data, small objects)."""
    import tensorstore as ts
    total = bytes_read() + local_bytes_read()
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if m["name"].endswith("/bytes_read"):
            total += sum(int(v.get("value", 0)) for v in m.get("values", []))
    return total


class Read:
    """Elements ``[start, stop)`` of flat array ``array``, and where they go (a subclass says where).

    ``digest``: where the read covers one stored piece exactly, the content digest the manifest records of it
    (and ``box``, the piece's box), checked once the elements are read (loading/_digest_check.py)."""

    __slots__ = ("array", "start", "stop", "digest", "box")

    def __init__(self, array: str, start: int, stop: int) -> None:
        self.array, self.start, self.stop = array, start, stop
        self.digest: bytes | None = None
        self.box: Any = None

    @property
    def offset(self) -> int:   # the direct reader's view of a read (see DirectReader.submit)
        return self.start

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def names(self) -> list[str]:
        """The tensors this read fills: what an error names."""
        raise NotImplementedError

    def prepare(self, info: ArrayInfo) -> None:
        """Called for every read of a plan that the direct reader reads, before any read starts: what calls into
        torch belongs here (torch lets go of the GIL in each call, and once the reader threads run, taking it
        back costs a thread switch each time)."""

    def direct_target(self, info: ArrayInfo) -> Any:
        """Where the direct reader may write the elements itself: a contiguous CPU tensor or numpy byte buffer
        of exactly ``numel`` elements, or a row target (``scatter(buf, lo, hi)``, see DirectReader); None: into
        a scratch buffer that :meth:`fill` gets. Asked as the read's run is issued, so buffers made here live
        only while at most ``INFLIGHT_BYTES`` of runs are in flight."""
        return None

    def direct_done(self) -> None:
        """The direct reader filled :meth:`direct_target`'s memory (on the thread that executes the plan)."""

    def fill(self, src: torch.Tensor) -> None:
        """Take the elements from ``src`` (1-D, the array's dtype, element ``start`` first; what
        :meth:`elements` makes of the bytes): TensorStore's result, or the scratch a direct read filled (then on
        a reader thread: no other read shares its bytes)."""
        raise NotImplementedError

    def elements(self, raw: np.ndarray, dtype: str) -> Any:
        """The read's stored bytes ``raw`` (numpy uint8) as :meth:`fill` takes them: a tensor of ``dtype``. A read
        that fills numpy memory returns ``raw`` itself, so that its plans import no torch."""
        return _tensor_of(raw, dtype)


@dataclass
class _Run:
    """Reads of one array coalesced into one read: ``members`` and ``start``/``stop`` as DirectReader takes them."""

    array: str
    start: int
    stop: int
    reads: list[Read] = field(default_factory=list)

    @property
    def members(self) -> range:
        return range(len(self.reads))

    def nbytes(self, info: ArrayInfo) -> int:
        return sum(r.numel for r in self.reads) * info.itemsize


def _coalesce(reads: Iterable[Read], arrays: dict[str, ArrayInfo]) -> list[_Run]:
    ordered = sorted((r for r in reads if r.stop > r.start), key=lambda r: (r.array, r.start))
    out: list[_Run] = []
    run: _Run | None = None
    for r in ordered:
        if r.array not in arrays:
            raise CorruptionError(f"the manifest refers to array {r.array}, which it does not describe")
        if run is not None and run.array == r.array and r.start >= run.stop:
            info = arrays[r.array]
            inner, item = info.inner_elems, info.itemsize
            shares_chunk = r.start // inner <= (run.stop - 1) // inner
            follows = r.start == run.stop and (run.stop - run.start) * item < RUN_BYTES \
                and r.numel * item < RUN_BYTES
            if shares_chunk or follows:
                run.reads.append(r)
                run.stop = r.stop
                continue
        run = _Run(r.array, r.start, r.stop, [r])
        out.append(run)
    return out


class Engine:
    """Executes read plans on one version's arrays (opened once: keep one when executing many plans)."""

    def __init__(self, store: Store, arrays: dict[str, ArrayInfo]) -> None:
        self.store = store
        self.arrays = arrays   # the caller may add arrays between plans (another version's, for dedup'd pieces)
        self._handles: dict[str, ts.TensorStore] = {}
        self._tables: dict[str, np.ndarray | None] = {}
        self._frames: dict[str, FrameCheck] = {}

    def table(self, key: str) -> np.ndarray | None:
        """Array ``key``'s chunk table, checked against the manifest (once); None: not content-bound."""
        if key not in self._tables:
            self._tables[key] = read_table(self.store, self.arrays[key])
        return self._tables[key]

    def check_frames(self, runs: list[_Run]) -> None:
        """Before TensorStore decodes the chunks of a compressed array's ``runs``: each must declare exactly a
        chunk's bytes (storage/_frames.py: TensorStore inflates a zstd bomb before it compares sizes). The
        headers of all the runs are read together (checked ones are not read again)."""
        key = runs[0].array
        frames = self._frames.get(key)
        if frames is None:
            frames = self._frames[key] = FrameCheck(self.store, self.arrays[key])
        inner = self.arrays[key].inner_elems

        def names(chunk: int) -> list[str]:
            return _names([r for run in runs if run.start // inner <= chunk <= (run.stop - 1) // inner
                           for r in run.reads])
        try:
            frames.check([(run.start, run.stop) for run in runs], names)
        except CorruptionError:
            raise
        except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError and friends
            reason = first_line(err)
            if is_storage_failure(reason):
                raise storage_failure(f"reading {key}", reason) from err
            raise damaged_object_error(key, reason, _names([r for run in runs for r in run.reads])) from err

    def handle(self, run: _Run) -> ts.TensorStore:
        """The run's array opened through TensorStore (once); one that cannot be opened is named like a
        damaged shard, with the run's tensors."""
        h = self._handles.get(run.array)
        if h is None:
            try:
                h = self._handles[run.array] = open_array(self.store, self.arrays[run.array])
            except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError and friends
                reason = first_line(err)
                if is_storage_failure(reason):
                    raise storage_failure(f"opening array {run.array}", reason) from err
                raise damaged_object_error(run.array, reason, _names(run.reads)) from err
        return h

    def execute(self, reads: Iterable[Read], on_bytes: Callable[[int], None] | None = None) -> None:
        """Read every read of the plan and hand it its elements; ``on_bytes`` is told each run's bytes once read."""
        runs = _coalesce(reads, self.arrays)
        if not runs:
            return
        _check_stored(self.store, self.arrays, runs)
        direct = DirectReader.for_store(self.store) if DIRECT_READS else None
        _Execution(self, direct, on_bytes).run(runs)


class _Execution:
    """One plan's reads in flight: a window of runs, each read directly or by TensorStore."""

    def __init__(self, engine: Engine, direct: DirectReader | None, on_bytes: Callable[[int], None] | None) -> None:
        self.engine, self.arrays, self.direct, self.on_bytes = engine, engine.arrays, direct, on_bytes
        self.batch: ts.Batch | None = None   # TensorStore reads issued since the last wait, not yet submitted

    def run(self, runs: list[_Run]) -> None:
        arrays, direct = self.arrays, self.direct
        if direct is not None:
            for run in runs:
                info = arrays[run.array]
                for r in run.reads:
                    r.prepare(info)
        # the direct reader checks the frames it inflates itself; TensorStore's runs are checked here, together
        self._check_frames([run for run in runs if not self._direct(arrays[run.array])])
        pending: deque[tuple[_Run, _DirectRead | _BoundRead | list[Any], int]] = deque()
        inflight = 0
        try:
            for run in runs:
                nbytes = run.nbytes(arrays[run.array])
                while pending and inflight + nbytes > INFLIGHT_BYTES:
                    inflight -= self._finish(*pending.popleft())
                pending.append((run, self._submit(run), nbytes))
                inflight += nbytes
            while pending:
                self._finish(*pending.popleft())
        finally:
            if direct is not None:
                direct.close()

    def _check_frames(self, runs: list[_Run]) -> None:
        """The compressed chunks of the plan, checked before any is read (engine.check_frames): per array, the
        runs of up to ``INFLIGHT_BYTES`` at a time, so that a load from an object store waits two round trips
        per window rather than per run."""
        window: dict[str, list[_Run]] = {}
        size: dict[str, int] = {}
        for run in runs:
            info = self.arrays[run.array]
            if info.compression is None:
                continue
            window.setdefault(run.array, []).append(run)
            size[run.array] = size.get(run.array, 0) + run.nbytes(info)
            if size[run.array] >= INFLIGHT_BYTES:
                self.engine.check_frames(window.pop(run.array))
                size[run.array] = 0
        for group in window.values():
            self.engine.check_frames(group)

    def _direct(self, info: ArrayInfo) -> bool:
        """Whether the direct reader reads this array's runs (compressed ones need the blosc decoder)."""
        return self.direct is not None and self.direct.reads(info)

    def _submit(self, run: _Run) -> _DirectRead | _BoundRead | list[Any]:
        """Start a run's reads: the direct read in flight, or (no direct reader) TensorStore's futures."""
        info = self.arrays[run.array]
        if self.direct is None or not self._direct(info):
            return self._submit_ts(run)
        table = self.engine.table(run.array)
        try:
            dests = [r.direct_target(info) for r in run.reads]
            scratch = [_empty_tensor(r.numel, info.dtype) if d is None else None for r, d in zip(run.reads, dests)]
        except (MemoryError, RuntimeError) as err:
            if isinstance(err, RuntimeError) and "allocate" not in str(err):
                raise
            raise _no_memory(run, info, err) from None
        where: dict[int, Any] = {k: d if d is not None else s for k, (d, s) in enumerate(zip(dests, scratch))}
        views: dict[int, np.ndarray | None] = {}
        try:
            # each destination's bytes, made once: where the reader writes, and what a digest is taken over
            views = {k: _bytes_of(t) for k, t in where.items()}
            targets: dict[int, Any] = {k: where[k] if v is None else v for k, v in views.items()}
            futs = self.direct.submit(info, run, run.reads, targets, table)
        except Exception:  # noqa: BLE001 - e.g. a destination numpy cannot view: the fallback rule applies
            futs = [_failed()]
        # a read into scratch is handed its elements by the reader thread that finishes the last task covering
        # it, while later tasks still read; not here: this thread would queue for the GIL between copies
        filled = [_when_all([f for f in futs if _covers(f, r)], partial(r.fill, s))
                  for r, s in zip(run.reads, scratch) if s is not None]
        # a read of a whole piece is hashed on the reader threads (_digest_check.py): the reads one task holds
        # whole, together once it is done; a longer one as its tasks finish; one that fills rows of a strided
        # target, once they all have
        checks: list[Future] = []
        alone: dict[int, tuple[Future, list[tuple[Read, np.ndarray]]]] = {}
        for k, r in enumerate(run.reads):
            if not checkable(r.digest):
                continue
            covering = [f for f in futs if _covers(f, r)]
            buf = views.get(k)
            if buf is not None and len(covering) == 1:
                alone.setdefault(id(covering[0]), (covering[0], []))[1].append((r, buf))
            elif buf is not None:
                checks.append(DigestFeed(r, buf, info.itemsize, covering).done)
            elif hasattr(where[k], "rows"):
                checks.append(_when_all(covering, partial(check_rows, r, where[k].rows())))
        checks += [_when_all([task], partial(check_reads, reads)) for task, reads in alone.values()]
        return _DirectRead(_when_all(futs + filled + checks, _nothing))

    def _submit_ts(self, run: _Run) -> _BoundRead | list[Any]:
        import tensorstore as ts
        if self.batch is None:
            self.batch = ts.Batch()
        h = self.engine.handle(run)
        table = self.engine.table(run.array)
        info = self.arrays[run.array]
        if info.compression is not None:   # nothing to do where run() checked it with its neighbours
            self.engine.check_frames([run])
        if table is None:
            return [h[r.start:r.stop].read(batch=self.batch) for r in run.reads]
        # whole inner chunks, so that each one's crc32c can be checked against the table: TensorStore checks
        # the stored crc32c against the bytes, not against the version
        inner, numel = info.inner_elems, info.numel
        lo, hi = run.start // inner * inner, min(numel, -(-run.stop // inner) * inner)
        return _BoundRead(h[lo:hi].read(batch=self.batch), lo, table)

    def _finish(self, run: _Run, futs: _DirectRead | _BoundRead | list[Any], nbytes: int) -> int:
        """Wait for a run, hand its reads their elements (falling back to TensorStore where the direct read
        failed); returns its bytes."""
        info = self.arrays[run.array]
        if isinstance(futs, _DirectRead):
            try:
                # checked while the reads are in flight (a cold small read costs a disk round trip)
                ok = self.direct is not None and self.direct.metadata_ok(info)
                futs.done.result()
            except Exception:  # noqa: BLE001 - anything unexpected: TensorStore reads (and judges) the run
                ok = False
            if ok:
                for r in run.reads:
                    r.direct_done()
            else:
                futs = self._submit_ts(run)
        if isinstance(futs, _BoundRead):
            self._submit_batch()
            try:
                data = futs.future.result()
            except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError and friends
                raise _read_error(self.engine.store, info, run, err) from err
            raw = data.view(np.uint8)
            first = futs.start // info.inner_elems
            bad = first_mismatch(futs.table, first, chunk_crcs(info, raw))
            if bad is not None:
                raise foreign_chunk_error(info, first + bad, _names(run.reads))
            item = info.itemsize
            for r in run.reads:
                mine = raw[(r.start - futs.start) * item:(r.stop - futs.start) * item]
                check_read(r, mine)
                r.fill(r.elements(mine, info.dtype))
        elif not isinstance(futs, _DirectRead):
            self._submit_batch()
            for r, f in zip(run.reads, futs):
                try:
                    data = f.result()
                except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError and friends
                    raise _read_error(self.engine.store, info, run, err) from err
                check_read(r, data.view(np.uint8))
                r.fill(r.elements(data.view(np.uint8), info.dtype))
        if self.on_bytes is not None:
            self.on_bytes(nbytes)
        return nbytes

    def _submit_batch(self) -> None:
        if self.batch is not None:   # every read issued so far goes out together
            self.batch.submit()
            self.batch = None


class _BoundRead:
    """A run of a content-bound array read through TensorStore in whole inner chunks from element ``start``,
    to be checked against the array's chunk ``table``."""

    __slots__ = ("future", "start", "table")

    def __init__(self, future: Any, start: int, table: np.ndarray) -> None:
        self.future, self.start, self.table = future, start, table


class _DirectRead:
    """A run's direct read in flight: done once every task (and every fill from scratch) is."""

    __slots__ = ("done",)

    def __init__(self, done: Future) -> None:
        self.done = done


def _check_stored(store: Store, arrays: dict[str, ArrayInfo], runs: list[_Run]) -> None:
    """Refuse a plan whose shard objects cannot hold what the manifest declares, before any memory is
    allocated for it: a manifest declaring an 8 GiB tensor over a few small shards would otherwise allocate
    8 GiB and then fail (or abort under a memory cap).

    On a store of local files every shard the plan touches is looked at (missing, short, not a regular file:
    a FIFO would also block TensorStore's read). Elsewhere the objects are listed only for an array the plan
    reads ``LIST_BEFORE_BYTES`` or more of: a listing costs a round trip, and smaller reads allocate little."""
    local = store.capabilities.file_root is not None
    planned: dict[str, int] = {}
    for run in runs:
        planned[run.array] = planned.get(run.array, 0) + run.nbytes(arrays[run.array])
    shards: dict[str, StoredShards] = {}
    for run in runs:
        info = arrays[run.array]
        if not local and planned[run.array] < LIST_BEFORE_BYTES:
            continue
        stored = shards.setdefault(run.array, StoredShards(store, info))
        # one shard at a time, stopping at the first bad one: a huge declared size is never enumerated
        for s in range(run.start // info.shard_elems, (run.stop - 1) // info.shard_elems + 1):
            problem = stored.problem(s)
            if problem is not None:
                lo, hi = s * info.shard_elems, (s + 1) * info.shard_elems
                names = _names([r for r in run.reads if r.start < hi and r.stop > lo])
                raise damaged_object_error(info.shard_key(s), "it does not exist" if problem == "missing" else problem,
                                           names)


def _no_memory(run: _Run, info: ArrayInfo, err: BaseException) -> MemoryError:
    """One line for a load whose tensors do not fit in memory (torch says RuntimeError; the stored objects
    were checked first, so the sizes are real)."""
    return MemoryError(f"not enough memory for tensor(s) {some_names(_names(run.reads))} "
                       f"({run.nbytes(info)} bytes): {first_line(err)}")


def _read_error(store: Store, info: ArrayInfo, run: _Run, err: Exception) -> Exception:
    """Name the shard object(s) that fail and the tensors that live in them; a store that failed us is a
    StorageError (no shard is read again: each read would spend its retries too)."""
    reason = first_line(err)
    if is_storage_failure(reason):
        return storage_failure(f"reading {info.key}", reason)
    bad = []
    first, last = run.start // info.shard_elems, (run.stop - 1) // info.shard_elems
    for s in range(first, last + 1):
        lo, hi = max(run.start, s * info.shard_elems), min(run.stop, (s + 1) * info.shard_elems)
        try:
            open_array(store, info)[lo:hi].read().result()
        except Exception as again:  # noqa: BLE001
            if is_storage_failure(why := first_line(again)):
                return storage_failure(f"reading {info.key}", why)
            bad.append((s, lo, hi))
    if not bad:
        return storage_failure(f"reading {info.key}", reason)
    names = _names([r for r in run.reads if any(r.start < hi and r.stop > lo for _, lo, hi in bad)])
    return damaged_object_error(", ".join(info.shard_key(s) for s, _, _ in bad), reason, names)


def _names(reads: list[Read]) -> list[str]:
    """The tensors the reads fill, each once, in order."""
    return list(dict.fromkeys(n for r in reads for n in r.names()))


def _nothing() -> None:
    pass


def _bytes_of(target: Any) -> np.ndarray | None:
    """A direct read's destination (a contiguous tensor or numpy bytes) as flat numpy bytes; None for a row
    target, whose bytes are not in one place."""
    if isinstance(target, np.ndarray):
        return target.reshape(-1).view(np.uint8)
    torch = sys.modules.get("torch")   # a tensor exists only once torch is imported: no import for numpy plans
    if torch is not None and isinstance(target, torch.Tensor):
        return target.reshape(-1).view(torch.uint8).numpy()
    return None


@lru_cache(maxsize=None)
def _torch_dtype(dtype: str) -> torch.dtype:
    from ckptrepo.state import TORCH_DTYPES
    return TORCH_DTYPES[dtype]


def _tensor_of(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored bytes as a 1-D tensor of ``dtype`` sharing their memory."""
    import torch
    return torch.from_numpy(raw).view(_torch_dtype(dtype))


def _empty_tensor(numel: int, dtype: str) -> torch.Tensor:
    import torch
    return torch.empty(numel, dtype=_torch_dtype(dtype))


def _failed() -> Future:
    f: Future = Future()
    f.set_exception(Unexpected("the direct reader refused the run"))
    return f


def _covers(fut: Future, r: Read) -> bool:
    """Whether a direct read task holds part of the read (a task without a range: assume it does)."""
    lo, hi = getattr(fut, "elems", (r.start, r.stop))
    return lo < r.stop and hi > r.start


def _when_all(futs: list[Future], then: Callable[[], None]) -> Future:
    """A future that runs ``then`` in the thread that completes the last of ``futs`` once all succeeded.

    Callbacks, not a waiting task: a task waiting in the same pool for others could starve it.
    """
    done: Future = Future()
    left = [len(futs)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(f: Future) -> None:
        # a task the reader cancelled once the load failed: its exception() would raise in this callback
        err = CancelledError() if f.cancelled() else f.exception()
        with lock:
            if err is not None:
                errors.append(err)
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        if errors:
            done.set_exception(errors[0])
            return
        try:
            then()
        except BaseException as err2:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err2)
        else:
            done.set_result(None)

    if not futs:   # nothing to wait for: run it now
        futs = [Future()]
        left[0] = 1
        futs[0].set_result(None)
    for f in futs:
        f.add_done_callback(one)
    return done


__all__ = ["DIRECT_READS", "Engine", "Read", "ReadStats", "kvstore_bytes_read"]
