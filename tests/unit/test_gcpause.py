"""The collector pause around loads: restored afterwards, even on error, and nested uses restore it once."""
from __future__ import annotations

import contextlib
import gc
import sys
from types import FrameType
from typing import Iterator

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


@contextlib.contextmanager
def collections_inside(*functions: str) -> Iterator[tuple[list[str], list[int]]]:
    """Collections set off every few allocations in the block: the names of ``functions`` running on any thread
    at each one, and how many ran in all."""
    inside: list[str] = []
    ran = [0]

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase != "start":
            return
        ran[0] += 1
        for frame in sys._current_frames().values():
            f: FrameType | None = frame
            while f is not None:
                if f.f_code.co_name in functions:
                    inside.append(f.f_code.co_name)
                f = f.f_back

    threshold = gc.get_threshold()
    gc.set_threshold(50, *threshold[1:])
    gc.callbacks.append(on_collection)
    try:
        yield inside, ran
    finally:
        gc.callbacks.remove(on_collection)
        gc.set_threshold(*threshold)


def test_a_sharded_commit_merges_the_ranks_parts_with_the_collector_paused(tmp_path) -> None:
    """Rank 0's merge builds the version's tables from every rank's parts in one bounded call: no collection
    runs while it does (here the single process is rank 0), and the collector is on again afterwards."""
    from support.dist_workers import SPLIT_RULES

    from ckptrepo.parallel.layout import ParallelLayout

    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"model": {f"layers.{i}.norm.weight": torch.ones(4) for i in range(300)}, "step": 3}
    with collections_inside("merge_rank_manifests", "check_replicas") as (inside, ran):
        v = repo.snapshot(state, step=1, parallel_layout=ParallelLayout(rules=SPLIT_RULES))
    assert ran[0] > 0 and inside == []
    assert gc.isenabled()
    assert torch.equal(repo.load(v.id)["model"]["layers.299.norm.weight"], torch.ones(4))


def test_rank_0_decodes_the_staged_parts_with_the_collector_paused() -> None:
    """``Staging.gather_ranks`` decodes every rank's part (a record per piece) with no collection running."""
    from torch.distributed import HashStore

    from ckptrepo.core.schema import Piece, RankPart
    from ckptrepo.parallel._distributed import Staging
    from ckptrepo.parallel._kv import GroupStore
    from ckptrepo.storage import ArrayInfo

    vid = "ab" * 16
    kv = GroupStore(HashStore(), "t/", 0, 2)
    staging = Staging(kv, vid, 2, timeout_s=30)
    for rank in range(2):
        info = ArrayInfo(f"data/{vid}/{rank}/float32", "float32", 300 * 8, 300 * 8, 300 * 8)
        names = [f"model/w{i}" for i in range(300)]
        staging.publish_rank(RankPart(
            rank, 1, ["T", 0], (), tuple((n, "float32", (16,)) for n in names), {"tp": rank, "pp": 0, "dp": 0},
            tuple((n, (Piece(((rank * 8,), (8,)), info.key, i * 8),)) for i, n in enumerate(names)),
            {info.key: info}, ()))
    with collections_inside("decode_rank_part") as (inside, ran):
        parts = staging.gather_ranks()
        gc.collect()   # one collection outside the decoding, so that the count shows the callback runs
    assert ran[0] > 0 and inside == []
    assert [p.rank for p in parts] == [0, 1] and len(parts[1].tensors) == 300
    assert parts[1].tensors[299][1][0].box == ((8,), (8,))
    assert gc.isenabled()
