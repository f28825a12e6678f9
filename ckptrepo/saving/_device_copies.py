"""CUDA capture in a few calls per segment: the copies as one ``torch._foreach_copy_``, statistics batched.

The capture thread issues each segment's device-to-host copies while the training thread runs. Each torch
call from Python lets go of the GIL and must take it back; a training thread that runs pure Python hands
it back only once per switch interval, so a capture that costs a few calls per tensor takes seconds for a
state of many tensors that the copy engine moves in milliseconds. Here a segment costs a constant number of
calls whatever its tensors:

* the source slices of every segment (views of the state's flattened tensors) are built once per plan and
  kept while the state's tensors stay where they are (same addresses, shapes and strides: a training
  loop's parameters and optimizer moments), so a loop builds them once;
* the destinations are one ``split`` of the staging buffer (the parts of a segment tile it in order), so a
  buffer of the pool needs no views of its own kept;
* the copies are one ``torch._foreach_copy_`` (devices differ, so torch runs its per-tensor loop in C++,
  without the GIL);
* the statistics (saving/_tensor_stats.py) of the segment's parts are taken over the segment gathered on
  the device (one ``cat``), block by block, each block's parts reduced together by ``segment_reduce``.

Strided sources (and ones with a conjugate or negative bit) are flattened on the device for each snapshot
by the caller's ``source`` (a copy there); only their slices are taken anew.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ckptrepo.saving._tensor_stats import DEVICE_BLOCK
from ckptrepo.saving._writer import Segment, WritePlan, copy_flat_range
from ckptrepo.state import TORCH_DTYPES
from ckptrepo.storage import itemsize, numpy_dtype

__all__ = ["DeviceCopies", "StatRows", "segment_stats"]


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    """What must stay the same for a source view built earlier to still be this tensor's bytes."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device, t.is_conj(), t.is_neg())


