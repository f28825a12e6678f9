"""Box arithmetic for sharded tensors: intersections, row-major runs, flat ranges as boxes.

A *box* is ``(offsets, sizes)`` in a tensor's global coordinates. A saved
piece stores its box's elements contiguous and row-major, so the part of a
piece another box needs is a set of equally long, equally spaced element runs
(:func:`runs`). A ZeRO flat partition cuts a tensor's row-major element order
at arbitrary points; :func:`flat_boxes` turns such a range back into the few
boxes it covers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ckptrepo.errors import LayoutError

if TYPE_CHECKING:
    import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return tuple(strides)


def runs(piece: Box, part: Box) -> tuple[np.ndarray, int]:
    """Element runs of ``part`` (inside ``piece``) in the piece's row-major storage: ``(starts, length)``.

    Trailing dimensions that ``part`` spans fully merge into one run, so a
    part that is a contiguous slab of the piece is a single run.
    """
    # imported here: manifests import this module, and history commands never read a piece
    import numpy as np
    poff, psz = piece
    qoff, qsz = part
    nd = len(psz)
    if nd == 0:
        return np.zeros(1, dtype=np.int64), 1
    strides = row_major_strides(psz)
    k = nd - 1
    while k >= 0 and qsz[k] == psz[k]:
        k -= 1
    if k < 0:
        return np.zeros(1, dtype=np.int64), volume(psz)
    length = qsz[k] * strides[k]
    starts = np.array([(qoff[k] - poff[k]) * strides[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):
        idx = (np.arange(qsz[d], dtype=np.int64) + (qoff[d] - poff[d])) * strides[d]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return starts, length


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[int, Box]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes, each contiguous in that order.

    Returns ``(flat start, box)`` pairs in order: at most a partial first row,
    a block of whole rows and a partial last row per dimension.
    """
    shape = tuple(shape)
    if hi <= lo:
        return []
    if len(shape) == 0:
        return [(0, ((), ()))]
    if len(shape) == 1:
        return [(lo, ((lo,), (hi - lo,)))]
    inner = volume(shape[1:])
    out: list[tuple[int, Box]] = []

    def rows(r: int, a: int, b: int) -> None:   # part [a, b) of row r
        if a == 0 and b == inner:
            out.append((r * inner, ((r,) + (0,) * (len(shape) - 1), (1,) + shape[1:])))
            return
        for start, (o, s) in flat_boxes(shape[1:], a, b):
            out.append((r * inner + start, ((r,) + o, (1,) + s)))

    r0, a0 = divmod(lo, inner)
    r1, b1 = divmod(hi, inner)
    if r0 == r1:
        rows(r0, a0, b1)
        return out
    if a0:
        rows(r0, a0, inner)
        r0 += 1
    if r1 > r0:
        out.append((r0 * inner, ((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:])))
    if b1:
        rows(r1, 0, b1)
    return out


def slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def check_coverage(tensors: dict[str, tuple[Sequence[int], list[Box]]]) -> None:
    """Every tensor's pieces must cover it exactly once: no overlap, no gap."""
    for name, (shape, boxes) in tensors.items():
        for offs, sizes in boxes:   # inside the tensor: a stray piece cannot make up for a missing one
            if len(offs) != len(shape) or any(o < 0 or z < 0 or o + z > d for o, z, d in zip(offs, sizes, shape)):
                raise LayoutError(f"{name}: a saved piece {_fmt((offs, sizes))} lies outside the tensor's shape "
                                  f"{list(shape)}; the ranks disagree about the layout (check the rules)")
        total = sum(volume(b[1]) for b in boxes)
        # the sweep (it indexes every dimension of every size) tells whether any two overlap, cheaply; the
        # error names the first pair in the pieces' order, whichever pair the sweep met
        swept = all(len(z) == len(shape) for _, z in boxes)
        pair = _first_overlap(boxes) if not swept or overlapping_pieces(boxes) is not None else None
        if pair is not None:
            a, b = pair
            raise LayoutError(f"{name}: saved pieces {_fmt(a)} and {_fmt(b)} overlap; "
                              f"the ranks disagree about the layout")
        if total != volume(shape):
            raise LayoutError(f"{name}: the ranks' pieces cover {total} of its {volume(shape)} elements "
                              f"{list(shape)}; some rank did not save its part (check the rules and the layout)")


def overlapping_pieces(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (inside one tensor) that share an element, or None.

    A table whose pieces overlap while their volumes add up to the tensor's leaves elements no piece holds,
    which a load would return as uninitialised memory. A sweep along the dimension that tells the boxes apart
    best (the one with the most distinct offsets): boxes are sorted by their start there, and each is compared
    only with those still open at its start, which for the tilings the writers produce (slabs, column blocks,
    ZeRO's row ranges) is one or two.
    """
    live = [b for b in boxes if all(b[1])]   # an empty box holds no element
    if len(live) < 2:
        return None
    rank = len(live[0][0])
    if rank == 0:
        return live[0], live[1]   # both hold a scalar's one element
    d = max(range(rank), key=lambda k: len({b[0][k] for b in live}))
    live.sort(key=lambda b: b[0][d])
    end = 0
    for b in live:   # apart along that dimension, as a tiling mostly is: no two can share an element
        if b[0][d] < end:
            break
        end = b[0][d] + b[1][d]
    else:
        return None
    open_: list[Box] = []
    for b in live:
        start = b[0][d]
        open_ = [a for a in open_ if a[0][d] + a[1][d] > start]
        for a in open_:
            if intersect(a, b) is not None:
                return a, b
        open_.append(b)
    return None


def _first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """The first overlapping pair in the boxes' order: what the error names, whichever pair a sweep meets."""
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if intersect(boxes[i], boxes[j]) is not None:
                return boxes[i], boxes[j]
    return None


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(*box)) + "]"


__all__ = ["Box", "check_coverage", "flat_boxes", "intersect", "row_major_strides", "runs", "slices", "volume"]
