"""Box arithmetic (``ckptrepo.core._boxes``) against brute force over small shapes.

Every sharded save and load goes through these three functions: ``intersect`` decides which saved pieces a
rank must read, ``runs`` turns the part of a piece it needs into byte ranges, and ``flat_boxes`` maps a ZeRO
flat partition back onto tensor boxes. An off-by-one in any of them reads the wrong bytes silently, so each
is compared element by element with a numpy enumeration of the same set.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptrepo.core._boxes import (
    Box,
    _fmt,
    check_coverage,
    flat_boxes,
    intersect,
    row_major_strides,
    runs,
    slices,
    volume,
)
from ckptrepo.errors import LayoutError

FAST = settings(max_examples=150, deadline=None)


def elements(shape: tuple[int, ...], box: Box) -> set[int]:
    """The flat row-major indices (in a tensor of ``shape``) of the elements inside ``box``: the brute force."""
    index = np.arange(volume(shape), dtype=np.int64).reshape(shape)
    return set(index[slices(*box)].reshape(-1).tolist())


@st.composite
def shape_and_box(draw: st.DrawFn, min_dim: int = 0, max_ndim: int = 4) -> tuple[tuple[int, ...], Box]:
    """A shape with up to ``max_ndim`` dimensions of 0..5 (or ``min_dim``..5) and a box inside it."""
    shape = tuple(draw(st.lists(st.integers(min_dim, 5), min_size=0, max_size=max_ndim)))
    offs, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offs.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return shape, (tuple(offs), tuple(sizes))


@st.composite
def two_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    shape, a = draw(shape_and_box())
    offs, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offs.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return shape, a, (tuple(offs), tuple(sizes))


@st.composite
def piece_and_part(draw: st.DrawFn) -> tuple[Box, Box]:
    """A piece (a box at some global offset) and a part: a box inside that piece, in global coordinates."""
    psz = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    poff = tuple(draw(st.integers(0, 7)) for _ in psz)
    qoff, qsz = [], []
    for o, s in zip(poff, psz):
        lo = draw(st.integers(0, s - 1))
        qoff.append(o + lo)
        qsz.append(draw(st.integers(1, s - lo)))
    return (poff, psz), (tuple(qoff), tuple(qsz))


# ---- volume and strides ------------------------------------------------------

def test_volume_and_strides_of_small_shapes() -> None:
    """The element count and row-major strides every other function builds on (a zero-dim tensor has 1 element)."""
    assert volume(()) == 1 and volume((3, 0, 2)) == 0 and volume((2, 3, 4)) == 24
    assert row_major_strides(()) == ()
    assert row_major_strides((5,)) == (1,)
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides((4, 1, 3)) == (3, 3, 1)


# ---- intersect ----------------------------------------------------------------

@FAST
@given(two_boxes())
def test_intersect_is_the_set_intersection(case: tuple[tuple[int, ...], Box, Box]) -> None:
    """``intersect`` returns exactly the common elements as a box, and None exactly when there are none."""
    shape, a, b = case
    common = elements(shape, a) & elements(shape, b)
    got = intersect(a, b)
    if not shape:   # zero-dim boxes always meet: the one element
        assert got == ((), ())
        return
    if not common:
        assert got is None
    else:
        assert got is not None and elements(shape, got) == common
        assert intersect(b, a) == got   # symmetric


def test_intersect_edge_cases() -> None:
    """Touching boxes do not intersect (half-open ranges); an empty box meets nothing; containment is the inner box."""
    assert intersect(((0, 0), (2, 3)), ((2, 0), (2, 3))) is None          # touching along dim 0
    assert intersect(((0,), (0,)), ((0,), (4,))) is None                   # empty box
    assert intersect(((1, 1), (2, 2)), ((0, 0), (4, 4))) == ((1, 1), (2, 2))
    assert intersect(((0, 2), (3, 3)), ((1, 0), (5, 3))) == ((1, 2), (2, 1))
    assert intersect(((), ()), ((), ())) == ((), ())


# ---- runs ---------------------------------------------------------------------

def run_elements(starts: np.ndarray, length: int) -> list[int]:
    return [int(s) + i for s in starts for i in range(length)]


@FAST
@given(piece_and_part())
def test_runs_enumerate_the_part_in_storage_order(case: tuple[Box, Box]) -> None:
    """The runs, read in order, are exactly the part's elements in the piece's row-major storage, ascending,
    and they are maximal: two runs never touch (else a contiguous slab would cost several reads)."""
    piece, part = case
    poff, psz = piece
    starts, length = runs(piece, part)
    local = (tuple(q - p for q, p in zip(part[0], poff)), part[1])
    expected = sorted(elements(psz, local))
    assert run_elements(starts, length) == expected
    assert len(starts) * length == volume(part[1])
    assert all(int(a) + length < int(b) for a, b in zip(starts[:-1], starts[1:]))


def test_runs_of_a_contiguous_slab_is_one_run() -> None:
    """Whole trailing dimensions merge: rows 1..3 of a (4, 3, 2) piece are one run of 12 elements."""
    starts, length = runs(((0, 0, 0), (4, 3, 2)), ((1, 0, 0), (2, 3, 2)))
    assert starts.tolist() == [6] and length == 12
    starts, length = runs(((10, 0), (4, 3)), ((10, 0), (4, 3)))          # the whole piece, at an offset
    assert starts.tolist() == [0] and length == 12
    starts, length = runs(((0, 0), (4, 3)), ((1, 1), (2, 2)))            # a column block: one run per row
    assert starts.tolist() == [4, 7] and length == 2
    starts, length = runs(((), ()), ((), ()))                            # zero-dim: its one element
    assert starts.tolist() == [0] and length == 1


def test_runs_of_a_size_one_inner_dimension() -> None:
    """A dimension of size 1 counts as spanned fully, so it does not split a slab into runs."""
    starts, length = runs(((0, 0, 0), (3, 1, 4)), ((1, 0, 0), (2, 1, 4)))
    assert starts.tolist() == [4] and length == 8


# ---- flat_boxes ---------------------------------------------------------------

@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    n = volume(shape)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return shape, lo, hi


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_flat_boxes_cover_the_range_in_order(case: tuple[tuple[int, ...], int, int]) -> None:
    """Elements ``[lo, hi)`` come back as non-empty boxes in flat order, each contiguous in row-major order and
    starting at its stated flat index, together covering the range exactly once, with at most ``2*ndim-1``
    boxes (a partial first row, a block and a partial last row per dimension)."""
    shape, lo, hi = case
    out = flat_boxes(shape, lo, hi)
    if hi == lo:
        assert out == []
        return
    if not shape:
        assert out == [(0, ((), ()))]
        return
    pos = lo
    for start, box in out:
        assert len(box[0]) == len(shape) == len(box[1])
        assert all(o >= 0 and s >= 1 and o + s <= d for o, s, d in zip(box[0], box[1], shape))
        els = sorted(elements(shape, box))
        assert start == pos and els == list(range(start, start + volume(box[1])))
        pos += volume(box[1])
    assert pos == hi
    assert len(out) <= 2 * len(shape) - 1


def test_flat_boxes_exact_values() -> None:
    """Concrete splits: the whole tensor is one box; a range across rows is a partial row, a block, a partial row."""
    assert flat_boxes((3, 4, 5), 0, 60) == [(0, ((0, 0, 0), (3, 4, 5)))]
    assert flat_boxes((4, 3), 2, 11) == [(2, ((0, 2), (1, 1))), (3, ((1, 0), (2, 3))), (9, ((3, 0), (1, 2)))]
    assert flat_boxes((4, 3), 3, 6) == [(3, ((1, 0), (1, 3)))]
    assert flat_boxes((7,), 2, 5) == [(2, ((2,), (3,)))]
    assert flat_boxes((2, 2, 2), 1, 7) == [(1, ((0, 0, 1), (1, 1, 1))), (2, ((0, 1, 0), (1, 1, 2))),
                                            (4, ((1, 0, 0), (1, 1, 2))), (6, ((1, 1, 0), (1, 1, 1)))]
    assert flat_boxes((3, 4), 5, 5) == [] and flat_boxes((3, 4), 6, 2) == []
    assert flat_boxes((), 0, 1) == [(0, ((), ()))]


# ---- check_coverage -----------------------------------------------------------

def test_check_coverage_accepts_an_exact_tiling() -> None:
    """Pieces that tile a tensor exactly once pass, whatever their order; a zero-dim tensor takes one empty box."""
    check_coverage({"w": ((4, 6), [((2, 0), (2, 6)), ((0, 3), (2, 3)), ((0, 0), (2, 3))]),
                    "s": ((), [((), ())])})


@pytest.mark.parametrize("boxes, fragment", [
    ([((0, 0), (2, 6)), ((1, 0), (3, 6))], "overlap"),
    ([((0, 0), (2, 6))], "cover 12 of its 24 elements"),
    ([((0, 0), (4, 6)), ((4, 0), (1, 6))], "lies outside the tensor's shape"),
    ([((0, 0), (4, 6)), ((0,), (1,))], "lies outside the tensor's shape"),
    ([((-1, 0), (1, 6)), ((0, 0), (4, 6))], "lies outside the tensor's shape"),
])
def test_check_coverage_names_overlaps_gaps_and_strays(boxes: list[Box], fragment: str) -> None:
    """Overlapping, missing and out-of-shape pieces are each a LayoutError naming the tensor and the problem."""
    with pytest.raises(LayoutError, match="^w: .*" + fragment):
        check_coverage({"w": ((4, 6), boxes)})


def test_check_coverage_a_stray_piece_cannot_make_up_for_a_missing_one() -> None:
    """The element count alone would match here (12 + 12 = 24): the stray piece must still be refused."""
    with pytest.raises(LayoutError, match="outside"):
        check_coverage({"w": ((4, 6), [((0, 0), (2, 6)), ((4, 0), (2, 6))])})


def all_pairs_coverage(tensors: dict[str, tuple[tuple[int, ...], list[Box]]]) -> None:
    """The plain check ``check_coverage`` must agree with: every pair of pieces compared, in their order."""
    for name, (shape, boxes) in tensors.items():
        for offs, sizes in boxes:
            if len(offs) != len(shape) or any(o < 0 or z < 0 or o + z > d for o, z, d in zip(offs, sizes, shape)):
                raise LayoutError(f"{name}: a saved piece {_fmt((offs, sizes))} lies outside the tensor's shape "
                                  f"{list(shape)}; the ranks disagree about the layout (check the rules)")
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                if intersect(boxes[i], boxes[j]) is not None:
                    raise LayoutError(f"{name}: saved pieces {_fmt(boxes[i])} and {_fmt(boxes[j])} overlap; "
                                      f"the ranks disagree about the layout")
        total = sum(volume(b[1]) for b in boxes)
        if total != volume(shape):
            raise LayoutError(f"{name}: the ranks' pieces cover {total} of its {volume(shape)} elements "
                              f"{list(shape)}; some rank did not save its part (check the rules and the layout)")


@st.composite
def piece_sets(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A shape and pieces of it: a tiling cut at random places (irregular, like a flat partition's boxes), then
    pieces dropped, duplicated, grown, or drawn at random (in or beyond the shape), in a random order."""
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    boxes: list[Box] = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 12))):
        i = draw(st.integers(0, len(boxes) - 1))
        offs, sizes = boxes[i]
        cuttable = [d for d, s in enumerate(sizes) if s > 1]
        if not cuttable:
            continue
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, sizes[d] - 1))
        boxes[i:i + 1] = [(offs, sizes[:d] + (at,) + sizes[d + 1:]),
                          (offs[:d] + (offs[d] + at,) + offs[d + 1:], sizes[:d] + (sizes[d] - at,) + sizes[d + 1:])]
    for _ in range(draw(st.integers(0, 3))):
        change = draw(st.sampled_from(["drop", "duplicate", "grow", "random"]))
        if change == "random" or not boxes:
            offs = tuple(draw(st.integers(0, d + 1)) for d in shape)
            boxes.append((offs, tuple(draw(st.integers(0, d + 1 - o)) for o, d in zip(offs, shape))))
            continue
        i = draw(st.integers(0, len(boxes) - 1))
        if change == "drop":
            del boxes[i]
        elif change == "duplicate":
            boxes.append(boxes[i])
        elif shape:
            d = draw(st.integers(0, len(shape) - 1))
            offs, sizes = boxes[i]
            boxes[i] = (offs, sizes[:d] + (sizes[d] + 1,) + sizes[d + 1:])
    return shape, draw(st.permutations(boxes))


