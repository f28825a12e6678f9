"""A training loop on the GPU that snapshots every iteration, against the same loop without snapshots.

A small GPT (pre-norm blocks, bf16 autocast) trained with AdamW on random tokens; its batch is doubled
until a step takes about ``--step-ms``, so the step is long enough to be realistic. Each round runs
``--steps`` steps without snapshots, then ``--steps`` steps with ``snapshot()`` after every step (the
snapshotter attached to the optimizer, whose next step waits for the capture); the per-iteration time
of each is the median over the round's steps, and the figure reported is the median over ``--rounds``
rounds. The repository lives on ``--dir`` (default: /dev/shm where there is one, so the disk's speed is
not what is measured) and keeps only the last few versions (a retention policy), so every-step
snapshots fit in it.

    python benchmarks/gpu_training.py --step-ms 100
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptrepo


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def step(model: nn.Module, opt: torch.optim.Optimizer, batch: int, seq: int, vocab: int) -> None:
    idx = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def timed_steps(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, batch: int,
                snap: ckptrepo.Snapshotter | None, first: int, handles: list | None = None) -> list[float]:
    """Per-iteration wall times (the host's view, a synchronize per step, as a loop logging its loss has)."""
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(model, opt, batch, args.seq, args.vocab)
        if snap is not None:
            h = snap.snapshot({"model": model, "optimizer": opt}, step=first + i)
            if handles is not None:
                handles.append(h)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def calibrate(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> tuple[int, float]:
    """The batch (a power of two) whose step takes about ``--step-ms``, and that step's time."""
    batch = args.batch
    while True:
        for _ in range(2):
            step(model, opt, batch, args.seq, args.vocab)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            step(model, opt, batch, args.seq, args.vocab)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 3 * 1e3
        if ms >= args.step_ms * 0.7 or batch >= args.max_batch:
            return batch, ms
        batch *= 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=512, help="model width")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="first batch tried by the calibration")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=100.0, help="aimed step time")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the repository goes (default: /dev/shm if present)")
    p.add_argument("--frozen", action="store_true",
                   help="fine-tune only the LayerNorms, the rest frozen (what dedup makes cheap to snapshot)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_training.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, args.heads, args.seq).cuda()
    if args.frozen:
        for name, prm in model.named_parameters():
            prm.requires_grad_("ln" in name)
    opt = torch.optim.AdamW([prm for prm in model.parameters() if prm.requires_grad], lr=1e-4)
    batch, ms = calibrate(model, opt, args)
    params = sum(p.numel() for p in model.parameters())
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6 * 3   # + 2 moments
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(dir=base, prefix="gpu-training-")
    print(f"GPT {params / 1e6:.1f}M params, batch {batch} x {args.seq}, step ~{ms:.0f} ms, snapshot ~{state_mb:.0f} MB "
          f"(model + AdamW) every step, on {torch.cuda.get_device_name()}; repository in {root}", flush=True)
    try:
        repo = ckptrepo.init(os.path.join(root, "repo"))
        policy = ckptrepo.RetentionPolicy(keep_last=2, grace_period_s=0.0, every_commits=4)
        plain, snapped, handles = [], [], []
        with repo.snapshotter(retention=policy) as snap:
            snap.attach(opt)
            timed_steps(model, opt, args, batch, snap, 0)   # warm-up: pinned pool, plans, views
            snap.wait(progress=False)
            for r in range(args.rounds):
                plain.append(statistics.median(timed_steps(model, opt, args, batch, None, 0)))
                snapped.append(statistics.median(timed_steps(model, opt, args, batch, snap, (r + 1) * 1000,
                                                             handles)))
                snap.wait(progress=False)
        a, b = statistics.median(plain), statistics.median(snapped)
        print(f"{'variant':22s} {'ms/iter':>8s}   rounds")
        print(f"{'no snapshot':22s} {a * 1e3:8.1f}   {' '.join(f'{x * 1e3:.1f}' for x in plain)}")
        print(f"{'snapshot every step':22s} {b * 1e3:8.1f}   {' '.join(f'{x * 1e3:.1f}' for x in snapped)}")
        print(f"slowdown per iteration: {(b / a - 1) * 100:+.1f}% (aim: <= 3%)")
        blocking = statistics.median(h.stats.blocking_s for h in handles) * 1e3
        capture = statistics.median(h.stats.capture_s for h in handles) * 1e3
        written = statistics.median(h.stats.bytes for h in handles) / 1e6
        print(f"per snapshot (median): the loop held {blocking:.1f} ms (snapshot() and the pre-step wait), "
              f"captured in {capture:.1f} ms, {written:.1f} MB written; every step needs "
              f"{written / a / 1e3:.2f} GB/s of writes")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
