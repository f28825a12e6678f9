"""Worker bodies for tests/distributed/test_megatron.py: Megatron-core ``dist_checkpointing`` over gloo.

Two states are saved and loaded through ``dist_checkpointing.save``/``load`` with ckptrepo's strategies:

- a hand-built sharded state dict (``ShardedTensor.from_rank_offsets``): ``w`` (fp32 8x6) and ``b`` (bf16
  4x10) split over the ranks, ``layers.fc.weight`` (2x4x6) stacked per layer on a prepended axis and split
  inside each layer, ``r`` replicated on every rank (``replica_id`` = rank), a per-rank ShardedObject
  holding a tensor, and common values (an int, a dict, a tensor). Every rank derives its boxes from the
  same global tensors (``GLOBALS``), so a load can check its boxes against them, bit for bit. The save
  splits one way (``ROWS``); the loads split another way on 2 ranks (``COLS``, rank order reversed) and
  take everything whole on 1 rank;
- a tiny megatron-core ``GPTModel`` with the local layer spec (no Transformer Engine) and tensor
  parallelism 2, saved from ``sharded_state_dict()``; one process (TP=1) loads it into a model of another
  seed and saves it again, so the parent compares the two versions.

A rank's traceback goes to ``error-<tag>-<rank>.txt`` in ``out_dir`` (see ``run_ranks``).
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch

from support.dtensor_workers import _guarded, _write_json

ROWS, COLS, WHOLE = "rows", "cols", "whole"
HAND_DIR, GPT_DIR = "hand/iter_0000007", "gpt"
COMMON = {"iteration": 7, "cfg": {"lr": 0.5, "name": "tiny"}, "t": torch.arange(4)}


def globals_() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(4, 10, generator=g).to(torch.bfloat16),
            "layers.fc.weight": torch.randn(2, 4, 6, generator=g), "r": torch.randn(5, generator=g)}


GLOBALS = globals_()


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")   # megatron-core warns that Transformer Engine and Apex are absent
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _part(t: torch.Tensor, axis: int, pos: int, parts: int) -> torch.Tensor:
    return t.chunk(parts, dim=axis)[pos].clone()


def hand_state(rank: int, world: int, split: str, empty: bool = False) -> dict[str, Any]:
    """The hand-built sharded state dict of ``rank``: the global values' boxes, or zeros to load into."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    w_axis, b_axis, s_axis = (0, 1, 1) if split == ROWS else (1, 0, 2)
    pos = rank if split == ROWS else world - 1 - rank

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    g = GLOBALS
    layers = [ShardedTensor.from_rank_offsets(
        "layers.fc.weight", fill(_part(g["layers.fc.weight"][lay], s_axis - 1, pos, world)),
        (0, lay, 2), (s_axis, pos, world), prepend_axis_num=1) for lay in range(2)]
    rng = {"state": torch.arange(3) + 10 * rank, "n": rank}
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("w", fill(_part(g["w"], w_axis, pos, world)),
                                                       (w_axis, pos, world)),
                  "b": ShardedTensor.from_rank_offsets("b", fill(_part(g["b"], b_axis, pos, world)),
                                                       (b_axis, pos, world)),
                  "layers": layers,
                  "r": ShardedTensor.from_rank_offsets("r", fill(g["r"].clone()), replica_id=rank)},
        "rng": ShardedObject("rng", None if empty else rng, (world,), (rank,), replica_id=0),
        **({} if empty else COMMON),
    }


def check_hand_loaded(loaded: dict[str, Any], rank: int, world: int, split: str) -> None:
    """The loaded values are the boxes of the global tensors this rank's split asks for, bit for bit."""
    expect = hand_state(rank, world, split)
    for key in ("w", "b", "r"):
        assert torch.equal(loaded["model"][key], expect["model"][key].data), key
        assert loaded["model"][key].dtype == expect["model"][key].data.dtype, key
    for lay in range(2):
        assert torch.equal(loaded["model"]["layers"][lay], expect["model"]["layers"][lay].data), lay


