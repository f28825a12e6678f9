"""ckptrepo.dcp in one process (DCP's no_dist mode): what a load reads, byte items, and bad input.

The multi-rank cases (FSDP2 on 2 and 3 gloo ranks, async_save) are tests/distributed/test_dcp.py's."""
from __future__ import annotations

import io
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch
from support.helpers import assert_bit_exact, dcp_save

import ckptrepo
from ckptrepo.errors import NotARepositoryError, RefError, RevisionError, UnsupportedValueError
from ckptrepo.loading._engine import kvstore_bytes_read
from ckptrepo.storage._arrays import INNER_BYTES

dcp = pytest.importorskip("torch.distributed.checkpoint")
cdcp = pytest.importorskip("ckptrepo.dcp")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


_save = dcp_save


def _load(state, url, rev="HEAD"):
    r = cdcp.Reader(url, rev)
    dcp.load(state, storage_reader=r, no_dist=True)
    return r


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"big": torch.randn(512, 256, generator=g), "small": torch.randn(7, generator=g),
                      "half": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
            "meta": {"epoch": 4, "lr": 0.5, "name": "run", "sizes": (1, 2), "ids": [3, 4], "none": None}}


def test_dcp_save_is_one_version_that_repo_load_returns_in_the_saved_nesting(tmp_path) -> None:
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    state = _state()
    v = _save(state, url, step=10, message="first", metrics={"loss": 0.25})
    assert v is not None and v.step == 10 and v.message == "first" and v.metrics == {"loss": 0.25}
    assert repo.version("HEAD").id == v.id and len(repo.log()) == 1
    assert_bit_exact(state, repo.load("HEAD"))   # plain values recorded as plain data, in the same order
    v2 = _save(_state(1), url, step=11, tag="last", meta={"run": "abc"})
    assert repo.version("HEAD").id == v2.id and repo.version("HEAD").parents == (v.id,)
    assert repo.tags() == {"last": v2.id} and repo.version("last").meta == {"run": "abc"}
    v3 = _save(_state(2), url, step=12, tag="last", force_tag=True)   # a tag that moves, as last.ckpt does
    assert repo.tags() == {"last": v3.id}
    with pytest.raises(BaseException) as failed:   # DCP's CheckpointException, around ours: before any write
        _save(_state(3), url, step=13, tag="last")
    ours = failed.value.failures[0][0]
    assert isinstance(ours, RefError) and "tag 'last' already exists" in str(ours)
    assert [x.step for x in repo.log()] == [12, 11, 10]
    copy = pickle.loads(pickle.dumps(cdcp.Writer(url, step=14)))   # as DCP's process-based async_save sends it
    dcp.save(_state(4), storage_writer=copy, no_dist=True)
    assert copy.version is not None and repo.version("HEAD").step == 14


def test_a_snapshot_loads_through_dcp_and_a_dcp_save_back(tmp_path) -> None:
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    state = _state()
    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
                 "param_groups": [{"lr": 0.1, "params": [0]}]}
    extra = {"pair": (torch.arange(3), "x"), "arr": np.arange(4.0)}   # values DCP sees as byte items
    repo.snapshot({**state, "optim": opt_state, **extra}, step=1)
    into = {**_state(1), "optim": {"state": {0: {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4)}},
                                   "param_groups": [{"lr": 9.0, "params": [0]}]}, "pair": None, "arr": None}
    _load(into, url)
    assert_bit_exact({**state, "optim": opt_state, **extra}, into)


