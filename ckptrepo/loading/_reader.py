"""Reading tensors of a version: coalesced byte-range reads, verified, scattered into tensors.

Tensors that sit next to each other in a flat array are read as one run, so a
state of many small tensors costs a few large reads. Every tensor gets its own
buffer, filled straight from storage (no copy out of a shared run buffer):

* through TensorStore, one read per tensor of the run, all in one ``ts.Batch``
  so the sharded reads are coalesced; the zarr array checks the crc32c of each
  inner chunk it touches;
* for a local ``file`` store, directly: ``preadv`` of the shard's inner chunks
  into the tensors' memory, each chunk's crc32c (and the shard index's) checked
  here. Anything unexpected (a missing object, a bad checksum, an unusual
  layout) makes that run fall back to the TensorStore read, so errors and their
  messages are exactly those of the TensorStore path.

A failure is turned into an error that names the storage object and the tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tensorstore as ts
import torch

from ckptrepo.core.schema import TensorEntry
from ckptrepo.errors import damaged_object_error, first_line, is_storage_failure, storage_failure
from ckptrepo.state._providers import TORCH_DTYPES
from ckptrepo.storage._arrays import ArrayHandles, ArrayInfo, open_array
from ckptrepo.storage._localread import DirectReader
from ckptrepo.storage.protocol import Store

RUN_BYTES = 8 << 20
INFLIGHT_BYTES = 512 << 20
DIRECT_READS = True  # local file stores: verified preadv reads (localread.py); False: always TensorStore


@dataclass
class _Run:
    array: str
    start: int
    stop: int
    members: list[int] = field(default_factory=list)


def _plan_runs(entries: list[TensorEntry], wanted: list[int], itemsize: Callable[[str], int]) -> list[_Run]:
    by_array: dict[str, list[int]] = {}
    for i in wanted:
        e = entries[i]
        if e.array is not None and e.numel:
            by_array.setdefault(e.array, []).append(i)
    runs: list[_Run] = []
    for array, idxs in by_array.items():
        idxs.sort(key=lambda i: entries[i].offset)
        run: _Run | None = None
        for i in idxs:
            e = entries[i]
            size = itemsize(e.dtype)
            big = e.numel * size >= RUN_BYTES
            if run is not None and not big and run.stop == e.offset and (run.stop - run.start) * size < RUN_BYTES:
                run.stop += e.numel
                run.members.append(i)
            else:
                run = _Run(array, e.offset, e.offset + e.numel, [i])
                runs.append(run)
                if big:
                    run = None
    return runs


def _as_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Zero-copy view of a numpy result as a torch tensor of the stored dtype."""
    return torch.from_numpy(arr.view(np.uint8)).view(TORCH_DTYPES[dtype])


def read_tensors(store: Store, arrays: dict[str, ArrayInfo], entries: list[TensorEntry], wanted: list[int],
                 into: dict[int, torch.Tensor] | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> dict[int, torch.Tensor]:
    """Read the ``wanted`` tensors; copy into ``into[i]`` where given, else return fresh CPU tensors."""
    into = into or {}
    out: dict[int, torch.Tensor] = {}
    for i in wanted:
        e = entries[i]
        if e.numel == 0:
            t = torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype])
            out[i] = into[i] if i in into else t
    handle = ArrayHandles(store, arrays).get

    def itemsize(dtype: str) -> int:
        return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()

    runs = _plan_runs(entries, wanted, itemsize)
    direct = DirectReader.for_store(store) if DIRECT_READS and runs else None
    pending: deque = deque()
    inflight = 0

    def target(i: int) -> torch.Tensor:
        """Where the direct path puts tensor ``i``: the ``into`` tensor itself when it can, else a fresh one."""
        e = entries[i]
        dest = into.get(i)
        if dest is not None and dest.device.type == "cpu" and dest.dtype == TORCH_DTYPES[e.dtype] \
                and dest.is_contiguous() and not dest.requires_grad and not dest.is_conj() and not dest.is_neg():
            return dest
        return torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype])

    def submit_ts(run: _Run) -> list[Any]:
        h = handle(run.array)
        batch = ts.Batch()
        futs = [h[entries[i].offset:entries[i].offset + entries[i].numel].read(batch=batch) for i in run.members]
        batch.submit()
        return futs

    def place(i: int, t: torch.Tensor) -> None:
        if i in into:
            if t.data_ptr() != into[i].data_ptr():
                into[i].copy_(t)
            out[i] = into[i]
        else:
            out[i] = t

    def finish() -> None:
        nonlocal inflight
        run, futs, targets, nbytes = pending.popleft()
        inflight -= nbytes
        if targets is not None:
            try:
                # checked while the reads are in flight (a cold small read costs a disk round trip)
                ok = direct is not None and direct.metadata_ok(arrays[run.array])
                for f in futs:
                    f.result()
            except Exception:  # noqa: BLE001 - anything unexpected: let TensorStore read (and judge) this run
                ok = False
            if not ok:
                futs, targets = submit_ts(run), None
            else:
                for i in run.members:
                    place(i, targets[i])
        if targets is None:
            for i, f in zip(run.members, futs):
                try:
                    data = f.result()
                except Exception as err:  # noqa: BLE001
                    raise _read_error(store, arrays[run.array], run, entries, err) from err
                place(i, _as_torch(data, entries[i].dtype).view(entries[i].shape))
        if on_bytes is not None:
            on_bytes(nbytes)

    try:
        for run in runs:
            nbytes = (run.stop - run.start) * itemsize(entries[run.members[0]].dtype)
            while pending and inflight + nbytes > INFLIGHT_BYTES:
                finish()
            if direct is not None:
                targets = {i: target(i) for i in run.members}
                try:
                    futs = direct.submit(arrays[run.array], run, entries, targets)
                except Exception:  # noqa: BLE001 - e.g. a dtype numpy cannot view: TensorStore reads it
                    pending.append((run, submit_ts(run), None, nbytes))
                else:
                    pending.append((run, futs, targets, nbytes))
            else:
                pending.append((run, submit_ts(run), None, nbytes))
            inflight += nbytes
        while pending:
            finish()
    finally:
        if direct is not None:
            direct.close()
    return out


def _read_error(store: Store, info: ArrayInfo, run: _Run, entries: list[TensorEntry], err: Exception) -> Exception:
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
    names = [entries[i].name for i in run.members
             if any(entries[i].offset < hi and entries[i].offset + entries[i].numel > lo for _, lo, hi in bad)]
    return damaged_object_error(", ".join(info.shard_key(s) for s, _, _ in bad), reason, names)
