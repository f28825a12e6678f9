"""Lightning fits with ``CkptRepoIO`` in a process of their own; run as a script by tests/distributed/
test_lightning_ddp.py and tests/integration/test_lightning.py:

    python tests/support/lightning_ddp_run.py STRATEGY URL CKPT_DIR OUT

``ddp_fork`` / ``ddp_spawn``: a 2-process DDP fit on the CPU (gloo); rank 0 writes the final weights to
``OUT/final.pt`` so that the test can compare them with the last checkpoint's. ``kill``: one process that
saves every 5 steps and kills itself with SIGKILL 4 steps after its third save.
"""
from __future__ import annotations

import os
import signal
import sys

import lightning.pytorch as pl
import torch

KILL_AFTER_STEPS = 4


class Tiny(pl.LightningModule):   # at module level: ddp_spawn pickles it into each process
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


class Kill(pl.Callback):
    """SIGKILL, ``KILL_AFTER_STEPS`` optimizer steps after the third save: nothing is flushed or closed."""

    def __init__(self) -> None:
        self.saved_at: list[int] = []

    def on_save_checkpoint(self, trainer, _module, _checkpoint) -> None:
        self.saved_at.append(trainer.global_step)

    def on_train_batch_end(self, trainer, *_args) -> None:
        if len(self.saved_at) >= 3 and trainer.global_step >= self.saved_at[2] + KILL_AFTER_STEPS:
            os.kill(os.getpid(), signal.SIGKILL)


def main(strategy: str, url: str, ckpt_dir: str, out: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckptrepo.integrations.lightning import CkptRepoIO

    pl.seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    if strategy == "kill":
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1), Kill()]
        trainer = pl.Trainer(max_epochs=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=callbacks, plugins=[CkptRepoIO(url)])
    else:
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, monitor="step", mode="max",
                                                        save_last=True)],
                             plugins=[CkptRepoIO(url)])
    model = Tiny()
    trainer.fit(model, data)
    if trainer.is_global_zero:   # under ddp_spawn, the main process: its model holds the weights handed back
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/final.pt")


if __name__ == "__main__":
    main(*sys.argv[1:5])
