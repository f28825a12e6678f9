"""DTensor state dicts (tensor parallelism with parallelize_module) saved and loaded across mesh sizes.

Two gloo processes on a CPU mesh snapshot a tensor-parallel MLP and its Adam
state (every rank calls ``repo.snapshot``); four processes on a 4-rank mesh
then load that version into their own DTensor state with ``into=``, each
reading only its boxes; a single process without a process group loads it as
full plain tensors; two processes load it back into the same mesh, where each
rank must get its own per-rank tensors (an RNG-like ``rng``) back. Everything
is compared bit-exact against the full tensors the saving ranks gathered with
``full_tensor()``.
"""
from __future__ import annotations

import json

import pytest
import torch
from support.dtensor_workers import load_worker, run_ranks, save_worker, tensors
from support.helpers import assert_bit_exact

import ckptrepo

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SAVE_WORLD, LOAD_WORLD = 2, 4


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A repository holding one version saved from the 2-rank mesh, and the reference full tensors."""
    base = tmp_path_factory.mktemp("dtensor")
    url = str(base / "repo")
    ckptrepo.init(url)
    out = base / "save"
    out.mkdir()
    run_ranks(save_worker, SAVE_WORLD, url, str(out))
    ranks = [_json(str(out / f"rank-save-{r}.json")) for r in range(SAVE_WORLD)]
    ref = torch.load(str(out / "full-save.pt"), weights_only=True)
    return {"url": url, "base": base, "ranks": ranks, "ref": ref}


def _load(saved: dict, world: int) -> dict:
    """Load that version on a ``world``-rank mesh: per-rank reports and the full tensors rank 0 gathered after."""
    out = saved["base"] / f"load{world}"
    out.mkdir()
    run_ranks(load_worker, world, saved["url"], str(out))
    return {"ranks": [_json(str(out / f"rank-load-{r}.json")) for r in range(world)],
            "full": torch.load(str(out / "full-load.pt"), weights_only=True)}


@pytest.fixture(scope="module")
def loaded4(saved):
    return _load(saved, LOAD_WORLD)


def _per_rank_warnings(rep: dict) -> list[str]:
    return [w for w in rep["warnings"] if "per-rank state" in w]


def test_save_commits_one_version_with_global_tensors(saved):
    repo = ckptrepo.open(saved["url"])
    vids = {r["vid"] for r in saved["ranks"]}
    assert vids == {repo.resolve("HEAD")}, "every rank returns the committed version"
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    assert m.layout.world_size == SAVE_WORLD and m.step == 1
    shapes = {t.name: t.shape for t in m.tensors}
    ref = saved["ref"]
    # DTensors are stored as global tensors under their plain path; per-rank tensors under <path>@rank<r>
    assert shapes["model/up.weight"] == (64, 16) and shapes["model/down.weight"] == (16, 64)
    assert shapes["optim/state/down.weight/exp_avg"] == tuple(ref["optim/state/down.weight/exp_avg"].shape)
    assert shapes["extra/emb"] == (10, 8)
    assert {"rng@rank0", "rng@rank1", "optim/state/up.weight/step@rank0"} <= set(shapes)


def _check_full(saved: dict, loaded: dict) -> None:
    ref, got = saved["ref"], loaded["full"]
    assert set(got) == set(ref)
    for p in ref:
        if p != "rng":   # per-rank: checked per rank below
            assert_bit_exact(got[p], ref[p], p)   # Adam's step counters are per-rank too, but all equal here


def test_load_into_4_rank_mesh_bit_exact(saved, loaded4):
    """(a) 2-rank save -> 4-rank DTensor state: the gathered full tensors equal the saved ones bit-exact."""
    _check_full(saved, loaded4)
    for r, rep in enumerate(loaded4["ranks"]):
        assert rep["step"] == 1, "plain values come back too"
        assert rep["placements"]["model/up.weight"] == "(Shard(dim=0),)"
        assert rep["placements"]["model/down.weight"] == "(Shard(dim=1),)"
        assert rep["placements"]["optim/state/down.weight/exp_avg"] == "(Shard(dim=1),)"
        # the world size changed: per-rank tensors come from saved rank r % 2, with a warning naming them
        assert rep["rng"] == 100 + r % SAVE_WORLD
        warned = _per_rank_warnings(rep)
        assert len(warned) == 1 and f"of rank {r} comes from saved rank {r % SAVE_WORLD}" in warned[0], warned


def test_load_into_same_mesh_keeps_per_rank_state(saved):
    """2 -> 2 ranks: bit-exact, and every rank gets its own per-rank tensors back, without a warning."""
    loaded2 = _load(saved, SAVE_WORLD)
    _check_full(saved, loaded2)
    for r, rep in enumerate(loaded2["ranks"]):
        assert rep["rng"] == 100 + r
        assert rep["needed_bytes"] == rep["local_bytes"]
        assert not _per_rank_warnings(rep), rep["warnings"]


def test_load_in_single_process_full_tensors(saved):
    """(b) without a process group, load("HEAD") returns plain full tensors equal to the reference."""
    out = ckptrepo.open(saved["url"]).load("HEAD")
    ref = saved["ref"]
    got = dict(tensors(out))
    assert "rng" in got and got["rng"].tolist() == [100]   # per-rank state of saved rank 0
    assert set(got) == set(ref)
    for p, t in got.items():
        assert type(t) is torch.Tensor, f"{p}: {type(t)}"
        assert_bit_exact(t, ref[p], p)
    assert out["step"] == 1
    assert out["optim"]["param_groups"][0]["params"] == ["up.weight", "up.bias", "down.weight", "down.bias",
                                                         "norm.weight", "norm.bias"]
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_bytes_read_and_written(saved, loaded4):
    """(c) each rank of the 4-rank load needed exactly its local shards; the save wrote every byte once."""
    for r, rep in enumerate(loaded4["ranks"]):
        assert rep["needed_bytes"] == rep["local_bytes"], f"rank {r}: {rep}"
        assert rep["needed_bytes"] <= rep["requested_bytes"]
    repo = ckptrepo.open(saved["url"])
    size = repo.plumbing.manifest(repo.resolve("HEAD")).size
    r0 = saved["ranks"][0]
    assert all(r["global_dtensor_bytes"] == r0["global_dtensor_bytes"] for r in saved["ranks"])
    # global tensors once; plain (per-rank) tensors once per rank that holds them
    assert size == r0["global_dtensor_bytes"] + sum(r["plain_bytes"] for r in saved["ranks"])
    # replicas (down.bias, the LayerNorm, their Adam moments) were not written twice
    assert size < sum(r["local_bytes"] for r in saved["ranks"])


def test_a_replicated_dtensor_whose_copies_drifted_is_refused_not_half_lost(tmp_path):
    """A Replicate() DTensor was saved from one rank: when the ranks' copies differ (a sequence-parallel norm
    whose gradients nobody all-reduced), the others were lost without a word. The copies' fingerprints now
    disagree at the commit: no version appears, and every rank is told which tensor and what to do."""
    from support.dtensor_workers import drifted_replica_worker
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    run_ranks(drifted_replica_worker, SAVE_WORLD, url, str(tmp_path))
    for r in range(SAVE_WORLD):
        err = _json(str(tmp_path / f"rank-drift-{r}.json"))["error"]
        assert "model/norm.weight: ranks 0 and 1 hold different values of it, but it is a DTensor whose " \
               "placements replicate it (Replicate())" in err and "\n" not in err, err
    repo = ckptrepo.open(url)
    assert repo.log() == [] and repo.fsck().ok
