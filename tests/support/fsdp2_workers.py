"""Worker bodies for tests/distributed/test_fsdp2.py: an MLP sharded with FSDP2 (``fully_shard``) on a CPU mesh (gloo).

Each Linear and the root are wrapped with ``fully_shard``: every parameter and
Adam moment is a DTensor with ``Shard(0)`` placements over the mesh, split
unevenly where the rows do not divide (33 rows: 17+16 over 2 ranks, 11+11+11
over 3; 5 rows: 3+2, 2+2+1). The state is ``get_state_dict(model, opt)``, as
in DCP's FSDP2 examples. Results go to files in ``out_dir``: ``full-<tag>.pt``
(rank 0: full tensors gathered with ``full_tensor()``), ``loss-<tag>.json``
(the losses of the steps trained after the save or the load).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from support.dtensor_workers import _guarded, _init, _write_json, full

D_IN, D_HID, D_OUT = 16, 33, 5
CONTINUE_STEPS = 3


def build(mesh: Any, seed: int, tp: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP2-sharded model and its Adam optimizer after one step on the seed's data.

    ``tp`` > 1: 2-D, as torchtitan does it: tensor parallel over the inner mesh dimension first
    (``parallelize_module``: the first Linear column-wise, the second row-wise), then FSDP2 over the outer
    one, which makes the column-wise parameters ``(_StridedShard(0, sf=tp), Shard(0))``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(seed)   # every rank builds the same global values
    hid = D_HID if tp == 1 else D_HID + 1   # torch's tensor parallel forward needs even splits (34: 17 + 17,
    model = nn.Sequential(nn.Linear(D_IN, hid), nn.ReLU(), nn.Linear(hid, D_OUT))   # then 9 + 8 for FSDP2)
    if tp > 1:
        mesh2 = init_device_mesh("cpu", (mesh.size() // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh2["dp"]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, opt, torch.randn(8, D_IN))
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_on(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """The losses of CONTINUE_STEPS steps on fixed data (the same on every rank and in every run)."""
    g = torch.Generator().manual_seed(123)
    return [_step(model, opt, torch.randn(8, D_IN, generator=g)) for _ in range(CONTINUE_STEPS)]


def _train_and_report(rank: int, tag: str, model: nn.Module, opt: torch.optim.Optimizer, ref: dict[str, torch.Tensor],
                      out_dir: str) -> None:
    """Train the fixed steps; rank 0 writes the full tensors taken before (``ref``) and the losses."""
    losses = train_on(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(out_dir, f"full-{tag}.pt"))
        _write_json(out_dir, f"loss-{tag}.json", losses)


def save_worker(rank: int, world: int, port: int, url: str, tp: int, out_dir: str) -> None:
    """Snapshot the FSDP2 state on ``world`` ranks, then keep training: the losses a resumed run must follow."""
    def body() -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import ckptrepo
        mesh = _init(rank, world, port)
        model, opt = build(mesh, seed=0, tp=tp)
        msd, osd = get_state_dict(model, opt)
        ckptrepo.open(url).snapshot({"model": msd, "optim": osd}, step=1)
        _train_and_report(rank, "save", model, opt, full({"model": msd, "optim": osd}), out_dir)
    _guarded("save", rank, out_dir, body)


def load_worker(rank: int, world: int, port: int, url: str, tp: int, out_dir: str) -> None:
    """Load HEAD into another FSDP2 model's state on ``world`` ranks (built from another seed), hand it to the
    model and optimizer with ``set_state_dict``, then train the same steps."""
    def body() -> None:
        import warnings

        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        import ckptrepo
        mesh = _init(rank, world, port)
        model, opt = build(mesh, seed=1, tp=tp)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # Adam's per-rank `step` comes from another saved rank: expected
            ckptrepo.open(url).load("HEAD", into=state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)
        _train_and_report(rank, "load", model, opt, full({"model": msd, "optim": osd}), out_dir)
    _guarded("load", rank, out_dir, body)