def _reusable(t: torch.Tensor) -> bool:
    """A tensor whose flattened view is its own memory (no copy): kept across snapshots."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


class DeviceCopies:
    """The source views of one plan's segments, kept across snapshots of the same tensors (one state at a time:
    a new plan or moved tensors rebuild them, and let go of the old ones)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type   # the tensors copied by _foreach_copy_ (tests: "cpu"); others by numpy
        self._plan: WritePlan | None = None
        self._key: list[tuple[Any, ...]] = []                 # per plan index: where its tensor was
        self._flat: dict[int, torch.Tensor | None] = {}       # plan index -> flattened view (None: per snapshot)
        self._sources: dict[int, list[torch.Tensor | None]] = {}   # segment index -> source slices
        self._sizes: dict[int, list[int]] = {}               # segment index -> split sizes (gaps and parts)
        self._blocks: dict[tuple[Any, ...], list[_Block]] = {}   # (segment, fed parts) -> statistics blocks
        self._segments_of: dict[int, list[int]] = {}        # plan index -> the segments it has parts in
        self.builds = 0    # how often a plan's views were built: a training loop builds them once
        self.rebuilt = 0   # tensors whose views were (re)built

    def prepare(self, plan: WritePlan, tensors: Sequence[torch.Tensor], stream: Any = None) -> None:
        """Make the views of ``plan`` over ``tensors`` (its sources, in plan order) current: all built for a new
        plan, and for a known one only those of the tensors that moved (a copy ``snapshot()`` made of a
        module's buffers is a new tensor each time; the parameters and moments are not). ``stream``: the
        side stream the copies run on, recorded on the kept tensors' memory so the allocator never hands
        it out while a copy may read it."""
        key = [_where(t) for t in tensors]
        if plan is not self._plan:
            self.release()
            self._plan = plan
            self.builds += 1
            for k, seg in enumerate(plan.segments):
                for idx, *_ in seg.parts:
                    self._segments_of.setdefault(idx, []).append(k)
            moved: Sequence[int] = range(len(tensors))
        else:
            moved = [i for i, (a, b) in enumerate(zip(key, self._key)) if a != b]
        self._key = key
        for i in moved:
            t = tensors[i]
            for k in self._segments_of.get(i, ()):
                self._sources.pop(k, None)
            self.rebuilt += 1
            if t.device.type == self.device_type and _reusable(t):
                flat = t.reshape(-1)
                if stream is not None and flat.is_cuda:
                    flat.record_stream(stream)
                self._flat[i] = flat
            else:
                self._flat[i] = None

    def release(self) -> None:
        """Let go of every kept view (the state's memory is no longer held here)."""
        self._plan, self._key = None, []
        self._flat, self._sources, self._sizes, self._blocks, self._segments_of = {}, {}, {}, {}, {}

    def fill(self, k: int, seg: Segment, buf: torch.Tensor, source: Callable[[int], torch.Tensor],
             feeds: Mapping[int, Any] | None = None, non_blocking: bool = True) -> np.ndarray:
        """Queue segment ``k``'s copies into ``buf`` on the current stream (one call for its CUDA parts) and feed
        its statistics; returns the numpy view TensorStore will write, as ``fill_segment`` does.
        ``source(i)`` gives a tensor whose view is not kept: a strided CUDA one flattened on the device for
        this snapshot, or a CPU one, copied by numpy as ``fill_segment`` copies it."""
        srcs = self._sources.get(k)
        if srcs is None:
            srcs = self._sources[k] = [None if (flat := self._flat.get(idx)) is None else flat[s:s + n]
                                       for idx, s, _, n in seg.parts]
            self._sizes[k] = _split_sizes(seg)
        item = itemsize(seg.dtype)
        raw = buf[:(seg.stop - seg.start) * item]
        raw_np = raw.numpy()
        dsts = raw.view(TORCH_DTYPES[seg.dtype]).split(self._sizes[k])[1::2]   # parts, between (empty) gaps
        on_device: list[int] = []          # positions in seg.parts of the parts copied from the device
        parts: list[torch.Tensor] = []
        for j, (v, (idx, s, dst, n)) in enumerate(zip(srcs, seg.parts)):
            if v is None:
                t = source(idx)
                if t.device.type != self.device_type:
                    staged = raw_np[dst * item:(dst + n) * item]
                    copy_flat_range(staged, t, s, n)
                    if feeds is not None and idx in feeds:
                        feeds[idx].update(staged)
                    continue
                v = t.reshape(-1)[s:s + n]
            on_device.append(j)
            parts.append(v)
        if parts:
            torch._foreach_copy_([dsts[j] for j in on_device], parts, non_blocking=non_blocking)
            if feeds:
                self._feed(k, seg, on_device, parts, feeds)
        return raw_np.view(numpy_dtype(seg.dtype))

    def _feed(self, k: int, seg: Segment, on_device: list[int], parts: list[torch.Tensor],
              feeds: Mapping[int, Any]) -> None:
        """Device statistics of the fed parts, in one batch; a feed without ``add_row`` gets its slices."""
        batched: list[tuple[int, torch.Tensor, Any]] = []
        for j, part in zip(on_device, parts):
            f = feeds.get(seg.parts[j][0])
            if f is None:
                continue
            if hasattr(f, "add_row"):
                batched.append((j, part, f))
            else:
                f.update_device(part)
        if not batched:
            return
        key = (k, tuple(j for j, _, _ in batched))
        blocks = self._blocks.get(key)
        if blocks is None:
            blocks = self._blocks[key] = plan_blocks([seg.parts[j][3] for j, _, _ in batched], batched[0][1].device)
        for block, rows in zip(blocks, segment_stats([p for _, p, _ in batched], blocks)):
            for r, (pos, n) in enumerate(block.owners):
                batched[pos][2].add_row(rows, r, n)


