"""A 2-process Hugging Face ``Trainer`` run under DDP on the CPU (gloo), launched by torchrun from
tests/distributed/test_hf_ddp.py: ``train URL OUT`` trains with ``CkptRepoCallback`` snapshotting every step,
``resume URL OUT REV`` resumes a fresh model from ``checkpoint_folder(URL, REV)``. Rank 0 writes the logged
loss of each step to ``OUT/losses.json`` and the final weights to ``OUT/final.pt``.

Each rank reseeds its RNGs differently when training begins, so that the ranks' dropout masks differ and a
resume must restore each rank's own RNG states, not rank 0's on every rank."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the builders of integration/test_hf.py

import transformers  # noqa: E402
from integration.test_hf import BATCH, STEPS, Losses, dataset, tiny_model  # noqa: E402

from ckptrepo.integrations.hf import CkptRepoCallback, checkpoint_folder  # noqa: E402


class RankSeeds(transformers.TrainerCallback):
    """Different RNG states per rank from the start (Trainer seeds every rank alike)."""

    def on_train_begin(self, args, state, control, **kwargs):
        seed = 1000 + args.process_index
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def main(mode: str, url: str, out: str, rev: str | None = None) -> None:
    torch.set_num_threads(1)
    resume = checkpoint_folder(url, rev) if mode == "resume" else None   # every rank, before the group exists
    # two ranks of BATCH // 2 make one epoch of STEPS steps: step 10 is in its middle
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=STEPS, per_device_train_batch_size=BATCH // 2,
        logging_steps=1, save_strategy="no", report_to=[], seed=3, disable_tqdm=True, learning_rate=3e-3,
        warmup_steps=3, dataloader_num_workers=0, dataloader_pin_memory=False, use_cpu=True, ddp_backend="gloo")
    assert args.world_size == 2, args.world_size
    losses = Losses()
    callbacks: list = [losses, RankSeeds()]
    if mode == "train":
        callbacks.append(CkptRepoCallback(url, every_n_steps=1))
    model = tiny_model(seed=0 if mode == "train" else 99)   # a resume must bring the version's weights
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    if args.process_index == 0:
        Path(out, "losses.json").write_text(json.dumps(losses.by_step))
        torch.save(model.state_dict(), os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
