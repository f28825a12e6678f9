"""torch.distributed.checkpoint over a repository (ckptrepo.dcp): FSDP2 state saved through ``dcp.save`` on 2
gloo ranks loads through ``dcp.load`` on 3 (and a 3-rank save on 2), bit-exact; ``dcp.async_save`` commits a
version too; a ``repo.snapshot`` version loads through ``dcp.load`` and a ``dcp.save`` version through
``repo.load``, whole or into DTensors. One spawn per world size, several checks in each."""
from __future__ import annotations

import json

import pytest
import torch
from support.dcp_workers import dcp_save_worker, load_worker, reload_worker, save_worker
from support.dtensor_workers import run_ranks
from support.helpers import assert_bit_exact

import ckptrepo

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _full(tmp_path, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(str(tmp_path / f"full-{tag}.pt"), weights_only=True)


def test_fsdp2_state_through_dcp_on_other_world_sizes(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    run_ranks(save_worker, 2, url, str(tmp_path))
    run_ranks(load_worker, 3, url, str(tmp_path))
    saved = _full(tmp_path, "save2")
    assert {"model/0.weight", "optim/state/0.weight/exp_avg", "optim/state/0.weight/step"} <= set(saved)
    # dcp.save (@1), async_save (@2) and repo.snapshot (@3), each loaded by dcp.load on 3 ranks: every
    # parameter, moment and step bit-exact; and @1 loaded by repo.load into the 3 ranks' DTensors
    for tag in ("dcp1-3", "dcp2-3", "dcp3-3", "repo1-3"):
        assert_bit_exact(saved, _full(tmp_path, tag))
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [4, 3, 2, 1]
    # a dcp.save version loads whole in one process, in the nesting given to dcp.save
    plain = repo.load("@1")
    assert plain["extra"] == {"epoch": 3, "note": "dcp"}
    assert_bit_exact(saved, {f"model/{k}": v for k, v in plain["model"].items()} |
                     {f"optim/state/{p}/{k}": v for p, s in plain["optim"]["state"].items() for k, v in s.items()})
    m = repo.plumbing.manifest(repo.resolve("@1"))
    assert {t.name: t.shape for t in m.tensors}["model/0.weight"] == (33, 16)
    assert {k.split("/")[2] for k in m.arrays} == {"0", "1"}   # both ranks wrote their shards
    # @2 saved the same state again: every piece points at @1's bytes; both record the ranks' merged statistics,
    # those of repo.snapshot's @3 (rank 0's merge of the same pieces' moments)
    m2 = repo.plumbing.manifest(repo.resolve("@2"))
    assert all(p.array.startswith(f"data/{m.id}/") for t in m2.tensors for p in t.pieces)
    rows1, rows2 = m.tensor_stats.rows(), m2.tensor_stats.rows()
    rows3 = repo.plumbing.manifest(repo.resolve("@3")).tensor_stats.rows()
    assert set(rows1) == {t.name for t in m.tensors} and "model/0.weight" in rows3
    for name, row in rows3.items():
        if name not in rows1:   # a snapshot stores the Adam steps its own way
            continue
        for col in ("norm", "mean", "std", "min", "max", "nan", "inf"):
            assert rows1[name][col] == pytest.approx(row[col], rel=1e-6, abs=1e-7), (name, col)
            assert rows2[name][col] == rows1[name][col], (name, col)
        assert rows2[name]["delta"] == 0.0
    # Adam's step is equal on every saved rank: a resume on another mesh does not warn about it; a seed that
    # differs per rank still does
    with open(tmp_path / "warn-3.json") as f:
        caught = json.load(f)
    assert not [w for w in caught["@3"] if "layout changed" in w], caught["@3"]
    changed = [w for w in caught["@4"] if "layout changed" in w]
    assert changed and "seed" in changed[0] and "step" not in changed[0], caught["@4"]


@pytest.mark.slow
def test_fsdp2_state_dcp_saved_on_3_ranks_loads_on_2(tmp_path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    run_ranks(dcp_save_worker, 3, url, str(tmp_path))
    run_ranks(reload_worker, 2, url, str(tmp_path))
    assert_bit_exact(_full(tmp_path, "save3"), _full(tmp_path, "dcp5-2"))
