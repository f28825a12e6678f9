"""Worker body of the distributed commit race (tests/distributed/test_commit_race.py), at module level so that
it pickles to the gloo ranks ``megatron_ref.launch`` starts."""
from __future__ import annotations

import os
from typing import Any

import torch

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import CkptRepoError, ConflictError
from ckptrepo.parallel.layout import ParallelLayout

BARRIER_TIMEOUT = 60.0


def race_state(r: int, who: int) -> dict[str, Any]:
    """A small state, different for each round and racer (``who``: 0 the ranks, 1 the competing writer)."""
    return {"w": torch.full((4,), float(2 * r + who))}


def distributed_racer(rank: int, layout: ParallelLayout, url: str, env: dict[str, str], rounds: int,
                      line_up: Any) -> list[tuple[str | None, str]]:
    """Each round the ranks snapshot one replicated state (the two-phase commit); rank 0 meets the competing
    writer at ``line_up`` before the round and again right before its compare-and-swap. Per round: the
    committed version id (None: refused) and the refusal's message."""
    os.environ.update(env)   # the forkserver's workers do not see the test's environment
    repo = ckptrepo.open(url)
    repo.host_memory = 1 << 20
    if rank == 0:
        faults.set_hook("after_manifest", lambda _name: line_up.wait(BARRIER_TIMEOUT))
    out: list[tuple[str | None, str]] = []
    try:
        for r in range(rounds):
            if rank == 0:
                line_up.wait(BARRIER_TIMEOUT)
            try:
                out.append((repo.snapshot(race_state(r, 0), step=r + 1).id, ""))
            except ConflictError as err:
                out.append((None, str(err)))
            except CkptRepoError as err:
                if rank == 0:
                    raise
                out.append((None, str(err)))   # rank 0's conflict, as the other ranks hear of it
    except BaseException:
        if rank == 0:
            line_up.abort()
        raise
    return out
