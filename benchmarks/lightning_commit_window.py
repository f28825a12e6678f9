"""How long a small Lightning checkpoint stays uncommitted: from ``save_checkpoint`` returning to its version
being committed (and to its pointer file being durable), under ``CkptRepoIO``.

A tiny MLP (8 -> 32 -> 1, AdamW) trains on random data on the CPU; ``ModelCheckpoint(every_n_train_steps=
--every, save_top_k=-1)`` saves through ``CkptRepoIO``. Per save (the first of the fit apart: it pays the
repository's creation): the milliseconds until the commit, and until the done callbacks ran (the pointer's
fsync, the release of what it replaced), as median, 90th percentile and maximum; and the most optimizer
steps the training loop took before a save's callbacks had run. A crash before the commit loses the
checkpoint; the second optimizer step after the save of a small state waits for its commit (not for the
callbacks). On a shared machine the figures are noisy: run it a few times.

    python benchmarks/lightning_commit_window.py --epochs 8 --every 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptrepo.integrations.lightning import CkptRepoIO


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


class Steps(pl.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, *_args: Any) -> None:
        self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--every", type=int, default=3, help="optimizer steps between checkpoints")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    work = Path(tempfile.mkdtemp(prefix="ckptrepo-window-"))
    io = CkptRepoIO(work / "repo")
    steps = Steps()
    rows: list[dict[str, float]] = []
    files_save = io.files.save

    def save(*args: Any, **kwargs: Any) -> Any:
        before = time.perf_counter()
        handle = files_save(*args, **kwargs)
        returned, at_step, row = time.perf_counter(), steps.count, {}
        rows.append(row)
        handle.add_done_callback(lambda h: row.update(
            commit_ms=(before + h.stats.total_s - returned) * 1000, done_ms=(time.perf_counter() - returned) * 1000,
            steps=steps.count - at_step))
        return handle
    io.files.save = save   # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    pl.seed_everything(7, verbose=False)
    trainer = pl.Trainer(max_epochs=opts.epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[io],
                         callbacks=[steps, pl.callbacks.ModelCheckpoint(dirpath=work / "ck", save_top_k=-1,
                                                                        every_n_train_steps=opts.every)])
    t0 = time.perf_counter()
    trainer.fit(Tiny(), data)
    fit_s = time.perf_counter() - t0

    def summary(key: str) -> dict[str, float]:
        values = sorted(r[key] for r in rows[1:])
        return {"median": round(statistics.median(values), 1), "p90": round(values[int(0.9 * len(values))], 1),
                "max": round(values[-1], 1)}
    print(json.dumps({"saves": len(rows) - 1, "commit_ms": summary("commit_ms"), "done_ms": summary("done_ms"),
                      "steps_until_done_max": max(r["steps"] for r in rows[1:]),
                      "step_ms": round(fit_s * 1000 / max(1, steps.count), 2)}))


if __name__ == "__main__":
    main()
