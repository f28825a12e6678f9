"""Loads onto a GPU through pinned buffers and a copy stream (loading/_device_load.py).

Without a GPU the pipeline runs with the CPU standing in for the device (``DEVICE_TYPES``), with buffers
of a few KiB, so every load below is cut into many batches that rotate through the buffers: the structure
is the same, only the copies are synchronous. The CUDA tests at the end skip without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from support.helpers import assert_bit_exact

from ckptrepo.loading import _device_load
from ckptrepo.loading._device_load import Pipeline, Transfer, batches, split_box
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.rules import Rules, Split

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Every CPU destination goes through the pipeline, in 8 KiB buffers (3 of them)."""
    monkeypatch.setattr(_device_load, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_device_load, "BUFFER_BYTES", 8 << 10)
    monkeypatch.setattr(_device_load, "BUFFERS", 3)
    made: list[Pipeline] = []
    real = Pipeline.run

    def run(self, transfers, read, *check):
        made.append(self)
        return real(self, transfers, read, *check)
    monkeypatch.setattr(Pipeline, "run", run)
    return made


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).bfloat16(),
                      "ids": torch.arange(5000), "scalar": torch.tensor(1.5), "empty": torch.empty(0, 4)},
            "opt": {"m": torch.randn(9000, generator=g).double()}, "np": np.arange(7.0), "step": 3}


def test_boxes_are_cut_into_whole_rows_or_cut_rows():
    assert split_box(((0, 0), (10, 4)), 100) == [((0, 0), (10, 4))]
    assert split_box(((2, 0), (10, 4)), 12) == [((2, 0), (3, 4)), ((5, 0), (3, 4)), ((8, 0), (3, 4)),
                                                 ((11, 0), (1, 4))]
    cut = split_box(((0, 5), (2, 10)), 4)        # a row of 10 is too long: each row cut in 4, 4, 2
    assert cut == [((0, 5), (1, 4)), ((0, 9), (1, 4)), ((0, 13), (1, 2)),
                   ((1, 5), (1, 4)), ((1, 9), (1, 4)), ((1, 13), (1, 2))]
    assert split_box(((), ()), 1) == [((), ())]


def test_batches_fill_a_buffer_each_aligned():
    ts = [Transfer(torch.float32, (n,), torch.empty(n), None) for n in (10, 10, 30, 1)]
    out = batches(ts, 128)
    assert [[at for _, at in b] for b in out] == [[0, 64], [0], [0]]
    with pytest.raises(ValueError, match="does not fit"):
        batches([Transfer(torch.float32, (40,), torch.empty(40), None)], 128)


def test_the_pipeline_rotates_a_bounded_set_of_buffers():
    dests = [torch.empty(100) for _ in range(9)]
    ts = [Transfer(torch.float32, (100,), d, k) for k, d in enumerate(dests)]
    copied = []
    pipe = Pipeline(torch.device("cpu"), buffer_bytes=512, buffers=3,
                    copy=lambda ds, hs: copied.append([(d.copy_(h), h.data_ptr())[1] for d, h in zip(ds, hs)]))

    def read(pairs):
        for t, h in pairs:
            h.fill_(t.what)
    pipe.run(ts, read)
    assert pipe.allocated == 3 and pipe.copied_batches == len(copied) == 9
    assert [d[0].item() for d in dests] == list(range(9))
    assert len({ptrs[0] for ptrs in copied}) == 3   # the same three buffers, over and over


def test_a_failed_read_stops_the_load_and_no_reader_outlives_it():
    pipe = Pipeline(torch.device("cpu"), buffer_bytes=512, buffers=3)
    ts = [Transfer(torch.float32, (100,), torch.empty(100), k) for k in range(6)]

    def read(pairs):
        if pairs[0][0].what == 2:
            raise OSError("disk gone")
    with pytest.raises(OSError, match="disk gone"):
        pipe.run(ts, read)


def test_plain_loads_and_loads_into_a_state_through_the_pipeline(repo, cpu_as_device):
    state = _state()
    repo.snapshot(state, step=1)
    out = repo.load("@1", device="cpu")
    assert cpu_as_device and cpu_as_device[-1].copied_batches > 10
    assert isinstance(out["np"], np.ndarray)
    assert_bit_exact(state, out)
    into = _state(seed=5)
    into["model"]["w"] = torch.empty(70, 300).t()   # strided: filled through a contiguous stand-in
    w = into["model"]["w"]
    repo.load("@1", into=into)
    assert into["model"]["w"] is w
    assert_bit_exact(state, into)


def test_layout_loads_through_the_pipeline(repo, cpu_as_device):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(64, 96, generator=g)
    rules = Rules([("w", Split(1))])
    repo.snapshot({"model": {"w": full}}, step=1, parallel_layout=ParallelLayout(rules=rules))
    for rank in range(2):
        lay = ParallelLayout(tp=2, rules=rules)
        into = {"model": {"w": torch.full((64, 48), float("nan"))}}
        repo.load("HEAD", parallel_layout=lay, rank=rank, into=into)
        assert torch.equal(into["model"]["w"], full[:, rank * 48:(rank + 1) * 48])
        fresh = repo.load("HEAD", parallel_layout=lay, rank=rank, device="cpu")
        assert torch.equal(fresh["model"]["w"], full[:, rank * 48:(rank + 1) * 48])
    assert len(cpu_as_device) >= 4 and all(p.copied_batches > 1 for p in cpu_as_device)


@cuda
def test_cuda_loads_round_trip_bit_exact_through_pinned_buffers(repo, monkeypatch):
    monkeypatch.setattr(_device_load, "BUFFER_BYTES", 1 << 20)   # several batches per tensor
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(1024, 700, generator=g), "h": torch.randn(333, 77, generator=g).half(),
             "i": torch.arange(10_000), "np": np.arange(4.0), "s": torch.tensor(2.0)}
    repo.snapshot(state, step=1)
    out = repo.load("@1", device="cuda")
    assert all(v.is_cuda for k, v in out.items() if k != "np") and isinstance(out["np"], np.ndarray)
    assert_bit_exact(state, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
    into = {"w": torch.empty(700, 1024, device="cuda").t(), "h": torch.empty(333, 77, device="cuda").half(),
            "i": torch.empty(10_000, dtype=torch.int64, device="cuda"), "np": np.zeros(4),
            "s": torch.empty((), device="cuda")}
    repo.load("@1", into=into)
    assert_bit_exact(state, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in into.items()})


@cuda
def test_cuda_layout_loads_fill_gpu_pieces_bit_exact(repo, monkeypatch):
    monkeypatch.setattr(_device_load, "BUFFER_BYTES", 64 << 10)
    full = torch.randn(256, 384, generator=torch.Generator().manual_seed(8))
    rules = Rules([("w", Split(1))])
    repo.snapshot({"model": {"w": full}}, step=1, parallel_layout=ParallelLayout(rules=rules))
    lay = ParallelLayout(tp=2, rules=rules)
    for rank in range(2):
        into = {"model": {"w": torch.full((256, 192), float("nan"), device="cuda")}}
        repo.load("HEAD", parallel_layout=lay, rank=rank, into=into)
        assert torch.equal(into["model"]["w"].cpu(), full[:, rank * 192:(rank + 1) * 192])
        fresh = repo.load("HEAD", parallel_layout=lay, rank=rank, device="cuda")
        assert fresh["model"]["w"].is_cuda
        assert torch.equal(fresh["model"]["w"].cpu(), full[:, rank * 192:(rank + 1) * 192])
