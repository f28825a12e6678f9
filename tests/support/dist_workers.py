"""Worker bodies of the distributed snapshot tests (module level, so they pickle to worker processes).

Each runs inside one rank of a gloo process group started by
``megatron_ref.launch`` (or the kill test's own launcher).
"""
from __future__ import annotations

import os
from typing import Any

import torch

import ckptrepo
from ckptrepo import faults
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.rules import Replicated, Rules, Split, megatron_gpt
from support.megatron_ref import GPTConfig, Trainer, global_shapes, init_full_params, shard_full


def with_rules(cfg: GPTConfig, layout: ParallelLayout) -> ParallelLayout:
    """The layout with the reference model's rules; under ZeRO-3 they list the parameter shapes, as they must."""
    rules = megatron_gpt(cfg.layers, cfg.vocab_size, cfg.make_vocab_size_divisible_by,
                         param_shapes=global_shapes(cfg) if layout.zero == 3 else None)
    return ParallelLayout(layout.tp, layout.pp, layout.dp, layout.zero, rules)


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    return state


def train_and_snapshot(rank: int, layout: ParallelLayout, url: str, cfg: GPTConfig, before: int,
                       after: int) -> dict[str, Any]:
    """Train ``before`` steps, snapshot asynchronously, train ``after`` more while it is written.

    Returns the version id, a copy of the state at the snapshot (what the
    version must hold, although training went on mutating it in place) and the
    losses of the continuation under this unchanged layout.
    """
    state = shard_full(cfg, layout, rank, init_full_params(cfg))
    trainer = Trainer(cfg, layout, rank, state)
    for i in range(before):
        trainer.step(i)
    repo = ckptrepo.open(url)
    with repo.snapshotter(parallel_layout=with_rules(cfg, layout), host_memory=1 << 20) as snap:
        handle = snap.snapshot(state, step=before)
        saved = _clone(state)
        snap.wait_captured()
        losses = [trainer.step(i) for i in range(before, before + after)]
        snap.wait()
    return {"vid": handle.result().id, "saved": saved, "losses": losses}


def resume(rank: int, layout: ParallelLayout, url: str, cfg: GPTConfig, vid: str, steps: int,
           use_into: bool) -> list[float]:
    """Load version ``vid`` into this layout (built by ckptrepo, or into a state built here) and train on."""
    lay = with_rules(cfg, layout)
    if use_into:
        state = shard_full(cfg, layout, rank, {k: torch.zeros_like(v) for k, v in init_full_params(cfg).items()})
        ckptrepo.load(url, vid, parallel_layout=lay, into=state)
    else:
        state = ckptrepo.load(url, vid, parallel_layout=lay)
    start = state["optimizer"]["step"]
    trainer = Trainer(cfg, layout, rank, state)
    return [trainer.step(i) for i in range(start, start + steps)]


def snapshot_and_die(rank: int, layout: ParallelLayout, url: str, cfg: GPTConfig, victim: int,
                     queue: Any, point: str = "after_shard_write") -> None:
    """Snapshot once (committed), then again with rank ``victim`` killed at fault point ``point`` (by
    default after its first shard write)."""
    state = shard_full(cfg, layout, rank, init_full_params(cfg))
    repo = ckptrepo.open(url)
    lay = with_rules(cfg, layout)
    first = repo.snapshot(state, step=1, parallel_layout=lay)
    if rank == victim:
        faults.set_hook(point, lambda _name: os._exit(17))
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    snap = repo.snapshotter(parallel_layout=lay, host_memory=1 << 20, commit_timeout_s=8.0)
    snap.snapshot(state, step=2)
    try:
        snap.wait()
        queue.put((rank, first.id, "committed"))
    except ckptrepo.CkptRepoError as err:
        queue.put((rank, first.id, str(err)))
    finally:
        try:
            snap.close()
        except ckptrepo.CkptRepoError:
            pass


SPLIT_RULES = Rules([("col.weight", Split(0)), ("row.weight", Split(1)), ("norm.weight", Replicated())])


