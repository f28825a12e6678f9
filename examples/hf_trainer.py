"""Train a tiny random-init GPT-2 with the Hugging Face Trainer on CPU, snapshotting into a ckptrepo.

    python examples/hf_trainer.py --repo /tmp/hf-repo --steps 40
    python examples/hf_trainer.py --repo /tmp/hf-repo --steps 40 --resume @20
    ckptrepo --repo /tmp/hf-repo export HEAD /tmp/hf-model --format hf

The first run trains ``--steps`` steps with ``CkptRepoCallback`` taking a
snapshot every ``--every`` steps (model, optimizer, scheduler, RNG states,
TrainerState; the logged loss as the version's metrics). ``--resume REV`` starts
a fresh Trainer from that version through ``checkpoint_folder``: its losses are
bit for bit those of the first run from that step on (printed side by side when
the first run's losses are in the repository). The export is a folder
``AutoModelForCausalLM.from_pretrained`` loads. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import ckptrepo  # noqa: E402
from ckptrepo.integrations.hf import CkptRepoCallback, checkpoint_folder  # noqa: E402


class PrintLoss(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--resume", default=None, help="a revision to resume from (e.g. @20)")
    a = ap.parse_args()
    torch.set_num_threads(1)   # a tiny model: one thread is fastest, and the same in both runs

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (a.steps * 4, 32), generator=g)
    data = [{"input_ids": t, "labels": t.clone()} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(a.repo + "-trainer"), max_steps=a.steps, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        learning_rate=1e-3, log_level="error")
    losses = PrintLoss()
    callbacks: list[transformers.TrainerCallback] = [losses]
    resume = None
    if a.resume is None:
        callbacks.append(CkptRepoCallback(a.repo, every_n_steps=a.every))
    else:
        resume = checkpoint_folder(a.repo, a.resume)
        print(f"resuming from {resume}")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)

    repo = ckptrepo.open(a.repo)
    if a.resume is None:
        print(f"{len(repo.log())} versions in {a.repo}; last: step {repo.version().step}, "
              f"loss {repo.version().metrics.get('loss')}")
        return
    recorded = {v.step: v.metrics.get("loss") for v in repo.log()}
    for step, loss in sorted(losses.losses.items()):
        if step in recorded:
            same = "same" if recorded[step] == loss else "DIFFERENT"
            print(f"step {step}: loss {loss!r}, first run {recorded[step]!r} ({same})")


if __name__ == "__main__":
    main()
