"""What checkpointing costs a Hugging Face Trainer: ckptrepo's callback versus the Trainer's own save_steps.

A random-init GPT-2 (about 17 M parameters: 67 MB of weights, 200 MB with
AdamW's moments) trains on random tokens on the CPU, the same run (same seed,
same batches) once per mode, all in one process:

* ``none``      no checkpoint (the baseline; run first and again at the end, the faster counts)
* ``hf``        ``save_strategy="steps", save_steps=EVERY``: Trainer._save_checkpoint writes
                model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth and trainer_state.json
                into a new checkpoint-N folder, in the loop (no fsync)
* ``ckptrepo``  ``CkptRepoCallback(every_n_steps=EVERY)``: the snapshot is taken in the callback and
                written in the background; the next optimizer step waits for its capture only

Reported per mode: wall time of ``trainer.train()`` (for ckptrepo including the wait at train end until
every version is committed and durable); overhead/ckpt = (wall - baseline wall) / checkpoints;
blocking/ckpt = the time the training thread was held per checkpoint: the whole of
``Trainer._save_checkpoint`` for hf (timed by wrapping it), ``SnapshotHandle.stats.blocking_s`` (the
snapshot call plus the optimizer pre-step wait) for ckptrepo.

    python benchmarks/hf_trainer.py                       # 40 steps, a checkpoint every 10
    python benchmarks/hf_trainer.py --steps 60 --every 5 --json out.json
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

from ckptrepo.integrations.hf import CkptRepoCallback  # noqa: E402

SEQ = 128


def model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def run(mode: str, steps: int, every: int, batch: int, work: str, device: str) -> dict[str, Any]:
    out = os.path.join(work, mode)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, logging_steps=every, report_to=[],
        seed=0, use_cpu=device == "cpu", disable_tqdm=True, dataloader_pin_memory=False, log_level="error",
        save_strategy="steps" if mode == "hf" else "no", save_steps=every)
    callbacks = []
    cb = None
    if mode == "ckptrepo":
        cb = CkptRepoCallback(os.path.join(work, "repo"), every_n_steps=every, save_final=False)
        callbacks.append(cb)
    trainer = transformers.Trainer(model=model(), args=args, train_dataset=dataset(steps * batch),
                                   callbacks=callbacks)
    saves: list[float] = []
    if mode == "hf":
        save = trainer._save_checkpoint

        def timed(*a: Any, **kw: Any) -> None:
            t = time.perf_counter()
            save(*a, **kw)
            saves.append(time.perf_counter() - t)
        trainer._save_checkpoint = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if cb is not None:
        saves = [h.stats.blocking_s for h in cb.handles]
        size = sum(h.stats.bytes for h in cb.handles) / max(1, len(cb.handles))
        durable = statistics.median(h.stats.total_s for h in cb.handles)
    else:
        size = durable = float("nan")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(os.path.join(work, "repo"), ignore_errors=True)
    return {"mode": mode, "wall_s": wall, "checkpoints": len(saves),
            "blocking_s": statistics.median(saves) if saves else 0.0, "bytes": size, "durable_s": durable}


def table(summary: dict[str, Any]) -> None:
    base = summary["baseline_wall_s"]
    print(f"{summary['steps']} steps, a checkpoint every {summary['every']}, {summary['params_m']:.1f} M params, "
          f"{summary['device']}, torch threads {summary['threads']}")
    print(f"{'mode':10} {'wall s':>8} {'ckpts':>5} {'overhead/ckpt s':>16} {'blocking/ckpt s':>16} "
          f"{'durable s':>10}")
    for r in summary["runs"]:
        over = (r["wall_s"] - base) / r["checkpoints"] if r["checkpoints"] else 0.0
        print(f"{r['mode']:10} {r['wall_s']:8.2f} {r['checkpoints']:5d} {over:16.3f} {r['blocking_s']:16.3f} "
              f"{r['durable_s']:10.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(dir=a.dir, prefix="hf-bench-")
    try:
        runs = [run(m, a.steps, a.every, a.batch, work, a.device) for m in ("none", "hf", "ckptrepo", "none")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"steps": a.steps, "every": a.every, "threads": torch.get_num_threads(), "device": a.device,
               "params_m": sum(p.numel() for p in model().parameters()) / 1e6,
               "baseline_wall_s": min(r["wall_s"] for r in runs if r["mode"] == "none"),
               "runs": runs}
    return report(summary, table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
