"""The collector pause around loads: restored afterwards, even on error, and nested uses restore it once."""
from __future__ import annotations

import gc

import pytest
import torch

import ckptrepo
from ckptrepo.core._gcpause import collection_paused


def test_nested_pause_restores_once() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()   # the inner exit does not re-enable it under the outer pause
    assert gc.isenabled()


def test_pause_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_load_pauses_collection_and_restores_it_even_on_error(tmp_path, monkeypatch) -> None:
    import ckptrepo.loading._device_load as reader_mod  # Repository.load imports read_tensors_to from here at each call
    repo = ckptrepo.init(str(tmp_path / "r"))
    repo.snapshot({"w": torch.arange(10.0)}, step=1)
    during = []
    real = reader_mod.read_tensors_to

    def spy(*a, **k):
        during.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(reader_mod, "read_tensors_to", spy)
    out = repo.load("HEAD")
    assert torch.equal(out["w"], torch.arange(10.0))
    assert during == [False] and gc.isenabled()
    with pytest.raises(ckptrepo.errors.RevisionError):
        repo.load("no-such-rev")
    assert gc.isenabled()


def test_loads_leave_no_reference_cycles(tmp_path) -> None:
    """Whatever a load allocates is freed by reference counting when it returns: nothing for the cyclic collector,
    whose full collections walk every object of a process with torch and a model loaded. (unflatten's recursive
    nested function was a cycle per call: ~1000 objects per resharding load of the benchmark state.)"""
    from support.dist_workers import SPLIT_RULES, split_state

    from ckptrepo.parallel.layout import ParallelLayout

    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"model": split_state(1), "optim": {"step": 3, "lr": [0.1, 0.2], "nested": {"a": (1, 2)}}}
    repo.snapshot(state, step=1, parallel_layout=ParallelLayout(rules=SPLIT_RULES))
    into = {"model": {"col.weight": torch.empty(4096, 256), "row.weight": torch.empty(256, 4096),
                      "norm.weight": torch.empty(256)}, "optim": {"step": 0, "lr": [0.0, 0.0], "nested": {"a": (0, 0)}}}
    loads = [lambda: repo.load("HEAD"),
             lambda: repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=SPLIT_RULES), rank=1, into=into)]
    for load in loads:
        load()   # first use: module-level caches, the reader threads
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for load in loads:
            load()
        gc.collect()
        garbage = [type(o).__name__ + ":" + getattr(o, "__qualname__", "") for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert garbage == [], garbage[:10]
    assert into["optim"]["step"] == 3 and torch.equal(into["model"]["row.weight"],
                                                      split_state(1)["row.weight"][:, 4096:])
