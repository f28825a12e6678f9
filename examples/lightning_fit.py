"""Lightning with ckptrepo: ``Trainer(plugins=[CkptRepoIO(url)])``, top-k checkpoints, then a resume.

Run: ``python examples/lightning_fit.py [WORKDIR]`` (CPU, a few seconds; needs ``pip install "ckptrepo[lightning]"``).
Each checkpoint ModelCheckpoint saves becomes a version of WORKDIR/repo, tagged with its file name; the
files in WORKDIR/checkpoints are small pointers to those versions. ``ckptrepo --repo WORKDIR/repo log``
lists them, the pruned (removed from the top-k) ones included.
"""
from __future__ import annotations

import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ckptrepo
from ckptrepo.integrations.lightning import CkptRepoIO


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, _i: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=g)
    return DataLoader(TensorDataset(x[:448], y[:448]), batch_size=32), DataLoader(TensorDataset(x[448:], y[448:]),
                                                                                  batch_size=32)


def trainer(workdir: str, epochs: int) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[CkptRepoIO(f"{workdir}/repo")],                          # the one line ckptrepo needs
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=f"{workdir}/checkpoints", monitor="val_loss",
                                                save_top_k=2, save_last=True)])


def main(workdir: str) -> None:
    pl.seed_everything(0)
    trainer(workdir, epochs=4).fit(Regressor(), *data())
    repo = ckptrepo.open(f"{workdir}/repo")
    for v in repo.log():
        print(f"{v.id[:12]} step {v.step:>3}  {'pruned' if v.pruned else 'kept  '}  {', '.join(v.refs)}")
    # a fresh Trainer picks up where the last checkpoint left off (a path, a tag or "@STEP" work too)
    resumed = trainer(workdir, epochs=6)
    resumed.fit(Regressor(), *data(), ckpt_path="last")
    print(f"resumed to step {resumed.global_step}; best: {resumed.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckptrepo-lightning-"))
