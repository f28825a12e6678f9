"""A distributed snapshotter's start and its per-snapshot meeting (saving/_startup.py, saving/_prepare.py).

A misconfigured job fails on every rank at the start, with one line, before anything is written; a rank that
stops snapshotting is named at the deadline; and a snapshot whose pieces are what they were exchanges none.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from support.helpers import assert_bit_exact
from support.megatron_ref import launch

import ckptrepo
from ckptrepo.parallel.layout import ParallelLayout

TWO = ParallelLayout(dp=2)


def _start_error(rank: int, layout: ParallelLayout, url: str, layouts: list[Any], own_repo: bool) -> dict[str, Any]:
    """Make a snapshotter with this rank's layout (and repository); report the error and how long it took."""
    path = f"{url}-{rank}" if own_repo else url
    if own_repo or rank == 0:
        ckptrepo.init(path, exist_ok=True)
    import torch.distributed as dist
    dist.barrier()
    t0 = time.monotonic()
    try:
        ckptrepo.open(path).snapshotter(parallel_layout=layouts[rank], commit_timeout_s=30).close()
        error = ""
    except ckptrepo.CkptRepoError as err:
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "elapsed": time.monotonic() - t0}


def test_ranks_on_different_repositories_fail_at_the_start_on_every_rank(tmp_path) -> None:
    out = launch(TWO, _start_error, str(tmp_path / "repo"), [TWO, TWO], True)
    for r in out:
        assert "snapshot into different repositories" in r["error"], r
        assert "\n" not in r["error"] and r["elapsed"] < 10, r
    assert not (tmp_path / "repo-0" / "versions").exists() or not any((tmp_path / "repo-0" / "versions").iterdir())


def test_ranks_with_different_layouts_fail_at_the_start_on_every_rank(tmp_path) -> None:
    out = launch(TWO, _start_error, str(tmp_path / "repo"), [TWO, ParallelLayout(tp=2)], False)
    for r in out:
        assert "the ranks' parallel layouts differ: rank 0 has 'dp=2'" in r["error"] or \
            "parallel layouts differ" in r["error"], r


def test_a_layout_that_does_not_fit_the_world_fails_on_every_rank(tmp_path) -> None:
    out = launch(TWO, _start_error, str(tmp_path / "repo"), [ParallelLayout(dp=4), TWO], False)
    assert out[0]["error"].startswith("LayoutError:") and "torch.distributed has 2" in out[0]["error"], out
    assert "rank 0 could not start its snapshotter (LayoutError:" in out[1]["error"], out


def _state(step: int, extra: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    if extra:
        state["c"] = torch.randn(4, generator=g)
    return state


def _snapshots(rank: int, layout: ParallelLayout, url: str, stop_after: int | None) -> dict[str, Any]:
    if rank == 0:
        ckptrepo.init(url)
    import torch.distributed as dist
    dist.barrier()
    snap = ckptrepo.open(url).snapshotter(parallel_layout=layout, commit_timeout_s=3)
    exchanges = []
    for step in range(4):
        snap.snapshot(_state(step), step=step)
        exchanges.append(snap._sharding.full_exchanges)
    snap.snapshot(_state(4, extra=True), step=4)   # a new tensor: the pieces are exchanged again
    exchanges.append(snap._sharding.full_exchanges)
    snap.wait()
    out: dict[str, Any] = {"exchanges": exchanges}
    if stop_after is not None:
        if rank == 0:   # one snapshot more than rank 1 takes
            t0 = time.monotonic()
            try:
                snap.snapshot(_state(5), step=5)
                out["late"] = "taken"
            except ckptrepo.CkptRepoError as err:
                out["late"] = str(err)
            out["elapsed"] = time.monotonic() - t0
        else:
            time.sleep(6)   # alive, but not snapshotting
        try:
            snap.close()
        except ckptrepo.CkptRepoError:
            pass
    else:
        snap.close()
    return out


def test_unchanged_snapshots_exchange_no_pieces_and_commit_bit_exact(tmp_path) -> None:
    url = str(tmp_path / "repo")
    out = launch(TWO, _snapshots, url, None)
    for r in out:   # the first snapshot exchanges the pieces; the next three only meet; the new tensor again
        assert r["exchanges"] == [1, 1, 1, 1, 2], r
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [4, 3, 2, 1, 0]
    for v in repo.log():
        assert_bit_exact(repo.load(v.id), _state(v.step, extra=v.step == 4))


def test_a_rank_that_stops_snapshotting_is_named_at_the_deadline(tmp_path) -> None:
    out = launch(TWO, _snapshots, str(tmp_path / "repo"), 1)
    late = out[0]["late"]
    assert "rank 1 did not reach snapshot number 6 of this snapshotter within 3 s" in late, late
    assert "\n" not in late and out[0]["elapsed"] < 6, out[0]
