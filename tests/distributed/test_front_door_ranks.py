"""The README's torchrun case: every rank fills its own state from a version saved under a ParallelLayout,
with no ``parallel_layout=`` (the layout is the saved one, as the process group has its ranks)."""
from __future__ import annotations

import pytest
import torch
from support.front_workers import CFG, save_then_fill_without_layout
from support.megatron_ref import init_full_params, launch, shard_full

import ckptrepo
from ckptrepo.errors import StateMismatchError
from ckptrepo.parallel.layout import ParallelLayout


def test_every_rank_fills_its_state_without_naming_the_layout(tmp_path) -> None:
    url = str(tmp_path / "repo")
    results = launch(ParallelLayout(tp=2), save_then_fill_without_layout, url)
    for r in results:
        assert r["saved"].keys() == r["loaded"].keys()
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
    # one process, no process group: the layout cannot be inferred, and the error names the one to pass
    repo = ckptrepo.open(url)
    into = shard_full(CFG, ParallelLayout(tp=2), 1, init_full_params(CFG, seed=5))
    with pytest.raises(StateMismatchError, match=r"saved by 2 ranks: to fill one rank's state pass "
                                                 r"parallel_layout=ckptrepo\.ParallelLayout\(tp=2, pp=1, dp=1, "
                                                 r"zero=0\) and its rank=$"):
        repo.load("@1000", into=into)
    repo.load("@1000", into=into, parallel_layout=ParallelLayout(tp=2, pp=1, dp=1, zero=0), rank=1)
    assert all(torch.equal(into["model"][k], results[1]["saved"][k]) for k in into["model"])
