"""FSDP2 training saved through ``torch.distributed.checkpoint`` into a repository, resumed on another world size.

    python examples/dcp_fsdp2.py --repo /tmp/dcp-repo

Two gloo processes (CPU) shard an MLP with ``fully_shard``, train 4 steps and ``dcp.save`` the model and
Adam state as a version every 2 steps (the last one with ``dcp.async_save``); then three processes build
the same model, ``dcp.load`` version ``@2`` into their own sharding and train on. The only glue is the
storage argument of each DCP call (marked ``# <- ckptrepo``); everything else is DCP's FSDP2 recipe.
Rank 0 prints the losses; the resumed run's steps 3 and 4 equal the first run's within float rounding
(3 ranks reduce the gradients in another order than 2).
"""
from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptrepo
import ckptrepo.dcp


def setup(rank: int, world: int, port: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def first_run(rank: int, world: int, port: int, url: str) -> None:
    model, opt = setup(rank, world, port)
    pending = None
    for step in range(1, 5):
        loss = train_step(model, opt, step)
        if rank == 0:
            print(f"run 1 ({world} ranks) step {step}: loss {loss:.6f}")
        if step % 2 == 0:
            msd, osd = get_state_dict(model, opt)
            writer = ckptrepo.dcp.Writer(url, step=step, metrics={"loss": loss})   # <- ckptrepo
            if step < 4:
                dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
            else:   # in the background: training could go on while it writes
                pending = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer)
    if pending is not None:
        pending.result()
    dist.destroy_process_group()


def resumed_run(rank: int, world: int, port: int, url: str) -> None:
    model, opt = setup(rank, world, port)
    train_step(model, opt, 0)   # Adam's state exists, so get_state_dict has every tensor to load into
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ckptrepo.dcp.Reader(url, "@2"))             # <- ckptrepo
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(3, 5):
        loss = train_step(model, opt, step)
        if rank == 0:
            print(f"run 2 ({world} ranks, from @2) step {step}: loss {loss:.6f}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="repository path or URL (created if missing)")
    args = parser.parse_args()
    ckptrepo.init(args.repo, exist_ok=True)
    mp.spawn(first_run, args=(2, free_port(), args.repo), nprocs=2)
    mp.spawn(resumed_run, args=(3, free_port(), args.repo), nprocs=3)
    for v in ckptrepo.open(args.repo).log():
        print(f"version {v.id[:12]} step {v.step} loss {v.metrics.get('loss'):.6f}")


if __name__ == "__main__":
    main()
