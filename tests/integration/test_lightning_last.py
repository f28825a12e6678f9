"""``trainer.fit(model, ckpt_path="last")`` through ``CkptRepoIO``, with and without ``ModelCheckpoint(dirpath=)``.

Lightning resolves "last" to the newest ``last*.ckpt`` in each ``ModelCheckpoint``'s own folder, which
without ``dirpath`` is the new run's logger folder (``lightning_logs/version_N/checkpoints``): with Lightning's
own files the next run finds nothing there and trains from scratch with only a warning. The plugin keeps
that contract, and refuses a run that missed the repository's last checkpoint that way instead of letting
it train from scratch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from test_lightning import Tiny, loaders  # noqa: E402

from ckptrepo.errors import CkptRepoError  # noqa: E402
from ckptrepo.integrations.lightning import CkptRepoIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",   # Lightning's own
                                        "ignore::FutureWarning")


def _fit(root: Path, epochs: int, ckpt_path: str | None, **checkpoint: Any) -> tuple[Any, Tiny]:
    pl.seed_everything(7, verbose=False)
    model = Tiny()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", deterministic=True, default_root_dir=root,
                         enable_progress_bar=False, enable_model_summary=False,
                         logger=pl.loggers.CSVLogger(root), plugins=[CkptRepoIO(root / "ckpts.repo")],
                         callbacks=[pl.callbacks.ModelCheckpoint(save_top_k=2, monitor="val_loss", save_last=True,
                                                                 **checkpoint)])
    trainer.fit(model, *loaders(), ckpt_path=ckpt_path)
    return trainer, model


def test_last_with_a_dirpath_resumes_the_state_saved_last(tmp_path: Path) -> None:
    first, saved = _fit(tmp_path, 2, "last", dirpath=tmp_path / "ckpts")
    again, resumed = _fit(tmp_path, 2, "last", dirpath=tmp_path / "ckpts")   # max_epochs reached: no step
    assert again.global_step == first.global_step == 16
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), resumed.state_dict().values()))


def test_last_without_a_dirpath_is_refused_in_one_line_instead_of_training_from_scratch(tmp_path: Path) -> None:
    _, saved = _fit(tmp_path, 2, "last")
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    with pytest.raises(CkptRepoError) as e:
        _fit(tmp_path, 3, "last")
    message = str(e.value)
    assert "\n" not in message and f"{last} holds the last checkpoint" in message and "dirpath" in message
    _, resumed = _fit(tmp_path, 2, str(last))   # the path the error names resumes
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), resumed.state_dict().values()))