@FAST
@given(piece_sets())
def test_check_coverage_agrees_with_comparing_every_pair(case: tuple[tuple[int, ...], list[Box]]) -> None:
    """The sweep finds exactly the problems the all-pairs check finds, and names the same pieces."""
    shape, boxes = case

    def verdict(check: Callable[[dict[str, tuple[tuple[int, ...], list[Box]]]], None]) -> str | None:
        try:
            check({"w": (shape, list(boxes))})
        except LayoutError as err:
            return str(err)
        return None

    assert verdict(check_coverage) == verdict(all_pairs_coverage)


def test_check_coverage_compares_a_piece_only_with_its_neighbours() -> None:
    """A tensor cut into 64 x 16 pieces: each piece meets the pieces of its own band of rows, not all 1,023
    others, so a merge of many ranks' pieces stays cheap. The work is counted in calls of ``intersect``."""
    boxes: list[Box] = [((r * 16, c * 16), (16, 16)) for c in range(16) for r in range(64)]
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is intersect.__code__:
            calls += 1

    sys.setprofile(count)
    try:
        check_coverage({"w": ((1024, 256), boxes)})
    finally:
        sys.setprofile(None)
    assert 0 < calls <= 16 * len(boxes) < len(boxes) * (len(boxes) - 1) // 2
