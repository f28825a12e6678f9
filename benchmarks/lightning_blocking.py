"""What a Lightning checkpoint costs the training loop: CkptRepoIO versus TorchCheckpointIO and AsyncCheckpointIO.

One MLP (``--width`` square layers, AdamW; about 200 MB of checkpoint at the default width: 67 MB of
parameters and twice that of optimizer state) trains on random data on the CPU under a Lightning
Trainer; ``ModelCheckpoint(every_n_train_steps=--every, save_top_k=-1)`` saves through each plugin:

* ``none``      no checkpoint (the baseline)
* ``torch``     Lightning's default ``TorchCheckpointIO`` (``torch.save`` on the training thread)
* ``async``     Lightning's ``AsyncCheckpointIO`` (clones every tensor on the caller, ``torch.save`` in a thread)
* ``ckptrepo``  ``CkptRepoIO`` (a snapshot; capture overlaps the next forward/backward, whose step waits)

Reported per plugin: the time inside ``save_checkpoint``, the first checkpoint of the fit apart (it pays
one-time costs: for ckptrepo the repository and staging pool, and a wait for its own capture before any
optimizer is attached) and the later ones as a mean; for ckptrepo also the optimizer step's waits for
capture; and the fit's wall time over the baseline per checkpoint (every checkpoint durable when ``fit``
returns: each plugin drains in ``teardown``). On a shared machine the wall figures are the noisiest.

    python benchmarks/lightning_blocking.py --dir /tmp/lbench
"""
from __future__ import annotations

import argparse
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from ckptrepo.integrations.lightning import CkptRepoIO


class MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


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
    callbacks = [] if mode == "none" else [pl.callbacks.ModelCheckpoint(dirpath=work / "ck", save_top_k=-1,
                                                                          every_n_train_steps=args.every)]
    pl.seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randn(args.steps * args.batch, args.width)), batch_size=args.batch)
    trainer = pl.Trainer(max_epochs=1, accelerator=args.accelerator, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=mode != "none", plugins=plugins,
                         callbacks=callbacks)
    model = MLP(args.width, args.layers)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    if args.verbose:
        print(mode, "save_checkpoint s:", " ".join(f"{t:.3f}" for t in spent),
              "| blocking_s:", " ".join(f"{h.stats.blocking_s:.3f}" for h in handles))
    later = spent[1:] or [0.0]
    # a handle's blocking_s: its snapshot() call, plus the step waits for capture while it was the newest in
    # flight; save_checkpoint's time after the first is that call (the first also waits for its own capture)
    waits = sum(max(0.0, h.stats.blocking_s - s) for h, s in zip(handles[1:], spent[1:]))
    return {"wall": wall, "n": len(spent), "first": spent[0] if spent else 0.0, "later": sum(later) / len(later),
            "step_wait": waits / max(1, len(later))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/ckptrepo-lightning-bench")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu, or gpu for a CUDA state")
    p.add_argument("--verbose", action="store_true", help="print each checkpoint's times")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = Path(args.dir)
    results = {m: run(m, args, base / m) for m in ("none", "torch", "async", "ckptrepo", "none")}
    baseline = results["none"]["wall"]
    print(f"{args.accelerator}: {args.layers} x Linear({args.width}, {args.width}) + AdamW, {args.steps} steps, "
          f"a checkpoint every {args.every}; baseline fit {baseline:.2f} s")
    print("| plugin | checkpoints | first save s | later saves s (mean) | step waits s per later save |"
          " wall over baseline per ckpt s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in ("torch", "async", "ckptrepo"):
        r = results[m]
        print(f"| {m} | {r['n']} | {r['first']:.3f} | {r['later']:.3f} | {r['step_wait']:.3f} | "
              f"{(r['wall'] - baseline) / max(1, r['n']):.3f} |")

if __name__ == "__main__":
    main()
