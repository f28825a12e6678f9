"""A Megatron-core GPT saved with ``dist_checkpointing`` into a repository on 2 tensor-parallel ranks, loaded on 1.

    python examples/megatron_dist_ckpt.py --repo /tmp/megatron-repo --ckpts /tmp/megatron-ckpts

Two gloo processes (CPU) build a tiny ``GPTModel`` (local layer spec, no Transformer Engine) split with
tensor parallelism 2 and save its ``sharded_state_dict()`` as Megatron-LM does, into a per-iteration
directory, with ckptrepo's strategy: each rank writes only its own boxes, rank 0 commits one version.
Then one process builds the model unsplit with another seed and ``dist_checkpointing.load``s it from the
same directory: Megatron finds ckptrepo's load strategy from the directory's ``metadata.json``. The glue
is marked ``# <- ckptrepo``. (megatron-core 0.16's attention allocates its buffer on CUDA, so this CPU
example saves and loads without training.)
"""
from __future__ import annotations

import argparse
import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptrepo


def setup(rank: int, world: int, port: int, seed: int) -> torch.nn.Module:
    warnings.filterwarnings("ignore")   # megatron-core warns that Transformer Engine and Apex are absent
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                    max_sequence_length=16)


def save(rank: int, world: int, port: int, url: str, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from ckptrepo.integrations.megatron import CkptRepoSaveStrategy
    model = setup(rank, world, port, seed=0)
    strategy = CkptRepoSaveStrategy(url, metrics={"loss": 2.5})                              # <- ckptrepo
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=strategy)
    if rank == 0:
        print(f"saved on {world} ranks (TP={world}) as version {strategy.last_version[:12]}; {ckpt_dir} holds "
              f"{sorted(os.listdir(ckpt_dir))}")
    dist.destroy_process_group()


def load(rank: int, world: int, port: int, url: str, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    import ckptrepo.integrations.megatron  # noqa: F401  - registers the "ckptrepo" backend      # <- ckptrepo
    model = setup(rank, world, port, seed=1)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    saved = ckptrepo.open(url).load("@100")["sharded"]   # the whole tensors, no Megatron needed
    qkv = "decoder.layers.self_attention.linear_qkv.weight"   # layers stacked on a first axis
    same = torch.equal(model.decoder.layers[1].self_attention.linear_qkv.weight, saved[qkv][1])
    print(f"loaded on {world} rank (TP={world}); layer 1's fused QKV weight equals the saved one: {same}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="repository path or URL (created if missing)")
    parser.add_argument("--ckpts", required=True, help="directory of Megatron's per-iteration checkpoint folders")
    args = parser.parse_args()
    ckptrepo.init(args.repo, exist_ok=True)
    ckpt_dir = os.path.join(args.ckpts, "iter_0000100")   # Megatron-LM's naming: the version's step is 100
    os.makedirs(ckpt_dir, exist_ok=True)
    mp.spawn(save, args=(2, free_port(), args.repo, ckpt_dir), nprocs=2)
    mp.spawn(load, args=(1, free_port(), args.repo, ckpt_dir), nprocs=1)
    for v in ckptrepo.open(args.repo).log():
        print(f"version {v.id[:12]} step {v.step} {v.message!r} metrics {v.metrics}")


if __name__ == "__main__":
    main()