def split_state(seed: int) -> dict[str, torch.Tensor]:
    """Full tensors: a column-parallel and a row-parallel weight (8 MiB each, fp32) and a replicated norm."""
    g = torch.Generator().manual_seed(seed)
    return {"col.weight": torch.randn(8192, 256, generator=g), "row.weight": torch.randn(256, 8192, generator=g),
            "norm.weight": torch.randn(256, generator=g)}


def snapshot_split_state(rank: int, layout: ParallelLayout, url: str, seed: int) -> str:
    """Snapshot this tensor-parallel rank's slices of ``split_state(seed)`` (SPLIT_RULES); return the version id."""
    dims = {"col.weight": 0, "row.weight": 1}
    full = split_state(seed)
    local = {n: t.chunk(layout.tp, dim=dims[n])[rank].clone() if n in dims else t for n, t in full.items()}
    lay = ParallelLayout(layout.tp, layout.pp, layout.dp, layout.zero, SPLIT_RULES)
    return ckptrepo.open(url).snapshot({"model": local}, step=1, parallel_layout=lay).id


def snapshot_without_the_split_rule(rank: int, layout: ParallelLayout, url: str, zero: int) -> str:
    """This tensor-parallel rank's shards of ``split_state(0)`` under rules that know only the norm: the column-
    parallel weight falls to the default (replicated). ``zero=3``: the same in a ZeRO-3 flat partition. Returns
    the outcome on this rank."""
    full = split_state(0)
    local = {"col.weight": full["col.weight"].chunk(layout.tp)[rank].clone(), "norm.weight": full["norm.weight"]}
    rules = Rules([("norm.weight", Replicated())])
    state: dict[str, Any] = {"model": local}
    if zero == 3:   # the rank's parameters as one flat partition; the shapes listed as the rank holds them
        rules = rules.with_param_shapes([(n, tuple(t.shape)) for n, t in local.items()])
        state = {"model": torch.cat([t.reshape(-1) for t in local.values()])}
    lay = ParallelLayout(tp=layout.tp, zero=zero, rules=rules)
    try:
        ckptrepo.open(url).snapshot(state, step=1, parallel_layout=lay)
    except ckptrepo.errors.CkptRepoError as err:
        return f"{type(err).__name__}: {err}"
    return "committed"


def snapshot_with_a_last_stage_scaler(rank: int, layout: ParallelLayout, url: str) -> str:
    """Two pipeline stages; the last alone keeps a loss scaler (a float and a tensor); each has its own seed."""
    rules = Rules([("*.w", Split(0))], num_layers=2)
    state: dict[str, Any] = {"model": {"layers.0.w": torch.full((4, 4), float(rank))}, "seed": 100 + rank}
    if rank == layout.pp - 1:
        state["scaler"] = {"scale": 65536.0, "growth": torch.tensor([7])}
    return ckptrepo.open(url).snapshot(state, step=1, parallel_layout=ParallelLayout(pp=layout.pp, rules=rules)).id


def unsharded_load_on_every_rank(rank: int, layout: ParallelLayout, url: str) -> list[str]:
    """Snapshot tensor-parallel slices and a per-rank seed, then load the version without a layout on every
    rank (as a torchrun script that wants the full weights does); the warnings this rank got."""
    import warnings
    full = split_state(1)
    local = {"col.weight": full["col.weight"].chunk(layout.tp)[rank].clone(), "row.weight": full["row.weight"]
             .chunk(layout.tp, dim=1)[rank].clone(), "norm.weight": full["norm.weight"]}
    repo = ckptrepo.open(url)
    vid = repo.snapshot({"model": local, "seed": 7 + rank}, step=1,
                        parallel_layout=ParallelLayout(tp=layout.tp, rules=SPLIT_RULES)).id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = repo.load(vid)
    assert out["seed"] == 7 and torch.equal(out["model"]["col.weight"], full["col.weight"])
    return [str(w.message) for w in caught]


UNEVEN_LAYERS = 4


def uneven_stage_rules(stage_sizes: list[int] | None) -> Rules:
    return Rules([("*.w", Split(0))], num_layers=UNEVEN_LAYERS, stage_sizes=stage_sizes,
                 first_stage=("embed.*",), last_stage=("head.*",))