def gpt_model(tp: int, seed: int) -> Any:
    """A tiny GPTModel on the CPU with the local (Transformer-Engine-free) layer spec, tensor parallel ``tp``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)   # CPU initialisation draws the full weights, then keeps this rank's part
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=8)


def megatron_worker(rank: int, world: int, port: int, port1: int, url: str, gpt_url: str, out_dir: str) -> None:
    """``world`` ranks save and reload (``on_all_ranks``); then rank 0 alone, in a process group of one,
    loads on a world size of 1 (``on_one_rank``): megatron-core is imported once per process."""
    def body() -> None:
        _init(rank, world, port)
        on_all_ranks(rank, world, url, gpt_url, out_dir)
        import torch.distributed as dist
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.barrier()
        if rank == 0:   # the other ranks end here (_guarded ends their group)
            dist.destroy_process_group()
            _init(0, 1, port1)
            on_one_rank(url, gpt_url, out_dir)
    _guarded(f"w{world}", rank, out_dir, body)


def on_all_ranks(rank: int, world: int, url: str, gpt_url: str, out_dir: str) -> None:
    """Save the hand-built state (ROWS) and load it back split the other way (COLS); save a TP=``world``
    GPTModel."""
    from megatron.core import dist_checkpointing

    from ckptrepo.integrations.megatron import CkptRepoLoadCommonStrategy, CkptRepoSaveStrategy
    ckpt = os.path.join(out_dir, HAND_DIR)
    os.makedirs(ckpt, exist_ok=True)
    strategy = CkptRepoSaveStrategy(url, metrics={"loss": 1.5})
    dist_checkpointing.save(hand_state(rank, world, ROWS), ckpt, sharded_strategy=strategy)
    # the backend recorded in metadata.json finds the load strategy: no sharded strategy named here
    loaded = dist_checkpointing.load(hand_state(rank, world, COLS, empty=True), ckpt,
                                     common_strategy=CkptRepoLoadCommonStrategy())
    check_hand_loaded(loaded, rank, world, COLS)
    assert torch.equal(loaded["rng"]["state"], torch.arange(3) + 10 * rank) and loaded["rng"]["n"] == rank
    assert loaded["iteration"] == 7 and loaded["cfg"] == COMMON["cfg"] and torch.equal(loaded["t"], COMMON["t"])

    model = gpt_model(tp=world, seed=0)
    gpt = os.path.join(out_dir, GPT_DIR, "iter_0000003")
    os.makedirs(gpt, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), gpt, sharded_strategy=CkptRepoSaveStrategy(gpt_url))
    if rank == 0:
        _write_json(out_dir, "save.json", {"hand": strategy.last_version})


def on_one_rank(url: str, gpt_url: str, out_dir: str) -> None:
    """Load the hand-built state whole (both saved ranks' objects too); load the GPT into TP=1 and save it
    again; check what is refused: a save into something that is not a repository, a directory without a
    pointer, a flattened_range."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from ckptrepo.errors import CkptRepoError, SnapshotFailedError, UnsupportedValueError
    from ckptrepo.integrations.megatron import (
        CkptRepoLoadStrategy,
        CkptRepoSaveStrategy,
        _check_plain,
        read_pointer,
        step_from_dir,
    )
    ckpt = os.path.join(out_dir, HAND_DIR)
    state = hand_state(0, 1, ROWS, empty=True)
    state["rng"] = [ShardedObject("rng", None, (2,), (r,), replica_id=0) for r in range(2)]
    loaded = dist_checkpointing.load(state, ckpt, sharded_strategy=CkptRepoLoadStrategy())
    check_hand_loaded(loaded, 0, 1, ROWS)
    assert [o["n"] for o in loaded["rng"]] == [0, 1]
    assert loaded["iteration"] == 7   # Megatron's own common.pt, read by its default common strategy
    more_loads(ckpt)

    model = gpt_model(tp=1, seed=1)
    gpt = os.path.join(out_dir, GPT_DIR, "iter_0000003")
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), gpt))
    again = os.path.join(out_dir, GPT_DIR, "iter_0000004")
    os.makedirs(again, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), again, sharded_strategy=CkptRepoSaveStrategy(gpt_url))

    bad = os.path.join(out_dir, "bad")
    os.makedirs(bad, exist_ok=True)
    errors = {}
    try:
        dist_checkpointing.save(hand_state(0, 1, ROWS), bad,
                                sharded_strategy=CkptRepoSaveStrategy(os.path.join(out_dir, "no-repo")))
    except SnapshotFailedError as err:
        errors["save"] = str(err)
    try:
        read_pointer(bad)   # Megatron wrote no metadata.json there, and we no pointer
    except CkptRepoError as err:
        errors["pointer"] = str(err)
    flat = ShardedTensor.from_rank_offsets("x", torch.zeros(4))
    object.__setattr__(flat, "flattened_range", slice(0, 2))   # megatron-core 0.16 refuses to build one itself
    try:
        _check_plain(flat)
    except UnsupportedValueError as err:
        errors["flat"] = str(err)
    errors["steps"] = [step_from_dir(os.path.join(out_dir, "iter_0000100")), step_from_dir(out_dir)]
    errors["pickle_only"] = common_only_pickle_can_store(out_dir)
    _write_json(out_dir, "errors.json", errors)


def more_loads(ckpt: str) -> None:
    """Megatron's whole-tensor loader (load_tensors_metadata), and a load into another dtype (a cast)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    for key, value in GLOBALS.items():
        assert torch.equal(plain[key], value) and plain[key].dtype == value.dtype, key
    wide = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6, dtype=torch.float64))}
    loaded = dist_checkpointing.load(wide, ckpt)
    assert loaded["w"].dtype == torch.float64 and torch.equal(loaded["w"], GLOBALS["w"].double())


def common_only_pickle_can_store(out_dir: str) -> str:
    """A common state only pickle can store (Megatron-LM's ``args`` Namespace): the save still commits, the
    version keeps no common state, and loading it from the version says where it is instead."""
    import argparse

    from megatron.core import dist_checkpointing

    import ckptrepo
    from ckptrepo.errors import CkptRepoError
    from ckptrepo.integrations.megatron import CkptRepoLoadCommonStrategy, CkptRepoSaveStrategy
    url = os.path.join(out_dir, "repo-args")
    ckptrepo.init(url)
    ckpt = os.path.join(out_dir, "args", "iter_0000009")
    os.makedirs(ckpt)
    state = {**hand_state(0, 1, ROWS), "args": argparse.Namespace(lr=0.1)}
    strategy = CkptRepoSaveStrategy(url)
    dist_checkpointing.save(state, ckpt, sharded_strategy=strategy)
    saved = ckptrepo.open(url).load(strategy.last_version)
    assert "common" not in saved and torch.equal(saved["sharded"]["w"], GLOBALS["w"])
    try:
        CkptRepoLoadCommonStrategy().load_common(ckpt)
    except CkptRepoError as err:
        return str(err)
    return "no error"
