"""Worker bodies for tests/distributed/test_deepspeed.py: a tiny model trained by DeepSpeed on its CPU accelerator.

Each worker process joins a gloo group (``deepspeed.init_distributed``), and for each ZeRO stage asked for:
trains a few steps, ``save_checkpoint(tag)`` through the ckptrepo engine, trains on while recording the losses,
then builds a fresh engine, swaps the ckptrepo engine in, ``load_checkpoint(tag)`` and trains the same steps
again. The batches come from the step number alone, so both runs see the same data. Results go to
``out_dir/result-<world>-<rank>.json``; a traceback to ``error-<world>-<rank>.txt``.
"""
from __future__ import annotations

import json
import os
import traceback
from typing import Any

import torch

BEFORE, AFTER = 3, 3


def config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def make_engine(stage: int, seed: int = 0) -> Any:
    import deepspeed
    torch.manual_seed(seed)   # the fresh engine starts elsewhere: only the load brings it back
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    return engine


def train(engine: Any, first: int, steps: int, rank: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, rank)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run_stage(stage: int, url: str, save_dir: str, rank: int) -> dict[str, Any]:
    from ckptrepo.integrations.deepspeed import install, step_optimizers
    engine = make_engine(stage)
    ours = install(engine, url)
    attached = len(step_optimizers(engine.optimizer))
    train(engine, 0, BEFORE, rank)
    tag = f"stage{stage}"
    engine.save_checkpoint(save_dir, tag=tag, client_state={"note": "mine", "stage": stage})
    vid = ours.last_handle.id
    after = train(engine, BEFORE, AFTER, rank)
    ours.cleanup()

    fresh = make_engine(stage, seed=1)
    theirs = install(fresh, url)
    path, client = fresh.load_checkpoint(save_dir)   # no tag: the `latest` file DeepSpeed wrote names it
    resumed = train(fresh, BEFORE, AFTER, rank)
    theirs.cleanup()
    return {"vid": vid, "after": after, "resumed": resumed, "path": path, "attached": attached,
            "client": {k: client.get(k) for k in ("note", "stage")}, "global_steps": fresh.global_steps,
            "files": sorted(os.listdir(os.path.join(save_dir, tag)))}


def worker(rank: int, world: int, port: int, stages: list[int], url: str, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        torch.set_num_threads(1)
        import deepspeed
        import deepspeed.ops
        # gloo does the collectives here: skip DeepSpeed's shared-memory all-reduce for CPUs, which it would
        # otherwise compile on first use (minutes on a fresh 2-core machine, for a kernel these tests never need)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
        results = {s: run_stage(s, url, os.path.join(out_dir, f"ckpt-{world}"), rank) for s in stages}
        with open(os.path.join(out_dir, f"result-{world}-{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        with open(os.path.join(out_dir, f"error-{world}-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
