"""The CUDA capture's few-call copies (saving/_device_copies.py), exercised on CPU tensors standing in for the
device ones: one ``_foreach_copy_`` per segment must stage exactly the bytes ``fill_segment`` stages, its
views must be built once per plan, and its batched statistics must equal the per-part ones."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckptrepo.saving._device_copies import DeviceCopies, plan_blocks, segment_stats
from ckptrepo.saving._tensor_stats import DeviceStats
from ckptrepo.saving._writer import fill_segment, make_plan
from ckptrepo.state._providers import DTYPE_NAMES, TensorRecord


def _records(tensors: dict[str, torch.Tensor]) -> list[TensorRecord]:
    return [TensorRecord(n, t, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 170, generator=g)
    return {"big": big, "row": big[7], "strided": big[:100, :50].t(), "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "bf16": torch.randn(4097, generator=g).bfloat16(),
            "ids": torch.randint(-2**62, 2**62, (5000,), generator=g), "mask": torch.rand(999, generator=g) > 0.5,
            "small": torch.randn(33, generator=g), "half": torch.randn(70, 90, generator=g).half()}


def _fill_both(state: dict[str, torch.Tensor], copies: DeviceCopies, feeds_a=None, feeds_b=None, plan=None):
    """Fill every segment both ways (``plan``: the one a PlanCache would hand back for this structure)."""
    records = _records(state)
    plan = plan or make_plan(records, 64 << 10)
    assert len(plan.segments) > len(plan.streams)   # tensors cut over several segments
    tensors = [r.tensor for r in records]

    def source(i: int) -> torch.Tensor:
        return tensors[i]

    copies.prepare(plan, tensors)
    for k, seg in enumerate(plan.segments):
        nbytes = (seg.stop - seg.start) * records[seg.parts[0][0]].tensor.element_size()
        a = torch.full((nbytes + 64,), 0xAB, dtype=torch.uint8)
        b = torch.full((nbytes + 64,), 0xCD, dtype=torch.uint8)
        va = fill_segment(seg, source, a, hashers=feeds_a)
        vb = copies.fill(k, seg, b, source, feeds_b)
        assert va.dtype == vb.dtype and va.shape == vb.shape
        assert va.tobytes() == vb.tobytes(), f"segment {k} ({seg.dtype}) differs"
        assert b[nbytes:].eq(0xCD).all(), "wrote past the segment"
    return plan


def test_one_foreach_copy_per_segment_stages_exactly_what_fill_segment_stages():
    _fill_both(_state(), DeviceCopies("cpu"))


def test_the_views_are_built_once_per_plan_and_again_when_a_tensor_moves():
    state = _state()
    copies = DeviceCopies("cpu")
    plan = _fill_both(state, copies)
    for _ in range(3):
        copies.prepare(plan, [r.tensor for r in _records(state)])
    assert copies.builds == 1
    state["big"].mul_(2)                         # changed in place, where it is: the same views see it
    _fill_both(state, copies, plan=plan)
    assert copies.builds == 1
    before = copies.rebuilt
    state["small"] = torch.randn(33)             # a new tensor elsewhere: its views built again, and right
    _fill_both(state, copies, plan=plan)
    assert copies.builds == 1 and copies.rebuilt == before + 1
    _fill_both(state, copies)                    # another plan: everything built again
    assert copies.builds == 2
    copies.release()
    assert copies._flat == {} and copies._sources == {}


def test_batched_statistics_equal_the_per_part_ones_and_keep_the_nan_counts():
    state = {k: v for k, v in _state(1).items() if v.dtype.is_floating_point}
    state["nan"] = torch.tensor([1.0, float("nan"), float("inf"), -2.0] * 3000)
    records = _records(state)
    per_part = {i: DeviceStats(r.dtype) for i, r in enumerate(records)}
    batched = {i: DeviceStats(r.dtype) for i, r in enumerate(records)}

    class PerPart:   # no add_row: fed its slices, as fill_segment feeds device statistics
        def __init__(self, stats: DeviceStats) -> None:
            self.stats = stats

        def update_device(self, x: torch.Tensor) -> None:
            self.stats.update_device(x)

    copies = DeviceCopies("cpu")
    _fill_both(state, copies, feeds_b=batched)
    _fill_both(state, DeviceCopies("cpu"), feeds_b={i: PerPart(s) for i, s in per_part.items()})
    for i, r in enumerate(records):
        got, want = batched[i].moments().row(r.numel), per_part[i].moments().row(r.numel)
        if r.name == "nan":
            assert got[6:] == want[6:] == (3000.0, 3000.0)
            assert all(math.isnan(v) for v in got[:6])
            continue
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9, nan_ok=True), r.name
    assert len(copies._blocks) > 0


def test_blocks_cut_parts_at_their_edges_into_rows():
    blocks = plan_blocks([5, 12, 3], block=8)
    assert [(b.lo, b.hi) for b in blocks] == [(0, 8), (8, 16), (16, 20)]
    assert [b.owners for b in blocks] == [[(0, 5), (1, 3)], [(1, 8)], [(1, 1), (2, 3)]]
    assert [b.lengths.tolist() for b in blocks] == [[5, 3], [8], [1, 3]]
    x = torch.arange(20, dtype=torch.float32)
    parts = [x[:5], x[5:17], x[17:]]
    rows = [r.host() for r in segment_stats(parts, blocks)]
    assert rows[0][0][:4] == [2.0, pytest.approx(math.sqrt(10.0)), 0.0, 4.0]
    assert rows[2][1][2:] == [17.0, 19.0, 0.0, 0.0]
    assert np.allclose([r[0] for r in rows[1]], [11.5])
