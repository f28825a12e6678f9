"""Megatron-core ``dist_checkpointing`` saving into ckptrepo and loading from it, on gloo.

Two gloo ranks save a hand-built sharded state dict (split one way, a replicated tensor, a stacked layer
axis, per-rank objects, common values) and a tensor-parallel (TP=2) GPTModel through
``CkptRepoSaveStrategy``, then load the hand-built one back split another way; one process loads both
(whole, through Megatron's load_plain_tensors, cast to float64, and into a TP=1 GPTModel) and saves the
GPT again. See tests/support/megatron_workers.py.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    # found, not imported: megatron-core takes seconds of CPU to import, which only the workers need
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from support.dtensor_workers import free_port, run_ranks  # noqa: E402
from support.helpers import assert_bit_exact  # noqa: E402
from support.megatron_workers import COMMON, GLOBALS, HAND_DIR, megatron_worker  # noqa: E402

import ckptrepo  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Run the workers once: 2 ranks save (and reload split another way), then rank 0 alone loads and resaves."""
    out = tmp_path_factory.mktemp("megatron")
    url, gpt_url = str(out / "repo"), str(out / "gpt-repo")
    ckptrepo.init(url)
    ckptrepo.init(gpt_url)
    run_ranks(megatron_worker, 2, free_port(), url, gpt_url, str(out), timeout=150)
    return out, url, gpt_url


def test_two_rank_save_is_one_version_of_global_tensors(saved):
    """Each rank wrote only its main replicas; the version holds Megatron's global keys and shapes, loads
    unsharded with repo.load bit for bit, and the directory points at it."""
    out, url, _ = saved
    repo = ckptrepo.open(url)
    with open(out / "save.json") as f:
        vid = json.load(f)["hand"]
    assert repo.resolve("HEAD") == vid
    v = repo.log()[0]
    assert (v.step, v.message, v.metrics) == (7, "megatron save iter_0000007", {"loss": 1.5})
    state = repo.load(vid)
    assert_bit_exact(state["sharded"], GLOBALS)
    assert state["common"]["iteration"] == 7 and torch.equal(state["common"]["t"], COMMON["t"])
    assert [state["objects"]["rng/shard_0_2"]["value"]["n"], state["objects"]["rng/shard_1_2"]["value"]["n"]] \
        == [0, 1]
    manifest = repo.plumbing.manifest(vid)
    pieces = {t.name: len(t.pieces) for t in manifest.tensors}
    assert pieces["sharded/w"] == 2 and pieces["sharded/layers.fc.weight"] == 4 and pieces["sharded/r"] == 1
    with open(out / HAND_DIR / "metadata.json") as f:
        assert json.load(f)["sharded_backend"] == "ckptrepo"
    with open(out / HAND_DIR / "ckptrepo.json") as f:
        assert json.load(f) == {"url": os.path.abspath(url), "version": vid}


def test_tp2_gpt_model_loads_into_tp1_bit_exact(saved):
    """A real megatron-core GPTModel saved with TP=2, loaded into a TP=1 model of another seed and saved
    again: the two versions hold the same tensors, bit for bit."""
    _, _, gpt_url = saved
    repo = ckptrepo.open(gpt_url)
    first, second = repo.log()[1], repo.log()[0]
    assert (first.step, second.step) == (3, 4)
    a, b = repo.load(first.id)["sharded"], repo.load(second.id)["sharded"]
    assert "decoder.layers.self_attention.linear_qkv.weight" in a and a["embedding.word_embeddings.weight"].shape \
        == (64, 16)
    assert_bit_exact(a, b)


def test_what_is_refused(saved):
    """A save into a non-repository fails on every rank with ckptrepo's error and commits nothing; a directory
    without a pointer file and a flattened_range (a slice of a box) are refused, saying what to do; a common
    state only pickle can store is left to common.pt, and loading it from the version says so."""
    out, _, _ = saved
    with open(out / "errors.json") as f:
        errors = json.load(f)
    assert "nothing committed" in errors["save"] and "NotARepositoryError" in errors["save"]
    assert "CkptRepoLoadStrategy(url, rev)" in errors["pointer"]
    assert "flattened_range" in errors["flat"] and "fully_sharded_model_space" in errors["flat"]
    assert errors["steps"] == [100, None]
    assert "holds no common state" in errors["pickle_only"] and "default common strategy" in errors["pickle_only"]