def test_a_partial_load_reads_only_the_bytes_it_needs(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    state = _state()
    _save(state, url, step=1)
    into = {"model": {"small": torch.zeros(7)}}
    before = kvstore_bytes_read()
    r = _load(into, url)
    read = kvstore_bytes_read() - before
    assert torch.equal(into["model"]["small"], state["model"]["small"])
    assert r.stats.needed_bytes == r.stats.requested_bytes == 7 * 4
    assert read <= INNER_BYTES + 8192   # the verified chunk holding it and a shard index: not the 512 KiB beside it


def test_values_that_are_not_plain_data_keep_dcps_pickle(tmp_path) -> None:
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    state = {"w": torch.arange(6.0), "frac": Fraction(1, 3), "blob": io.BytesIO(b"raw bytes")}
    _save(state, url, step=1)
    loaded = repo.load("HEAD")   # no pickle read by ckptrepo: DCP's bytes come back as uint8
    assert loaded["frac"].dtype == torch.uint8 and loaded["blob"].dtype == torch.uint8
    into = {"w": torch.zeros(6), "blob": io.BytesIO()}
    _load(into, url)   # a BytesIO payload passes torch's restricted unpickler: no trust needed
    assert torch.equal(into["w"], state["w"]) and into["blob"].getvalue() == b"raw bytes"
    into = {"w": torch.zeros(6), "frac": None, "blob": io.BytesIO()}
    dcp.load(into, storage_reader=cdcp.Reader(url, trust=True), no_dist=True)   # a class only full unpickling builds
    assert torch.equal(into["w"], state["w"]) and into["frac"] == Fraction(1, 3)
    assert into["blob"].getvalue() == b"raw bytes"


def test_bad_input_is_one_line_of_ours(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    with pytest.raises(NotARepositoryError, match="not a ckptrepo repository"):
        cdcp.Reader(str(tmp_path / "nothing"))
    _save(_state(), url, step=1)
    with pytest.raises(RevisionError):
        cdcp.Reader(url, "@999")
    with pytest.raises(RevisionError):
        cdcp.Reader(url, "nosuchbranch")
    with pytest.raises(UnsupportedValueError, match="metric 'loss'"):   # refused before DCP starts
        cdcp.Writer(url, metrics={"loss": torch.ones(3)})
    # dcp.load(checkpoint_id=...) resets the reader to another url: checked there too
    with pytest.raises(NotARepositoryError, match="not a ckptrepo repository"):
        cdcp.Reader(url).reset(str(tmp_path / "nothing"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_save_and_load_through_dcp(tmp_path) -> None:
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"model": {"w": torch.randn(1024, 256, device="cuda", generator=g),
                       "h": torch.randn(33, 7, device="cuda", generator=g).to(torch.bfloat16),
                       "t": torch.randn(64, 32, device="cuda", generator=g).t()}, "step": 7}
    cpu = {k: v.cpu() for k, v in state["model"].items()}
    _save(state, url, step=1)
    dcp.async_save(state, storage_writer=cdcp.Writer(url, step=2), no_dist=True).result()
    for rev in ("@1", "@2"):
        assert_bit_exact({"model": cpu, "step": 7}, repo.load(rev))
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    _load(into, url, "@1")
    assert all(t.is_cuda for t in into["model"].values())
    assert_bit_exact({"model": cpu, "step": 7}, {"model": {k: v.cpu() for k, v in into["model"].items()},
                                                  "step": into["step"]})


def test_keys_that_join_alike_are_kept_apart(tmp_path) -> None:
    url = str(tmp_path / "r")
    ckptrepo.init(url)
    state = {"a/b": torch.arange(3.0), "a": {"b": torch.arange(3.0) + 10}}
    v = _save(state, url, step=1)
    names = [t.name for t in ckptrepo.open(url).plumbing.manifest(v.id).tensors]
    assert sorted(names) == ["a/b", "a/b#2"]
    back = {"a/b": torch.zeros(3), "a": {"b": torch.zeros(3)}}
    _load(back, url)
    assert_bit_exact(back, state)


def test_a_tag_taken_during_the_save_leaves_the_version_committed_with_a_warning(tmp_path) -> None:
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    first = repo.snapshot({"x": torch.ones(2)}, step=0)
    w = cdcp.Writer(url, step=2, tag="best")
    plan_tagged = False
    orig = w.prepare_global_plan

    def prepare(plans):   # the rival takes the name after the check, while the data is written
        nonlocal plan_tagged
        out = orig(plans)
        repo.tag("best", first.id)
        plan_tagged = True
        return out
    w.prepare_global_plan = prepare
    with pytest.warns(UserWarning, match="was committed, but tag 'best' was not set"):
        dcp.save({"x": torch.zeros(2)}, storage_writer=w, no_dist=True)
    assert plan_tagged and w.version is not None and repo.resolve("best") == first.id
    assert [v.step for v in repo.log()] == [2, 0]   # committed once, not reported as a failed save


def test_save_without_collectives_is_refused(tmp_path) -> None:
    url = str(tmp_path / "r")
    ckptrepo.init(url)
    with pytest.raises(ckptrepo.ArgumentError, match="use_collectives=False"):
        cdcp.Writer(url).set_up_storage_writer(True, rank=0, use_collectives=False)
