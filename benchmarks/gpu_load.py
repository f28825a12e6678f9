"""Load a checkpoint onto the GPU: ckptrepo against ``torch.load(map_location="cuda")`` and DCP.

One state (float32 and bf16 CUDA tensors, sizes spread like a model's) is saved once by each: a ckptrepo
version, a ``torch.save`` file and a DCP checkpoint, all on ``--dir``. Each is then loaded onto the GPU,
``--repeat`` times, and the fastest time is reported, the device synchronised at the end:

* ``ckptrepo read``      ``repo.load(device="cpu")``: the read alone (the floor a pipelined load aims at)
* ``ckptrepo cuda``      ``repo.load(device="cuda")``: reads into pinned buffers, copied on a copy stream
* ``ckptrepo into``      ``repo.load(into=state)`` of CUDA tensors (a resume's way)
* ``torch.load``         ``torch.load(path, map_location="cuda")``
* ``dcp.load``           ``torch.distributed.checkpoint.load`` into CUDA tensors

The files were just written, so the page cache is warm for every reader alike: these are the readers'
and copies' own costs, not the disk's.

    python benchmarks/gpu_load.py --gb 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training_overhead import dcp_setup  # noqa: E402

import ckptrepo  # noqa: E402


def make_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """~90 % of the bytes in 24 float32 matrices, the rest in 200 bf16 vectors."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = int(total_bytes * 0.9 / 24 / 4)
    small = int(total_bytes * 0.1 / 200 / 2)
    state = {f"layer{i}.weight": torch.randn(big // 1024, 1024, device="cuda", generator=g) for i in range(24)}
    state.update({f"vec{i}": torch.randn(small, device="cuda", generator=g).bfloat16() for i in range(200)})
    torch.cuda.synchronize()
    return state


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del out
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_load.py needs a CUDA GPU", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    import torch.distributed.checkpoint as dcp
    root = tempfile.mkdtemp(dir=args.dir, prefix="gpu-load-")
    try:
        state = make_state(int(args.gb * 1e9))
        size = sum(t.numel() * t.element_size() for t in state.values())
        print(f"{len(state)} CUDA tensors, {size / 1e9:.2f} GB, on {torch.cuda.get_device_name()}; "
              f"DCP process group: {dcp_setup(['dcp'], root, 'auto')}; page cache warm", flush=True)
        repo = ckptrepo.init(os.path.join(root, "repo"))
        repo.snapshot(state, step=1)
        pt = os.path.join(root, "state.pt")
        torch.save(state, pt)
        dcp_dir = os.path.join(root, "dcp")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir))
        into = {k: torch.empty_like(v) for k, v in state.items()}

        def dcp_load() -> object:
            dcp.load(into, storage_reader=dcp.FileSystemReader(dcp_dir))
            return None

        modes: dict[str, Callable[[], object]] = {
            "ckptrepo read": lambda: repo.load("@1", device="cpu"),
            "ckptrepo cuda": lambda: repo.load("@1", device="cuda"),
            "ckptrepo into": lambda: repo.load("@1", into=into),
            "torch.load": lambda: torch.load(pt, map_location="cuda", weights_only=True),
            "dcp.load": dcp_load,
        }
        best = {}
        for rep in range(args.repeat + 1):   # the first round warms up (pinned memory, imports, page cache)
            for name, fn in modes.items():
                dt = timed(fn)
                if rep:
                    best[name] = min(best.get(name, dt), dt)
        got = repo.load("@1", device="cuda")
        assert all(torch.equal(got[k], state[k]) for k in state), "ckptrepo's load differs from the state"
        print(f"{'mode':16s} {'s':>8s} {'GB/s':>7s}")
        for name, dt in best.items():
            print(f"{name:16s} {dt:8.3f} {size / dt / 1e9:7.2f}")
        print(f"ckptrepo cuda / read alone: {best['ckptrepo cuda'] / best['ckptrepo read']:.2f}x; "
              f"vs torch.load: {best['torch.load'] / best['ckptrepo cuda']:.2f}x faster; "
              f"vs dcp.load: {best['dcp.load'] / best['ckptrepo cuda']:.2f}x faster")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
