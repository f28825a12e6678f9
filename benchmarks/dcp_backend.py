"""``dcp.save`` / ``dcp.load`` through ckptrepo's storage (``ckptrepo.dcp``) against DCP's own files.

    python benchmarks/dcp_backend.py [--size-mb 128] [--ranks 2] [--reps 3] [--json out.json]

``--ranks`` gloo processes (CPU) shard an MLP of about ``--size-mb`` MiB of fp32 parameters with FSDP2
(``fully_shard``) and take one Adam step, so the state (``get_state_dict``: parameters plus two moments) is
about three times that. Each repetition saves it with ``dcp.save`` to ``FileSystemWriter`` (a fresh
directory) and to ``ckptrepo.dcp.Writer`` (a new version of one repository), then loads each back into the
same processes with ``dcp.load`` (``FileSystemReader`` / ``ckptrepo.dcp.Reader``), in alternating order. A
time is the slowest rank's (every call is a collective), and the fastest repetition is reported. The files
are read once before each load, outside its time, so that both load from the page cache (a save with
``O_DIRECT`` leaves none of its bytes there): this measures the CPU cost of each storage layer, not the disk.

Every tensor of the state changes between repetitions (as a training step changes it), so that each version
writes its bytes rather than pointing at its parent's; ``--unchanged`` saves the same state each time. Each
call starts from a collected heap: DCP's own gathers promote many objects a call, and the full collection
that sets off every few calls (a walk of every object of a process holding torch) would land on whichever call
crosses the threshold, not on the one that made the garbage. ``--profile save:repo`` (or
``load:fs``...) prints rank 0's cProfile of that call in the last repetition.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import report  # noqa: E402


def _worker(rank: int, world: int, port: int, size_mb: int, reps: int, root: str, profile: str | None,
            unchanged: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptrepo.dcp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    width = 1024
    layers = max(1, size_mb * (1 << 20) // (4 * width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    url = os.path.join(root, "repo")

    def timed(fn: Any, *args: Any) -> float:
        gc.collect()
        dist.barrier()
        prof = None
        if profile and rank == 0 and f"{fn.__name__}:{args[0]}" == profile and args[1] == reps - 1:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        fn(*args)
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.path.join(root, "profile.out"))
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    def save(how: str, rep: int) -> None:
        writer = dcp.FileSystemWriter(os.path.join(root, f"fs-{rep}")) if how == "fs" else \
            ckptrepo.dcp.Writer(url, step=rep)
        dcp.save(state, storage_writer=writer)

    def warm() -> None:
        if rank == 0:
            for folder, _, files in os.walk(root):
                for name in files:
                    with open(os.path.join(folder, name), "rb") as f:
                        while f.read(1 << 24):
                            pass

    def load(how: str, rep: int) -> None:
        reader = dcp.FileSystemReader(os.path.join(root, f"fs-{rep}")) if how == "fs" else \
            ckptrepo.dcp.Reader(url, f"@{rep}")
        dcp.load(state, storage_reader=reader)

    times: dict[str, list[float]] = {k: [] for k in ("save_fs", "save_repo", "load_fs", "load_repo")}
    for rep in range(reps):
        if rep and not unchanged:
            with torch.no_grad():
                for t in _tensors(state):
                    t.mul_(1.0001)
        order = ("fs", "repo") if rep % 2 == 0 else ("repo", "fs")
        for op, fn in (("save", save), ("load", load)):
            if op == "load":
                warm()
            for how in order:
                times[f"{op}_{how}"].append(timed(fn, how, rep))
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for sd in (msd, osd["state"])
                     for t in _tensors(sd))
        with open(os.path.join(root, "figures.json"), "w") as f:
            json.dump({"state_mb": nbytes / (1 << 20), "ranks": world,
                       **{k: min(v) for k, v in times.items()}}, f)
    dist.destroy_process_group()


def _tensors(obj: Any) -> list[Any]:
    import torch
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _print(s: dict[str, Any]) -> None:
    print(f"FSDP2 state of {s['state_mb']:.0f} MiB on {s['ranks']} ranks (slowest rank, best of the repetitions)")
    print(f"{'':8} {'DCP files s':>12} {'ckptrepo s':>12} {'ratio':>8}")
    for op in ("save", "load"):
        fs, repo = s[f"{op}_fs"], s[f"{op}_repo"]
        print(f"{op:8} {fs:12.3f} {repo:12.3f} {repo / fs:8.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None)
    p.add_argument("--unchanged", action="store_true", help="save the same state every repetition")
    p.add_argument("--profile", default=None, metavar="OP:HOW",
                   help="cProfile rank 0's last OP (save, load) to HOW (fs, repo); printed after the figures")
    a = p.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="dcp-bench-")
    try:
        return _run(a, root)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _run(a: argparse.Namespace, root: str) -> int:
    import torch.multiprocessing as mp

    import ckptrepo
    ckptrepo.init(os.path.join(root, "repo"), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.ranks, port, a.size_mb, a.reps, root, a.profile, a.unchanged), nprocs=a.ranks)
    with open(os.path.join(root, "figures.json")) as f:
        rc = report(json.load(f), _print, a.json)
    if a.profile:
        import pstats
        pstats.Stats(os.path.join(root, "profile.out")).sort_stats("cumulative").print_stats(40)
    return rc


if __name__ == "__main__":
    sys.exit(main())
