"""What a version costs when little changes: bytes written per version against the bytes that changed.

A LoRA fine-tune (a frozen base of 4 layers of 1024x1024 plus low-rank adapters, AdamW on the adapters)
snapshots after every step, through each path a user has: ``repo.snapshot`` calls, one snapshotter, a new
snapshotter per snapshot, a process restart (a new process resumes from HEAD), and 2 gloo ranks (each its
own replica, so a version holds both ranks' states). Also the 10-call example: a 16 MiB frozen tensor and
a 0.5 MiB one that changes, ten ``repo.snapshot`` calls, and what ``du`` says the repository holds.
``--no-dedup`` runs the same with dedup off, for the side-by-side.

    python benchmarks/dedup.py
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch

import ckptrepo

D, RANK, LAYERS = 1024, 8, 4
MiB = 1 << 20


class LoRALinear(torch.nn.Module):
    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.A = torch.nn.Parameter(torch.randn(rank, d) * 0.01)
        self.B = torch.nn.Parameter(torch.zeros(d, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def lora() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[LoRALinear(D, RANK) for _ in range(LAYERS)])
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    model(torch.randn(8, D, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def changed(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def run_path(path: str, url: str, dedup: bool, steps: int = 4) -> tuple[list[int], int]:
    """Versions' sizes after the first, and the bytes a step changes."""
    repo = ckptrepo.init(url)
    model, opt = lora()
    state = {"model": model, "optimizer": opt}
    if path == "repo.snapshot":
        for i in range(steps):
            step(model, opt, i)
            if dedup:
                repo.snapshot(state, step=i)
            else:
                with repo.snapshotter(dedup=False) as snap:
                    snap.snapshot(state, step=i)
    elif path == "snapshotter":
        with repo.snapshotter(dedup=dedup) as snap:
            snap.attach(opt)
            for i in range(steps):
                step(model, opt, i)
                snap.snapshot(state, step=i)
                snap.wait()
    elif path == "new snapshotter each":
        for i in range(steps):
            step(model, opt, i)
            with repo.snapshotter(dedup=dedup) as snap:
                snap.snapshot(state, step=i)
    elif path == "process restart":
        for i in range(steps):   # each snapshot from a new process that resumes from HEAD
            off = [] if dedup else ["--no-dedup"]
            subprocess.run([sys.executable, __file__, "--resume-worker", url, str(i), *off], check=True)
        step(model, opt, 0)   # here only to count what a step changes
    sizes = [v.size for v in reversed(repo.log())]
    return sizes[1:], changed(model, opt)


def resume_worker(url: str, i: int, dedup: bool) -> None:
    repo = ckptrepo.open(url)
    model, opt = lora()
    state = {"model": model, "optimizer": opt}
    if repo.log():
        step(model, opt, -1)
        repo.load("HEAD", into=state)
    step(model, opt, i)
    with repo.snapshotter(dedup=dedup) as snap:
        snap.snapshot(state, step=i)


def rank_worker(rank: int, world: int, port: int, url: str, dedup: bool, steps: int, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    repo = ckptrepo.open(url)
    model, opt = lora()
    state = {"model": model, "optimizer": opt}
    written = []
    with repo.snapshotter(dedup=dedup) as snap:
        snap.attach(opt)
        for i in range(steps):
            step(model, opt, i)
            h = snap.snapshot(state, step=i)
            h.result()
            written.append(h.stats.bytes)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"written": written, "changed": changed(model, opt)}, f)
    dist.destroy_process_group()


def run_ranks(url: str, dedup: bool, steps: int = 4) -> tuple[list[int], int, list[list[int]]]:
    import torch.multiprocessing as mp
    ckptrepo.init(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.start_processes(rank_worker, args=(2, port, url, dedup, steps, out), nprocs=2, start_method="spawn")
    res = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    sizes = [v.size for v in reversed(ckptrepo.open(url).log())]
    return sizes[1:], sum(r["changed"] for r in res), [r["written"][1:] for r in res]


def ten_calls(url: str, dedup: bool) -> tuple[int, int]:
    repo = ckptrepo.init(url)
    g = torch.Generator().manual_seed(0)
    state = {"frozen": torch.randn(4 * MiB, generator=g), "adapter": torch.randn(MiB // 8, generator=g)}
    for i in range(10):
        state["adapter"].add_(1.0)
        if dedup:
            repo.snapshot(state, step=i)
        else:
            with repo.snapshotter(dedup=False) as snap:
                snap.snapshot(state, step=i)
    return repo.du().total_bytes, 16 * MiB + 10 * MiB // 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resume-worker", nargs=2)
    ap.add_argument("--no-dedup", action="store_true")
    args = ap.parse_args()
    if args.resume_worker:
        resume_worker(args.resume_worker[0], int(args.resume_worker[1]), not args.no_dedup)
        return
    root = tempfile.mkdtemp()
    print("| path | dedup | bytes per version after the first (mean) | changed bytes | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for dedup in ([False, True] if not args.no_dedup else [False]):
        for path in ("repo.snapshot", "snapshotter", "new snapshotter each", "process restart"):
            sizes, ch = run_path(path, os.path.join(root, f"{path}-{dedup}".replace(" ", "_")), dedup)
            mean = sum(sizes) / len(sizes)
            print(f"| {path} | {'on' if dedup else 'off'} | {mean:,.0f} | {ch:,} | {mean / ch:.3f} |", flush=True)
        sizes, ch, per_rank = run_ranks(os.path.join(root, f"ranks-{dedup}"), dedup)
        mean = sum(sizes) / len(sizes)
        print(f"| 2 gloo ranks (each rank: {sum(per_rank[0]) // len(per_rank[0]):,} / "
              f"{sum(per_rank[1]) // len(per_rank[1]):,}) | {'on' if dedup else 'off'} | {mean:,.0f} | {ch:,} | "
              f"{mean / ch:.3f} |", flush=True)
    for dedup in (False, True):
        held, distinct = ten_calls(os.path.join(root, f"ten-{dedup}"), dedup)
        print(f"\n10 repo.snapshot calls, dedup {'on' if dedup else 'off'}: the repository holds "
              f"{held / MiB:.1f} MiB for {distinct / MiB:.1f} MiB of distinct bytes ({held / distinct:.2f}x)")


if __name__ == "__main__":
    main()
