"""What checkpointing costs a Hugging Face Trainer: ckptrepo's callback versus the Trainer's own save_steps.

A random-init GPT-2 (4 layers of width ``--width``; at 256 about 5.6 M parameters, a 68 MiB state with
AdamW's moments) trains on random tokens, the same run (same seed, same batches) once per mode, all in one
process, the modes alternating over ``--rounds`` rounds (a noisy machine drifts; alternating spreads the
drift over every mode):

* ``none``      no checkpoint (the baseline)
* ``hf``        ``save_strategy="steps", save_steps=EVERY``: Trainer._save_checkpoint writes
                model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth and trainer_state.json
                into a new checkpoint-N folder, in the loop (no fsync)
* ``ckptrepo``  ``CkptRepoCallback(every_n_steps=EVERY)``: the snapshot is taken in the callback and
                written in the background; the next optimizer step waits for its capture only

Reported per mode, median over the rounds with the spread (min-max): the wall time of ``trainer.train()``
(for ckptrepo including the wait at train end until every version is committed and durable); wall over
the baseline per checkpoint (each round's run against the same round's baseline); the time the loop was
held between a save step's end and the next step's begin, over the median such gap (HF saves there); the
step-after-save slowdown (the duration of each step that follows a save minus the median of the other
steps; ckptrepo's capture runs then, and the optimizer step waits for it); and for ckptrepo what
``ckptrepo log --stats`` reports per version (``blocking``, ``lost``).

    python benchmarks/hf_trainer.py                                 # 60 steps, a checkpoint every 10, 3 rounds
    python benchmarks/hf_trainer.py --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_common import report  # noqa: E402

import ckptrepo  # noqa: E402
from ckptrepo.integrations.hf import CkptRepoCallback  # noqa: E402

SEQ = 128
MODES = ("none", "hf", "ckptrepo")


def model(width: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=width, n_head=8, vocab_size=8192, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class StepClock(transformers.TrainerCallback):
    """Each optimizer step's begin and end time (added first, so its on_step_end runs before a save)."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin.append(time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end.append(time.perf_counter())


def step_figures(clock: StepClock, every: int) -> tuple[float, float]:
    """(gap after a save over the median other gap, step after a save over the median other step), means."""
    n = min(len(clock.begin), len(clock.end))
    durs = [clock.end[i] - clock.begin[i] for i in range(n)]
    gaps = {i: clock.begin[i + 1] - clock.end[i] for i in range(n - 1)}   # after step i+1 (1-based) ended
    saved = {i for i in range(n) if (i + 1) % every == 0}
    after = [i + 1 for i in saved if i + 1 < n]
    other_durs = [d for i, d in enumerate(durs) if i not in after and i > 0]
    other_gaps = [g for i, g in gaps.items() if i not in saved]
    held = [gaps[i] - statistics.median(other_gaps) for i in saved if i in gaps]
    slow = [durs[i] - statistics.median(other_durs) for i in after]
    return (statistics.mean(held) if held else 0.0), (statistics.mean(slow) if slow else 0.0)


def run(mode: str, a: argparse.Namespace, work: str) -> dict[str, Any]:
    out = os.path.join(work, mode)
    repo_path = os.path.join(work, "repo")
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch, logging_steps=a.every,
        report_to=[], seed=0, use_cpu=a.device == "cpu", disable_tqdm=True, dataloader_pin_memory=False,
        log_level="error", save_strategy="steps" if mode == "hf" else "no", save_steps=a.every)
    clock = StepClock()
    callbacks: list[Any] = [clock]
    cb = None
    if mode == "ckptrepo":
        cb = CkptRepoCallback(repo_path, every_n_steps=a.every, save_final=False)
        callbacks.append(cb)
    trainer = transformers.Trainer(model=model(a.width), args=args, train_dataset=dataset(a.steps * a.batch),
                                   callbacks=callbacks)
    saves = 0
    if mode == "hf":
        save = trainer._save_checkpoint

        def counted(*args_: Any, **kw: Any) -> None:
            nonlocal saves
            saves += 1
            save(*args_, **kw)
        trainer._save_checkpoint = counted  # type: ignore[method-assign]
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    held, slow = step_figures(clock, a.every)
    blocking = lost = float("nan")
    if cb is not None:
        saves = len(cb.handles)
        recorded = [ckptrepo.open(repo_path).capture_stats(h.id) for h in cb.handles]   # what log --stats prints
        blocking = statistics.mean(s["blocking_s"] for s in recorded)
        lost = statistics.mean(s.get("lost_s", float("nan")) for s in recorded)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(repo_path, ignore_errors=True)
    return {"mode": mode, "wall_s": wall, "checkpoints": saves, "held_s": held, "step_after_s": slow,
            "stats_blocking_s": blocking, "stats_lost_s": lost}


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def table(summary: dict[str, Any]) -> None:
    print(f"{summary['steps']} steps, a checkpoint every {summary['every']}, {summary['params_m']:.1f} M params, "
          f"{summary['device']}, torch threads {summary['threads']}, {summary['rounds']} rounds: "
          f"median (min-max)")
    print("| mode | fit wall s | wall over baseline per ckpt s | held after save s | step after save s |"
          " log --stats blocking s | log --stats lost s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rounds = summary["runs"]
    for m in MODES:
        rs = [r[m] for r in rounds]
        over = [(r[m]["wall_s"] - r["none"]["wall_s"]) / r[m]["checkpoints"] for r in rounds
                if r[m]["checkpoints"]]
        print(f"| {m} | {spread([r['wall_s'] for r in rs])} | {spread(over)} | {spread([r['held_s'] for r in rs])} |"
              f" {spread([r['step_after_s'] for r in rs])} | {spread([r['stats_blocking_s'] for r in rs])} |"
              f" {spread([r['stats_lost_s'] for r in rs])} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--width", type=int, default=256, help="GPT-2's n_embd (4 layers)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every mode, alternating")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(dir=a.dir, prefix="hf-bench-")
    rounds: list[dict[str, Any]] = []
    try:
        run("none", a, work)   # warm-up: imports, allocator, the first compile of every kernel
        for i in range(a.rounds):
            order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]   # each mode first in some round
            rounds.append({m: run(m, a, work) for m in order})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"steps": a.steps, "every": a.every, "threads": torch.get_num_threads(), "device": a.device,
               "params_m": sum(p.numel() for p in model(a.width).parameters()) / 1e6, "rounds": a.rounds,
               "runs": rounds}
    return report(summary, table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
