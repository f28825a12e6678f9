"""The collector pause around loads: restored afterwards, even on error, and nested uses restore it once."""
from __future__ import annotations

import gc

import pytest
import torch

import ckptrepo
from ckptrepo.gcpause import collection_paused


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
    import ckptrepo.reader as reader_mod   # Repository.load imports read_tensors from here at each call
    repo = ckptrepo.init(str(tmp_path / "r"))
    repo.snapshot({"w": torch.arange(10.0)}, step=1)
    during = []
    real = reader_mod.read_tensors

    def spy(*a, **k):
        during.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(reader_mod, "read_tensors", spy)
    out = repo.load("HEAD")
    assert torch.equal(out["w"], torch.arange(10.0))
    assert during == [False] and gc.isenabled()
    with pytest.raises(ckptrepo.errors.RevisionError):
        repo.load("no-such-rev")
    assert gc.isenabled()