def uneven_stage_state() -> dict[str, torch.Tensor]:
    """A small layered model's full parameters: an embedding, UNEVEN_LAYERS layers, a head."""
    g = torch.Generator().manual_seed(3)
    out = {"embed.weight": torch.randn(10, 8, generator=g)}
    for i in range(UNEVEN_LAYERS):
        out[f"layers.{i}.w"] = torch.randn(8, 8, generator=g)
    out["head.weight"] = torch.randn(10, 8, generator=g)
    return out


def snapshot_uneven_stages(rank: int, layout: ParallelLayout, url: str, stage_sizes: list[int]) -> str:
    """Snapshot this pipeline stage's layers of ``uneven_stage_state()`` under explicit stage sizes."""
    full = uneven_stage_state()
    first, n = sum(stage_sizes[:rank]), stage_sizes[rank]
    local = {f"layers.{j}.w": full[f"layers.{first + j}.w"] for j in range(n)}
    if rank == 0:
        local["embed.weight"] = full["embed.weight"]
    if rank == len(stage_sizes) - 1:
        local["head.weight"] = full["head.weight"]
    lay = ParallelLayout(pp=len(stage_sizes), rules=uneven_stage_rules(stage_sizes))
    return ckptrepo.open(url).snapshot({"model": local}, step=1, parallel_layout=lay).id


def snapshot_unprefixed_layers(rank: int, layout: ParallelLayout, url: str) -> str:
    """Pipeline stages whose layers are named without the rules' layer prefix ("decoder.layers.0" against
    "layers."): every stage holds "its" layer 0 under one global name. Returns the outcome."""
    rules = Rules([], num_layers=2 * layout.pp)
    local = {f"decoder.layers.{i}.w": torch.full((4, 4), float(rank * 2 + i)) for i in range(2)}
    try:
        ckptrepo.open(url).snapshot({"model": local}, step=1, parallel_layout=ParallelLayout(pp=layout.pp, rules=rules))
    except ckptrepo.errors.CkptRepoError as err:
        return f"{type(err).__name__}: {err}"
    return "committed"


def snapshot_disagreeing(rank: int, layout: ParallelLayout, url: str) -> dict[str, str]:
    """Snapshots the ranks must all refuse, each followed by a collective of the training loop; the outcomes."""
    import torch.distributed as dist
    rules = Rules([("w", Split(0))])
    lay = ParallelLayout(tp=layout.world_size, rules=rules)
    repo = ckptrepo.open(url)
    cases = {
        # one rank's state fails the checks before the metadata collective: a set cannot be saved
        "one rank refuses": lambda: {"model": {"w": torch.ones(4, 4)}, **({"extra": {1, 2}} if rank == 1 else {})},
        # the same tensor in two dtypes: bfloat16 bytes would load as float32
        "dtypes differ": lambda: {"model": {"w": torch.ones(4, 4, dtype=torch.bfloat16 if rank else torch.float32)}},
        # the same tensor with two global shapes
        "shapes differ": lambda: {"model": {"w": torch.ones(4, 4) if rank == 0 else torch.ones(8, 2)}},
        # the same state at two steps: the version would say rank 0's
        "steps differ": lambda: {"model": {"w": torch.ones(4, 4)}},
    }
    out = {}
    for case, make in cases.items():
        try:
            with repo.snapshotter(parallel_layout=lay) as snap:
                snap.snapshot(make(), step=1 + rank if case == "steps differ" else 1)
                snap.wait()
            out[case] = "committed"
        except ckptrepo.errors.CkptRepoError as err:
            out[case] = f"{type(err).__name__}: {err}"
        t = torch.ones(1)
        dist.all_reduce(t)      # training goes on: the process group is not left inside a collective
        out[case + " then all_reduce"] = str(int(t.item()))
    dist.barrier()
    try:   # a layout of 4 ranks in a group of 2, without rank=: half of the layout would go unloaded
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=4, rules=rules))
        out["tp=4 in a group of 2"] = "loaded"
    except ckptrepo.errors.CkptRepoError as err:
        out["tp=4 in a group of 2"] = f"{type(err).__name__}: {err}"
    return out
