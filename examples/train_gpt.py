"""Train a tiny GPT on CPU, snapshotting the full training state into a ckptrepo every step.

    python examples/train_gpt.py --repo /tmp/gpt-repo --steps 40
    python examples/train_gpt.py --repo /tmp/gpt-repo --steps 40 --resume @10

Each snapshot holds the model, the AdamW optimizer, the LR scheduler, all three
RNGs (torch, Python ``random``, a numpy Generator) and the step. Dropout uses
the torch RNG, batch offsets come from the numpy Generator, and a little input
noise comes from Python's ``random``, so an exact resume needs every one of them.

``--resume REV`` loads REV in place and goes on training up to ``--steps``. A
branch name continues on that branch (``ckptrepo checkout @10 -b retry``, then
``--resume retry``); any other revision rolls back: a new branch
``resume-<step>`` is created at it, and the original branch keeps all its
versions. Resumed losses are bit-for-bit those of the original run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import GPTConfig, TinyGPT  # noqa: E402

import ckptrepo  # noqa: E402

SEED = 1234


def corpus() -> str:
    """A deterministic char-level corpus with learnable structure (no downloads)."""
    animals = ["cat", "dog", "fox", "owl", "bee", "yak", "elk", "ant"]
    verbs = ["sees", "chases", "likes", "greets", "follows"]
    lines = []
    for i in range(120):
        a, b = animals[(7 * i) % len(animals)], animals[(3 * i + 1) % len(animals)]
        v = verbs[(i * i) % len(verbs)]
        lines.append(f"the {a} {v} the {b} {i % 10} times.")
    return "\n".join(lines) + "\n"


class CharData:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, np_rng: np.random.Generator, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows (numpy Generator) with one corrupted input token per batch (Python random)."""
        starts = np_rng.integers(0, len(self.data) - block_size - 1, size=batch_size)
        x = torch.stack([self.data[s:s + block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + 1 + block_size] for s in starts.tolist()])
        x = x.clone()
        x[random.randrange(batch_size), random.randrange(block_size)] = random.randrange(self.vocab_size)
        return x, y


def lr_lambda(step: int, warmup: int = 5, total: int = 200) -> float:
    """Linear warmup then cosine decay to 10% (a plain function: LambdaLR's state_dict stores None for it)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def build(args: argparse.Namespace):
    torch.manual_seed(SEED)
    random.seed(SEED)
    np_rng = np.random.default_rng(SEED)
    data = CharData(corpus())
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=2, n_head=4,
                    n_embd=args.n_embd, dropout=0.1)
    model = TinyGPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return data, model, opt, sched, np_rng


def make_state(model, opt, sched, np_rng, step: int) -> dict:
    """The training state that is snapshotted (RNG states captured now)."""
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np_rng},
        "step": step,
    }


def unique_branch(repo: ckptrepo.Repository, base: str) -> str:
    existing = repo.branches()
    name, n = base, 1
    while name in existing:
        n += 1
        name = f"{base}-{n}"
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="repository URL or path (created if missing)")
    p.add_argument("--steps", type=int, default=40, help="train until this step (inclusive)")
    p.add_argument("--resume", metavar="REV", help="continue on branch REV, or roll back to revision REV on a new "
                                                   "branch, and train from there")
    p.add_argument("--losses-out", metavar="FILE", help="write {step: float.hex(loss)} of the steps run here as JSON")
    p.add_argument("--async", dest="async_", action="store_true",
                   help="snapshot through the asynchronous hook (repo.snapshotter) instead of synchronously")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed, so reductions repeat)")
    p.add_argument("--deterministic", action="store_true",
                   help="also call torch.use_deterministic_algorithms(True) (costs ~1.5 s of imports; the CPU "
                        "kernels used here are deterministic at a fixed thread count anyway)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)

    data, model, opt, sched, np_rng = build(args)
    repo = ckptrepo.init(args.repo, exist_ok=True)
    step = 0
    if args.resume:
        if args.resume in repo.branches():   # a branch: continue on it, as `git checkout BRANCH` does
            branch, how = args.resume, "branch"
            v = repo.checkout(branch)
        else:                                # any other revision: roll back onto a new branch there
            target = repo.version(args.resume)
            branch, how = unique_branch(repo, f"resume-{target.step}"), "new branch"
            v = repo.checkout(target.id, branch=branch)
        state = repo.load(v.id, into=make_state(model, opt, sched, np_rng, 0))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])  # the numpy Generator was restored in place
        step = state["step"]
        print(f"resumed from {v.short_id} (step {step}) on {how} {branch!r}", flush=True)

    losses: dict[str, str] = {}
    snap = None
    if args.async_:
        snap = repo.snapshotter()
        snap.attach(opt)  # opt.step() waits until the previous snapshot is captured; never for storage
    model.train()
    t0 = time.perf_counter()
    while step < args.steps:
        step += 1
        x, y = data.batch(np_rng, args.batch_size, args.block_size)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        value = loss.item()
        save = snap.snapshot if snap is not None else repo.snapshot
        v = save(make_state(model, opt, sched, np_rng, step), step=step,
                 message=f"step {step}", metrics={"loss": value, "lr": lr})
        losses[str(step)] = float.hex(value)
        print(f"step {step:4d}  loss {value:.6f}  lr {lr:.2e}  version {v.id[:12]}", flush=True)
    if snap is not None:
        snap.close()  # waits until every snapshot is committed
    print(f"done: {len(losses)} steps in {time.perf_counter() - t0:.2f}s on branch {repo.current_branch()!r}",
          flush=True)

    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(losses, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
