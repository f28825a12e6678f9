"""Train a tiny GPT with DeepSpeed (ZeRO) and checkpoint it into a ckptrepo through DeepSpeed's own API.

    deepspeed --num_gpus 2 examples/deepspeed_engine.py --repo /tmp/ds-repo --ckpt /tmp/ds-ckpt
    python examples/deepspeed_engine.py --repo /tmp/ds-repo --ckpt /tmp/ds-ckpt --zero 2        # one process
    python examples/deepspeed_engine.py --repo /tmp/ds-repo --ckpt /tmp/ds-ckpt --resume         # from `latest`

``install(engine, url)`` swaps ckptrepo's checkpoint engine in after ``deepspeed.initialize``; from then on
``engine.save_checkpoint(dir, tag)`` commits one version per tag (tagged with it: ``ckptrepo --repo /tmp/ds-repo
log`` lists them) and ``engine.load_checkpoint(dir)`` loads the tag DeepSpeed's ``latest`` file names. The
checkpoint directory holds only small stubs; the tensors are in the repository. Runs on CPU (DeepSpeed's CPU
accelerator, gloo) as well as on GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import GPTConfig, TinyGPT  # noqa: E402


def batch(step: int, rank: int, cfg: GPTConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens for a step whenever it runs, so a resumed run sees the data the first one did."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True, help="the repository (created if absent)")
    ap.add_argument("--ckpt", required=True, help="DeepSpeed's checkpoint directory (stubs and `latest`)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--zero", type=int, default=1, help="ZeRO stage (0-3)")
    ap.add_argument("--resume", action="store_true", help="load the tag `latest` names first")
    ap.add_argument("--local_rank", type=int, default=-1)   # passed by the deepspeed launcher
    args = ap.parse_args()

    import deepspeed

    from ckptrepo.integrations.deepspeed import install
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)   # a plain `python` run is a world of one
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, dropout=0.0)
    model = TinyGPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
              "zero_optimization": {"stage": args.zero}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ckpt = install(engine, args.repo)          # the one line ckptrepo adds
    if args.resume:
        path, _client = engine.load_checkpoint(args.ckpt)
        print(f"resumed from {path} at step {engine.global_steps}")
    rank = torch.distributed.get_rank()
    while engine.global_steps < args.steps:
        x, y = batch(engine.global_steps, rank, cfg, engine.device)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {engine.global_steps:3d}  loss {loss.item():.4f}")
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, tag=f"global_step{engine.global_steps}")   # returns at once
    ckpt.cleanup()   # wait for the last snapshots


if __name__ == "__main__":
    main()
