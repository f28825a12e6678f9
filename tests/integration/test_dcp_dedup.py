"""ckptrepo.dcp versions dedup against their parent and record statistics, as ``repo.snapshot``'s do."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from support.helpers import assert_bit_exact, dcp_save

import ckptrepo
from ckptrepo.core.schema import STAT_COLUMNS

dcp = pytest.importorskip("torch.distributed.checkpoint")
cdcp = pytest.importorskip("ckptrepo.dcp")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


_save = dcp_save


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"big": torch.randn(512, 256, generator=g), "small": torch.randn(7, generator=g),
                      "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(10, dtype=torch.int64)},
            "epoch": 4}


def _zeros_like(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "epoch": 0}


def _data_bytes(url: str) -> int:
    top = os.path.join(url, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(top) for f in files)


def test_identical_saves_store_one_copy_and_each_loads_bit_exact(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()
    first = _save(state, url, step=0)
    one = _data_bytes(url)
    assert one >= 512 * 256 * 4
    versions = [first] + [_save(state, url, step=i) for i in range(1, 7)]
    assert _data_bytes(url) == one   # six more versions, not one more byte of tensor data
    repo = ckptrepo.open(url)
    for v in versions:
        got = _zeros_like(state)
        dcp.load(got, storage_reader=cdcp.Reader(url, v.id), no_dist=True)
        assert_bit_exact(state, got)
        assert_bit_exact(state, repo.load(v.id))
    last = repo.plumbing.manifest(versions[-1].id)
    assert all(p.array.startswith(f"data/{first.id}/") for t in last.tensors for p in t.pieces)


def test_a_changed_tensor_is_written_and_the_unchanged_ones_point_at_the_parent(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()
    first = _save(state, url, step=0)
    one = _data_bytes(url)
    state["model"]["small"].add_(1.0)
    second = _save(state, url, step=1)
    grown = _data_bytes(url) - one
    assert 0 < grown < 512 * 256 * 4   # the small tensor's shard, not the big one again
    m = ckptrepo.open(url).plumbing.manifest(second.id)
    where = {t.name: t.pieces[0].array for t in m.tensors}
    assert where["model/big"].startswith(f"data/{first.id}/")
    assert where["model/small"].startswith(f"data/{second.id}/")
    assert_bit_exact(state, ckptrepo.open(url).load(second.id))
    rows = m.tensor_stats.rows()
    assert rows["model/big"]["delta"] == 0.0 and math.isnan(rows["model/small"]["delta"])


def test_statistics_are_recorded_as_a_snapshot_records_them(tmp_path) -> None:
    state = _state()
    url = str(tmp_path / "dcp")
    ckptrepo.init(url)
    v = _save(state, url, step=0)
    snap = ckptrepo.init(str(tmp_path / "snap"))
    s = snap.snapshot(state, step=0)
    ours = ckptrepo.open(url).plumbing.manifest(v.id).tensor_stats
    theirs = snap.plumbing.manifest(s.id).tensor_stats
    assert ours is not None and theirs is not None
    ours_rows, their_rows = ours.rows(), theirs.rows()
    assert set(ours_rows) == set(their_rows) == {f"model/{k}" for k in state["model"]}
    for name, row in their_rows.items():
        for col in STAT_COLUMNS:
            a, b = ours_rows[name][col], row[col]
            # equal up to the float32 sums of differently cut chunks: far below the values' spread
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), (name, col)
    read: list[int] = []
    answered = ckptrepo.open(url).stats(v.id, on_bytes=read.append)   # from the manifest: no data read
    assert not read and {s.name for s in answered} == set(ours_rows)
    again = _save(state, url, step=1)   # reused pieces keep the statistics of the bytes they point at
    rows = ckptrepo.open(url).plumbing.manifest(again.id).tensor_stats.rows()
    assert rows["model/big"]["norm"] == ours_rows["model/big"]["norm"] and rows["model/big"]["delta"] == 0.0


def test_a_parent_whose_data_is_gone_is_not_pointed_at(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()
    first = _save(state, url, step=0)
    m = ckptrepo.open(url).plumbing.manifest(first.id)
    array = m.tensors[0].pieces[0].array
    shutil.rmtree(os.path.join(url, array))   # as a gc or an eviction would have
    second = _save(state, url, step=1)
    m2 = ckptrepo.open(url).plumbing.manifest(second.id)
    assert all(p.array.startswith(f"data/{second.id}/") for t in m2.tensors for p in t.pieces
               if t.dtype == m.tensors[0].dtype)
    assert_bit_exact(state, ckptrepo.open(url).load(second.id))


def test_failed_saves_give_their_staging_buffers_back(tmp_path) -> None:
    from ckptrepo import faults
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()

    def fail(_name: str) -> None:
        raise OSError("disk gone")
    faults.set_hook("before_shard_write", fail)
    try:
        for i in range(6):   # more failures than the ranks keep staging buffers
            state["model"]["big"].add_(1.0)
            with pytest.raises(BaseException) as failed:   # DCP's CheckpointException, around ours
                _save(state, url, step=i)
            assert "disk gone" in str(failed.value)
    finally:
        faults.set_hook("before_shard_write", None)
    v = _save(state, url, step=9)   # would wait for ever on a buffer no save gives back
    assert_bit_exact(state, ckptrepo.open(url).load(v.id))


def test_a_parent_array_deleted_during_the_save_fails_the_commit(tmp_path) -> None:
    """A gc or prune that deletes what the save reuses after it was seeded (before its manifest existed) must
    not leave a committed version pointing at nothing: the check between the manifest and the ref fails it."""
    from ckptrepo import faults
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()
    first = _save(state, url, step=0)
    reused = ckptrepo.open(url).plumbing.manifest(first.id).tensors[0].pieces[0].array

    def collect(_name: str) -> None:   # as a gc that listed the manifests before this one appeared
        shutil.rmtree(os.path.join(url, reused), ignore_errors=True)
    faults.set_hook("after_manifest", collect)
    try:
        with pytest.raises(BaseException) as failed:   # DCP's CheckpointException, around ours
            _save(state, url, step=1)
    finally:
        faults.set_hook("after_manifest", None)
    assert "was deleted (gc or prune)" in str(failed.value)
    repo = ckptrepo.open(url)
    assert repo.resolve("HEAD") == first.id   # the branch never moved onto the broken version
