"""Tensor-parallel training under torchrun, snapshotted every step, resumed under any number of processes.

    torchrun --standalone --nproc_per_node 2 examples/train_tp.py --repo /tmp/tp-repo --steps 8
    torchrun --standalone --nproc_per_node 1 examples/train_tp.py --repo /tmp/tp-repo --steps 8 --resume @4

A small MLP is parallelised with ``torch.distributed.tensor.parallel`` over a
CPU device mesh of all the processes (gloo): ``up`` column-parallel, ``down``
row-parallel. Its parameters and the Adam moments are DTensors, so ckptrepo
needs no rules: each rank's shards are read from their placements. Every rank
calls ``snapshot()`` each step (a collective: ranks agree on the version and on
who writes each replica) and goes on training; the attached optimizer waits for
the capture only before it changes the state.

``--resume REV`` continues on REV if it is a branch, and otherwise rolls back
on a new branch (``resume-<step>-<pid>``); either way it builds the
model for this run's mesh, loads the version into it in place
(``ckptrepo.load(url, REV, into=state)``: each rank reads only the bytes of its
own shards) and trains on. The losses (printed by rank 0 as JSON) follow the
original run's: bit for bit on the same number of processes, within float
rounding on another (the row-parallel sum is reduced in another order).
"""
from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ckptrepo

DIM = 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (tensor parallelism splits the model, not the data)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, DIM, generator=g)
    return x, x.flip(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--resume", default=None,
                   help="a revision to load and train on from (e.g. @4); a branch is continued, not forked")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))   # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)   # the same full weights on every rank before they are sharded
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step(step: int) -> float:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    if rank == 0 and not args.resume and not os.path.exists(os.path.join(args.repo, "ckptrepo.json")):
        ckptrepo.init(args.repo)
    dist.barrier()
    first = 1
    if args.resume:
        repo = ckptrepo.open(args.repo)
        target = repo.version(args.resume)
        if rank == 0:
            if args.resume in repo.branches():   # a branch: continue on it
                repo.checkout(args.resume)
            else:   # roll back on a new branch: the original run keeps its versions (git checkout -b)
                repo.checkout(target.id, branch=f"resume-{target.step}-{os.getpid()}")
        dist.barrier()
        train_step(0)    # Adam's moments exist once it has stepped; the load then fills them in place
        ckptrepo.load(args.repo, target.id, into={"model": model, "optimizer": opt})
        first = target.step + 1
    repo = ckptrepo.open(args.repo)
    losses = {}
    with repo.snapshotter() as snap:
        snap.attach(opt)
        for step in range(first, args.steps + 1):
            losses[step] = train_step(step)
            snap.snapshot({"model": model, "optimizer": opt}, step=step, metrics={"loss": losses[step]})
        snap.wait()
    if rank == 0:
        print(json.dumps({"world": world, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
