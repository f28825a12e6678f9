"""A 2-process Lightning DDP fit (``ddp_fork`` on the CPU, gloo) with ``CkptRepoIO``; run as a script by
tests/distributed/test_lightning_ddp.py. Rank 0 writes the final weights to ``OUT/final.pt`` so that the
test can compare them with the last checkpoint's."""
from __future__ import annotations

import sys

import torch


def main(url: str, ckpt_dir: str, out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckptrepo.integrations.lightning import CkptRepoIO

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def training_step(self, batch, _i):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.02)

    pl.seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy="ddp_fork", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, monitor="step", mode="max",
                                                    save_last=True)],
                         plugins=[CkptRepoIO(url)])
    model = Tiny()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/final.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
