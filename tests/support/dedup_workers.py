"""Worker bodies for tests/integration/test_dedup_repository.py and tests/distributed/test_dedup_ranks.py: a
LoRA fine-tune (a frozen base and trainable low-rank adapters) that snapshots, in processes of their own, so
that dedup is tested across a process restart and per rank on gloo.

Every worker builds the same model from the same seed; results go to ``result-<tag>-<rank>.json`` in
``out_dir`` (the version sizes it saw, the bytes that changed) and a traceback to ``error-<tag>-<rank>.txt``.
"""
from __future__ import annotations

import json
import os
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch

import ckptrepo

D, RANK, LAYERS = 512, 8, 4   # a frozen base of ~4 MiB, adapters of 128 KiB


class LoRALinear(torch.nn.Module):
    """A frozen Linear plus a trainable low-rank update B @ A, and a frozen buffer."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.A = torch.nn.Parameter(torch.randn(rank, d) * 0.01)
        self.B = torch.nn.Parameter(torch.zeros(d, rank))
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) * self.scale + (x @ self.A.t()) @ self.B.t()


def lora(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[LoRALinear(D, RANK) for _ in range(LAYERS)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    model(torch.randn(16, D, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def changed_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """What a step changes: the adapters and their optimizer state (moments and step scalars)."""
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return adapters + sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                          if torch.is_tensor(t))


def resume_and_snapshot(url: str, steps: list[int], out_dir: str, tag: str) -> None:
    """A new process: the state from HEAD (if any), then a snapshot after each of ``steps``."""
    try:
        repo = ckptrepo.open(url)
        model, opt = lora()
        state = {"model": model, "optimizer": opt}
        if repo.log():
            train_step(model, opt, -1)   # the optimizer state exists before it is loaded into
            repo.load("HEAD", into=state)
        sizes = []
        with repo.snapshotter() as snap:
            snap.attach(opt)
            for step in steps:
                train_step(model, opt, step)
                sizes.append(snap.snapshot(state, step=step).result().size)
        with open(os.path.join(out_dir, f"result-{tag}-0.json"), "w") as f:
            json.dump({"sizes": sizes, "changed": changed_bytes(model, opt)}, f)
    except BaseException:
        with open(os.path.join(out_dir, f"error-{tag}-0.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def ranks_snapshot(rank: int, world: int, port: int, url: str, steps: list[int], tag: str, out_dir: str) -> None:
    """One rank of ``world`` (every rank a data-parallel replica of the LoRA model): resume from HEAD if there
    is one, then snapshot after each of ``steps``; records each version's size and what this rank wrote."""
    import torch.distributed as dist
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        repo = ckptrepo.open(url)
        model, opt = lora()
        state = {"model": model, "optimizer": opt}
        if repo.log():
            train_step(model, opt, -1)
            with warnings.catch_warnings():   # every rank resumes from rank 0's state: all ranks' are equal
                warnings.simplefilter("ignore")
                repo.load("HEAD", into=state)
        sizes, written = [], []
        with repo.snapshotter() as snap:
            snap.attach(opt)
            for step in steps:
                train_step(model, opt, step)
                handle = snap.snapshot(state, step=step)
                sizes.append(handle.result().size)
                written.append(handle.stats.bytes)
        with open(os.path.join(out_dir, f"result-{tag}-{rank}.json"), "w") as f:
            json.dump({"sizes": sizes, "written": written, "changed": changed_bytes(model, opt)}, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-{tag}-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_alone(target: Any, *args: Any, timeout: float = 120.0) -> None:
    """``target(*args)`` in a fresh process (a restart); raise with its traceback if it fails."""
    from support.ckpt_workers import mp_context
    p = mp_context().Process(target=target, args=args)
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    if p.exitcode != 0:
        out_dir = args[-2]
        errors = [open(os.path.join(out_dir, n)).read() for n in sorted(os.listdir(out_dir)) if n.startswith("error-")]
        raise AssertionError(f"{target.__name__} exited with {p.exitcode}\n" + "\n".join(errors))


def result(out_dir: str, tag: str, rank: int = 0) -> dict[str, Any]:
    with open(os.path.join(out_dir, f"result-{tag}-{rank}.json")) as f:
        return json.load(f)