def _split_sizes(seg: Segment) -> list[int]:
    """``split`` sizes that cut a segment's buffer into gap, part, gap, part, ..., tail (parts at odd places)."""
    sizes, pos = [], 0
    for _, _, dst, n in seg.parts:
        sizes += [dst - pos, n]
        pos = dst + n
    sizes.append(seg.stop - seg.start - pos)
    return sizes


class _Block:
    """A block of a segment's gathered parts, reduced together: elements ``[lo, hi)`` of the gather, the
    parts' lengths in it (on the device, for ``segment_reduce``) and, per row, (fed part, elements)."""

    __slots__ = ("lo", "hi", "lengths", "owners")

    def __init__(self, lo: int, hi: int, lengths: torch.Tensor, owners: list[tuple[int, int]]) -> None:
        self.lo, self.hi, self.lengths, self.owners = lo, hi, lengths, owners


def plan_blocks(counts: Sequence[int], device: Any = "cpu", block: int = DEVICE_BLOCK) -> list[_Block]:
    """Cut the concatenation of parts of ``counts`` elements into blocks of at most ``block`` elements; a
    part across a block edge is a row in each (their statistics merge like any two parts')."""
    total = sum(counts)
    starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    out = []
    for lo in range(0, total, block):
        hi = min(total, lo + block)
        owners = []
        for pos, n in enumerate(counts):
            a, b = max(lo, int(starts[pos])), min(hi, int(starts[pos]) + n)
            if b > a:
                owners.append((pos, b - a))
        lengths = torch.tensor([n for _, n in owners], dtype=torch.int64).to(device)
        out.append(_Block(lo, hi, lengths, owners))
    return out


class StatRows:
    """Per-row statistics of a block on the device (mean, dev, min, max, NaN count, Inf count), read to the
    host once, when the first tensor's ``moments`` asks (after the capture synchronised its copies)."""

    __slots__ = ("device", "_host")

    def __init__(self, device: torch.Tensor) -> None:
        self.device = device
        self._host: list[list[float]] | None = None

    def host(self) -> list[list[float]]:
        if self._host is None:
            self._host = self.device.cpu().tolist()
            self.device = None   # type: ignore[assignment]  # its device memory goes back to the allocator
        return self._host


def segment_stats(parts: Sequence[torch.Tensor], blocks: Sequence[_Block]) -> list[StatRows]:
    """Each block's per-row statistics, as ``DeviceStats.update_device`` takes them per block: converted to
    float32 (float64 stays), summed in float64, deviations centred on each row's own mean. Queued on the
    current stream; nothing waits for the device. Temporaries: a few float64 copies of one block."""
    x_all = torch.cat(list(parts)) if len(parts) > 1 else parts[0]
    if x_all.is_complex():
        x_all = x_all.abs()
    if x_all.dtype not in (torch.float32, torch.float64):   # integers exact in float64, halves in float32
        x_all = x_all.float() if x_all.is_floating_point() else x_all.double()
    out = []
    for b in blocks:
        x = x_all[b.lo:b.hi]
        n = b.hi - b.lo
        lo = torch.segment_reduce(x, "min", lengths=b.lengths, unsafe=True)
        hi = torch.segment_reduce(x, "max", lengths=b.lengths, unsafe=True)
        d = x.to(torch.float64, copy=True)
        mean = torch.segment_reduce(d, "sum", lengths=b.lengths, unsafe=True) / b.lengths
        d.sub_(mean.repeat_interleave(b.lengths, output_size=n)).square_()
        dev = torch.segment_reduce(d, "sum", lengths=b.lengths, unsafe=True).sqrt_()
        del d
        # counts in float32: exact below 2**24, and a block is smaller
        nan = torch.segment_reduce(torch.isnan(x).float(), "sum", lengths=b.lengths, unsafe=True)
        inf = torch.segment_reduce(torch.isinf(x).float(), "sum", lengths=b.lengths, unsafe=True)
        out.append(StatRows(torch.stack([mean, dev, lo.double(), hi.double(), nan.double(), inf.double()], dim=1)))
    return out
