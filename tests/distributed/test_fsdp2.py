"""FSDP2 (``fully_shard``) state dicts saved on one mesh size and resumed on another.

Two gloo processes shard an MLP and its Adam state with FSDP2 and snapshot
``get_state_dict(model, opt)``; three processes (rows split 11+11+11 and
2+2+1 instead of 17+16 and 3+2) load that version into their own FSDP2
state, hand it to the model with ``set_state_dict``, and train on. The
DTensors' placements say what each rank reads: no rules, no conversion.
"""
from __future__ import annotations

import json

import pytest
import torch
from support.dtensor_workers import run_ranks
from support.fsdp2_workers import load_worker, save_worker
from support.helpers import assert_bit_exact

import ckptrepo

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_fsdp2_state_resumes_on_another_mesh_size(tmp_path):
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    run_ranks(save_worker, 2, url, 1, str(tmp_path))
    run_ranks(load_worker, 3, url, 1, str(tmp_path))
    saved = torch.load(str(tmp_path / "full-save.pt"), weights_only=True)
    loaded = torch.load(str(tmp_path / "full-load.pt"), weights_only=True)
    moments = [k for k in saved if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 8 and {"model/0.weight", "model/2.bias"} <= set(saved)
    # parameters and Adam moments come back bit-exact in the new sharding (Adam's `step` is per rank)
    assert_bit_exact({k: v for k, v in saved.items() if not k.endswith("step")},
                     {k: v for k, v in loaded.items() if not k.endswith("step")})
    with open(tmp_path / "loss-save.json") as f:
        continued = json.load(f)
    with open(tmp_path / "loss-load.json") as f:
        resumed = json.load(f)
    # the reductions over 3 ranks add in another order than over 2: equal within float tolerance
    assert resumed == pytest.approx(continued, rel=1e-5)
    m = ckptrepo.open(url).plumbing.manifest(ckptrepo.open(url).resolve("HEAD"))
    assert {t.name: t.shape for t in m.tensors}["model/0.weight"] == (33, 16)


def test_2d_fsdp2_over_tensor_parallel_state_saves_and_loads(tmp_path):
    """FSDP2 over tensor parallelism (torchtitan's 2-D layout) gives the column-parallel weights
    ``(_StridedShard(0, sf=2), Shard(0))``, which was refused. Saved on a 2x2 mesh: loaded in one process it
    equals the full tensors torch's own ``full_tensor()`` gave; loaded back into a fresh 2x2 model it resumes."""
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    run_ranks(save_worker, 4, url, 2, str(tmp_path))
    saved = torch.load(str(tmp_path / "full-save.pt"), weights_only=True)
    plain = ckptrepo.open(url).load("HEAD")
    flat = {f"model/{k}": v for k, v in plain["model"].items()}
    assert_bit_exact({k: v for k, v in saved.items() if k.startswith("model/")}, flat)
    run_ranks(load_worker, 4, url, 2, str(tmp_path))
    loaded = torch.load(str(tmp_path / "full-load.pt"), weights_only=True)
    assert_bit_exact({k: v for k, v in saved.items() if not k.endswith("step")},
                     {k: v for k, v in loaded.items() if not k.endswith("step")})
    with open(tmp_path / "loss-save.json") as f:
        continued = json.load(f)
    with open(tmp_path / "loss-load.json") as f:
        assert json.load(f) == pytest.approx(continued, rel=1e-5)
