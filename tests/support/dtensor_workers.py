"""Worker bodies for tests/distributed/test_dtensor.py: a tensor-parallel MLP on a CPU device mesh (gloo).

Every worker is a fresh process (forkserver, see ``mp_context``) that joins a
gloo process group on 127.0.0.1, builds the same small model parallelised with
``parallelize_module`` (``up``: ColwiseParallel, ``down``: RowwiseParallel with
a replicated bias, ``norm``: a LayerNorm whose parameters are replicated
DTensors), takes one Adam step so the optimizer state exists (its ``exp_avg``
/ ``exp_avg_sq`` are DTensors with the parameters' placements, ``step`` is a
plain per-rank tensor), and adds an unevenly sharded bf16 DTensor.

Results go to files in ``out_dir`` (the parent reads them): ``full-<tag>.pt``
(the full tensors, gathered with ``full_tensor()``, written by rank 0),
``rank-<tag>-<r>.json`` (per-rank byte counts), ``error-<tag>-<r>.txt`` (a
worker's traceback).
"""
from __future__ import annotations

import json
import os
import socket
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from support.ckpt_workers import mp_context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Any, world: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` processes; raise with any rank's traceback."""
    ctx = mp_context()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port) + args) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        out_dir = args[-1]
        errors = []
        for name in sorted(os.listdir(out_dir)):
            if name.startswith("error-"):
                with open(os.path.join(out_dir, name)) as f:
                    errors.append(f.read())
        raise AssertionError(f"{target.__name__} over {world} ranks: exit codes {codes}\n" + "\n".join(errors))


# ---- the model ------------------------------------------------------------------------------------

D_IN, D_HID = 16, 64
EMB_SHAPE = (10, 8)   # rows split unevenly: 5+5 over 2 ranks, 3+3+3+1 over 4


def _init(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    return init_device_mesh("cpu", (world,))


def build(mesh: Any, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """The parallelised model after one Adam step, and the state to snapshot/load (DTensors throughout)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)   # every rank builds the same global values
    model = nn.ModuleDict({"up": nn.Linear(D_IN, D_HID), "down": nn.Linear(D_HID, D_IN), "norm": nn.LayerNorm(D_IN)})
    with torch.no_grad():     # a LayerNorm that is not the identity at init
        model["norm"].weight.normal_()
        model["norm"].bias.normal_()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)})
    norm = model["norm"]
    for name, p in list(norm.named_parameters()):
        setattr(norm, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4, D_IN)
    y = model["norm"](model["down"](torch.relu(model["up"](x))))
    y.to_local().pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    emb = distribute_tensor(torch.randn(EMB_SHAPE).to(torch.bfloat16), mesh, [Shard(0)])
    return model, opt, {"model": msd, "optim": osd, "extra": {"emb": emb}, "step": 1}


def tensors(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in a nested state, in order."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in tensors(v, f"{path}/{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in tensors(v, f"{path}/{i}" if path else str(i))]
    return []


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def full(state: Any) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` whole (a collective: every rank calls it)."""
    return {p: (t.full_tensor() if is_dtensor(t) else t).detach().clone() for p, t in tensors(state)}


def local_bytes(state: Any) -> int:
    """The bytes this rank holds: DTensors' local shards (replicas included) and plain tensors."""
    return sum((t.to_local() if is_dtensor(t) else t).numel() * t.element_size() for _, t in tensors(state))


def byte_counts(state: Any) -> dict[str, int]:
    dt = [t for _, t in tensors(state) if is_dtensor(t)]
    plain = [t for _, t in tensors(state) if not is_dtensor(t)]
    return {"global_dtensor_bytes": sum(t.numel() * t.element_size() for t in dt),
            "plain_bytes": sum(t.numel() * t.element_size() for t in plain),
            "local_bytes": local_bytes(state)}


def _guarded(tag: str, rank: int, out_dir: str, body: Any) -> None:
    try:
        body()
    except BaseException:  # noqa: BLE001 - reported to the parent through a file
        with open(os.path.join(out_dir, f"error-{tag}-{rank}.txt"), "w") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}")
        os._exit(1)
    import torch.distributed as dist
    dist.destroy_process_group()


def _write_json(out_dir: str, name: str, obj: Any) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f)


# ---- worker bodies ----------------------------------------------------------------------------------

def save_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """Snapshot the state of the ``world``-rank model; rank 0 writes the reference full tensors."""
    def body() -> None:
        import ckptrepo
        mesh = _init(rank, world, port)
        _, _, state = build(mesh, seed=0)
        state["rng"] = torch.tensor([100 + rank])          # per-rank state: no placement says it is shared
        version = ckptrepo.open(url).snapshot(state, step=1, message=f"saved from {world} ranks")
        ref = full(state)
        counts = byte_counts(state)
        counts["vid"] = version.id
        _write_json(out_dir, f"rank-save-{rank}.json", counts)
        if rank == 0:
            torch.save(ref, os.path.join(out_dir, "full-save.pt"))
    _guarded("save", rank, out_dir, body)


def load_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """Load HEAD into the ``world``-rank model's DTensor state (built from another seed); report what was read."""
    def body() -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

        import ckptrepo
        from ckptrepo.loading._engine import ReadStats
        mesh = _init(rank, world, port)
        model, opt, state = build(mesh, seed=1)
        state["step"] = 0
        state["rng"] = torch.tensor([-1])
        stats = ReadStats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ckptrepo.open(url).load("HEAD", into=state, read_stats=stats)
        assert out is state
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)   # what the training objects hold now
        loaded = full({"model": msd, "optim": osd, "extra": state["extra"], "rng": state["rng"]})
        _write_json(out_dir, f"rank-load-{rank}.json", {
            "needed_bytes": stats.needed_bytes, "requested_bytes": stats.requested_bytes,
            "local_bytes": local_bytes(state), "step": state["step"], "rng": int(state["rng"][0]),
            "warnings": [str(w.message) for w in caught],
            "placements": {p: str(t.placements) for p, t in tensors(state) if is_dtensor(t)}})
        if rank == 0:
            torch.save(loaded, os.path.join(out_dir, "full-load.pt"))
    _guarded("load", rank, out_dir, body)


def drifted_replica_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """Snapshot the model after rank 1's copy of the replicated norm weight drifted (a sequence-parallel norm
    whose gradients were not all-reduced); write what the snapshot raised on this rank."""
    def body() -> None:
        import ckptrepo
        mesh = _init(rank, world, port)
        model, _, state = build(mesh, seed=0)
        if rank == 1:
            with torch.no_grad():
                model["norm"].weight.to_local().add_(1e-3)
        try:
            ckptrepo.open(url).snapshot(state, step=1)
            err = ""
        except ckptrepo.CkptRepoError as e:
            err = f"{type(e).__name__}: {e}"
        _write_json(out_dir, f"rank-drift-{rank}.json", {"error": err})
    _guarded("drift", rank, out_dir, body)
