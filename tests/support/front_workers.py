"""Worker bodies of tests/distributed/test_front_door_ranks.py (module level: pickled to gloo ranks)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import ckptrepo
from ckptrepo.parallel.layout import ParallelLayout
from support.megatron_ref import GPTConfig, init_full_params, shard_full

CFG = GPTConfig(vocab_size=250, layers=2, hidden=8, heads=2, make_vocab_size_divisible_by=128)


def save_then_fill_without_layout(rank: int, layout: ParallelLayout, url: str) -> dict[str, Any]:
    """Snapshot this rank's state under ``layout`` (its rules), then ``load("@1000", into=...)`` a differently
    initialised state of the same rank with no ``parallel_layout=``; returns both states' model sections."""
    if rank == 0:
        ckptrepo.init(url)
    dist.barrier()
    repo = ckptrepo.open(url)
    rules = ckptrepo.rules.megatron_gpt(num_layers=CFG.layers, vocab_size=CFG.vocab_size)
    state = shard_full(CFG, layout, rank, init_full_params(CFG, seed=0))
    with repo.snapshotter(parallel_layout=ParallelLayout(layout.tp, layout.pp, layout.dp, layout.zero,
                                                         rules)) as snap:
        snap.snapshot(state, step=1000)
    into = shard_full(CFG, layout, rank, init_full_params(CFG, seed=5))
    assert not torch.equal(into["model"]["layers.0.mlp.fc1.weight"], state["model"]["layers.0.mlp.fc1.weight"])
    repo.load("@1000", into=into)
    return {"saved": state["model"], "loaded": into["model"]}
