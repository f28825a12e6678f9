"""The worker a simulated node's torchrun agent runs (tests/distributed/test_nodes.py): one rank of a job whose
nodes each have their own local repository in front of one shared remote.

Every rank follows the user contract of a node-local tier: the node's first local rank creates the node's
repository (on a first start, or after its disk was wiped) with the shared remote as ``origin``; every rank
then opens it, makes a snapshotter that pushes there, loads the branch's tip on a restart, and snapshots the
given steps. The state at a step is a function of the step alone (its full tensors) and of the rank (the
tensor-parallel slices it holds), so the parent computes what every version and every load must hold.

Each rank writes a report (``<report>/rank<R>.json``): where torchrun put it (global rank, GROUP_RANK,
LOCAL_RANK), its node's directory, and what its load held. A failure in this script raises, and so makes the
rank, then its agent, exit non-zero with the traceback in the agent's output.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import torch

# run as a script by torchrun: the tests' support package sits beside this file's folder
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptrepo.parallel.layout import ParallelLayout  # noqa: E402
from ckptrepo.rules import Replicated, Rules, Split  # noqa: E402
from support.helpers import assert_bit_exact  # noqa: E402

RULES = Rules([("col.weight", Split(0)), ("row.weight", Split(1)), ("norm.weight", Replicated())])
WORLD_SIZE = 4          # two nodes of two ranks
COMMIT_TIMEOUT_S = 20.0
HOOK_NOT_FIRED = 3      # the exit code of a rank whose kill hook never ran: the parent sees it instead of -SIGKILL


def layout(world_size: int = WORLD_SIZE) -> ParallelLayout:
    """Tensor parallelism over every rank: each rank holds its own slices, so each writes arrays of its own."""
    return ParallelLayout(tp=world_size, rules=RULES)


def full_state(step: int, world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """The whole state at ``step``, as an unsharded load returns it: two dtypes, so two arrays per rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"model": {"col.weight": torch.randn(16 * world_size, 32, generator=g),
                      "row.weight": torch.randn(32, 16 * world_size, generator=g).to(torch.bfloat16),
                      "norm.weight": torch.randn(32, generator=g)},
            "step": step}


def rank_state(step: int, rank: int, world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """What ``rank`` holds at ``step``: its slices of the split tensors, the replicated one whole."""
    full = full_state(step, world_size)
    model = full["model"]
    return {"model": {"col.weight": model["col.weight"].chunk(world_size, dim=0)[rank].clone(),
                      "row.weight": model["row.weight"].chunk(world_size, dim=1)[rank].clone(),
                      "norm.weight": model["norm.weight"].clone()},
            "step": step}


def _kill_self(_point: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node-dir", required=True, help="this node's local repository (created if absent)")
    parser.add_argument("--remote", required=True, help="the shared remote's URL")
    parser.add_argument("--report", required=True, help="a folder for this rank's report")
    parser.add_argument("--load", type=int, default=None, help="first load main's tip, which must be this step")
    parser.add_argument("--steps", default="", help="the steps to snapshot, comma-separated")
    parser.add_argument("--wait-after", default="", help="steps after which every version must reach the remote")
    parser.add_argument("--keep-last", type=int, default=None, help="local_keep_last: evict older data here")
    parser.add_argument("--kill-before", type=int, default=None,
                        help="before this step, SIGKILL this rank at its first push_after_array")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    import ckptrepo
    from ckptrepo import faults

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    report: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "group_rank": int(os.environ["GROUP_RANK"]),
                              "node": os.path.abspath(args.node_dir), "pid": os.getpid()}
    if local_rank == 0 and not os.path.exists(args.node_dir):   # a first start, or a node whose disk was wiped
        repo = ckptrepo.init(args.node_dir)
        repo.remote_add("origin", args.remote)
        report["created"] = True
    dist.barrier()
    repo = ckptrepo.open(args.node_dir)
    lay = layout(world_size)
    # the snapshotter first: its start-up makes every node's branch agree before anything is loaded
    snap = repo.snapshotter(push_to="origin", parallel_layout=lay, commit_timeout_s=COMMIT_TIMEOUT_S,
                            host_memory=1 << 22, local_keep_last=args.keep_last)
    if args.load is not None:
        loaded = repo.load("main", parallel_layout=lay)
        report["loaded_step"] = loaded.get("step") if isinstance(loaded, dict) else None
        try:
            assert_bit_exact(loaded, rank_state(args.load, rank, world_size))
            report["load_error"] = None
        except AssertionError as err:
            report["load_error"] = str(err)
    wait_after = set(_steps(args.wait_after))
    for step in _steps(args.steps):
        if step == args.kill_before:
            faults.set_hook("push_after_array", _kill_self)
        snap.snapshot(rank_state(step, rank, world_size), step=step)
        snap.wait_captured()
        if step in wait_after:
            snap.wait()
    snap.wait()
    snap.close()
    report["main"] = repo.resolve("main")
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    if args.kill_before is not None:
        sys.exit(HOOK_NOT_FIRED)


if __name__ == "__main__":
    main()
