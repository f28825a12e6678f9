"""What a Lightning checkpoint costs the training loop: CkptRepoIO versus TorchCheckpointIO and AsyncCheckpointIO.

One MLP (``--layers`` square layers of ``--width``, AdamW; about 200 MB of checkpoint at the default width:
67 MB of parameters and twice that of optimizer state) trains on random data under a Lightning Trainer;
``ModelCheckpoint(every_n_train_steps=--every, save_top_k=-1)`` saves through each plugin:

* ``none``      no checkpoint (the baseline)
* ``torch``     Lightning's default ``TorchCheckpointIO`` (``torch.save`` on the training thread)
* ``async``     Lightning's ``AsyncCheckpointIO`` (clones every tensor on the caller, ``torch.save`` in a thread)
* ``ckptrepo``  ``CkptRepoIO`` (a snapshot; capture overlaps the next forward/backward, whose step waits)

The modes alternate over ``--rounds`` rounds (a noisy machine drifts; alternating spreads the drift over every
mode). Reported per plugin, median over the rounds with the spread (min-max): the fit's wall time (every
checkpoint durable when ``fit`` returns: each plugin drains in ``teardown``) and its wall over the same
round's baseline per checkpoint; the time inside ``save_checkpoint``, the first of the fit apart (it pays
one-time costs) and the later ones as a mean; the step-after-save slowdown (each step that follows a save
minus the median of the other steps: ckptrepo's capture, and the optimizer step's wait for it, fall
there); and for ckptrepo what ``ckptrepo log --stats`` reports per version (``blocking``, ``lost``).

    python benchmarks/lightning_blocking.py --dir /tmp/lbench
    python benchmarks/lightning_blocking.py --accelerator gpu --dir /tmp/lbench
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

import ckptrepo
from ckptrepo.integrations.lightning import CkptRepoIO

MODES = ("none", "torch", "async", "ckptrepo")


class MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepClock(pl.Callback):
    """Each training batch's begin and end (Lightning runs ``ModelCheckpoint`` after every other callback, so
    a save falls between one batch's end and the next one's begin)."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.begin.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.end.append(time.perf_counter())


def step_after_save(clock: StepClock, every: int) -> float:
    """The mean, over the steps that follow a save, of their duration minus the median other step."""
    n = min(len(clock.begin), len(clock.end))
    durs = [clock.end[i] - clock.begin[i] for i in range(n)]
    after = {i for i in range(every, n, every)}
    others = [d for i, d in enumerate(durs) if i not in after and i > 0]
    slow = [durs[i] - statistics.median(others) for i in sorted(after)]
    return statistics.mean(slow) if slow else 0.0


def timed(io: Any, spent: list[float]) -> Any:
    save = io.save_checkpoint

    def wrapper(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        save(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
    io.save_checkpoint = wrapper
    return io


def run(mode: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    spent: list[float] = []
    handles: list[Any] = []
    plugins: list[Any] = []
    if mode == "torch":
        plugins = [timed(TorchCheckpointIO(), spent)]
    elif mode == "async":
        plugins = [timed(AsyncCheckpointIO(TorchCheckpointIO()), spent)]
    elif mode == "ckptrepo":
        io = CkptRepoIO(work / "repo", host_memory="1GiB")
        files_save = io.files.save
        io.files.save = lambda *a, **k: handles.append(files_save(*a, **k)) or handles[-1]
        plugins = [timed(io, spent)]
    clock = StepClock()
    callbacks: list[Any] = [clock]
    if mode != "none":
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=work / "ck", save_top_k=-1,
                                                      every_n_train_steps=args.every))
    pl.seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randn(args.steps * args.batch, args.width)), batch_size=args.batch)
    trainer = pl.Trainer(max_epochs=1, accelerator=args.accelerator, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=mode != "none", plugins=plugins,
                         callbacks=callbacks)
    model = MLP(args.width, args.layers)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - t0
    blocking = lost = float("nan")
    if handles:   # what log --stats prints for each version
        recorded = [ckptrepo.open(work / "repo").capture_stats(h.id) for h in handles]
        blocking = statistics.mean(s["blocking_s"] for s in recorded)
        lost = statistics.mean(s.get("lost_s", float("nan")) for s in recorded)
    shutil.rmtree(work, ignore_errors=True)
    if args.verbose:
        print(mode, "save_checkpoint s:", " ".join(f"{t:.3f}" for t in spent),
              "| blocking_s:", " ".join(f"{h.stats.blocking_s:.3f}" for h in handles))
    later = spent[1:] or [0.0]
    return {"wall": wall, "n": len(spent), "first": spent[0] if spent else 0.0, "later": sum(later) / len(later),
            "step_after": step_after_save(clock, args.every), "stats_blocking": blocking, "stats_lost": lost}


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/ckptrepo-lightning-bench")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="runs of every plugin, alternating")
    p.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu, or gpu for a CUDA state")
    p.add_argument("--verbose", action="store_true", help="print each checkpoint's times")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    base = Path(args.dir)
    run("none", args, base / "warm-up")   # imports, allocator, the first run of every kernel
    rounds = []
    for i in range(args.rounds):
        order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]   # each plugin first in some round
        rounds.append({m: run(m, args, base / m) for m in order})
    print(f"{args.accelerator}: {args.layers} x Linear({args.width}, {args.width}) + AdamW, {args.steps} steps, "
          f"a checkpoint every {args.every}; baseline fit {spread([r['none']['wall'] for r in rounds])} s; "
          f"{args.rounds} rounds: median (min-max)")
    print("| plugin | fit wall s | wall over baseline per ckpt s | first save s | later saves s (mean) |"
          " step after save s | log --stats blocking s | log --stats lost s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in MODES:
        rs = [r[m] for r in rounds]
        over = [(r[m]["wall"] - r["none"]["wall"]) / r[m]["n"] for r in rounds if r[m]["n"]]
        print(f"| {m} | {spread([r['wall'] for r in rs])} | {spread(over)} | {spread([r['first'] for r in rs])} |"
              f" {spread([r['later'] for r in rs])} | {spread([r['step_after'] for r in rs])} |"
              f" {spread([r['stats_blocking'] for r in rs])} | {spread([r['stats_lost'] for r in rs])} |")


if __name__ == "__main__":
    main()
