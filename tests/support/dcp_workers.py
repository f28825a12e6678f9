"""Worker bodies for tests/distributed/test_dcp.py: FSDP2 state through ``dcp.save`` / ``dcp.load`` over a repository.

The model is tests/support/fsdp2_workers.py's (an MLP with ``fully_shard`` on every Linear and the root, Adam after
one step: 33 rows split 17+16 over 2 ranks, 11+11+11 over 3). Results go to ``out_dir``: ``full-<tag>.pt``
(rank 0: every tensor whole, gathered with ``full_tensor()``), ``warn-<tag>.json`` (rank 0: the warnings a
load gave), ``error-<tag>-<r>.txt`` (a worker's traceback).
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from support.dtensor_workers import _guarded, _init, _write_json, full
from support.fsdp2_workers import build


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dump(rank: int, out_dir: str, tag: str, state: dict[str, Any]) -> None:
    whole = full(state)   # a collective: every rank gathers
    if rank == 0:
        torch.save(whole, os.path.join(out_dir, f"full-{tag}.pt"))


def save_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """On ``world`` ranks: ``dcp.save`` the FSDP2 state as @1, ``dcp.async_save`` it as @2, ``repo.snapshot``
    it as @3, and snapshot it with a per-rank seed tensor that differs between the ranks as @4."""
    def body() -> None:
        import torch.distributed.checkpoint as dcp

        import ckptrepo
        import ckptrepo.dcp
        mesh = _init(rank, world, port)
        model, opt = build(mesh, seed=0)
        state = _state(model, opt)
        state["extra"] = {"epoch": 3, "note": "dcp"}
        writer = ckptrepo.dcp.Writer(url, step=1, message="dcp.save")
        dcp.save(state, storage_writer=writer)
        assert (writer.version is not None) == (rank == 0)
        dcp.async_save(state, storage_writer=ckptrepo.dcp.Writer(url, step=2)).result()
        repo = ckptrepo.open(url)
        repo.snapshot(state, step=3)
        repo.snapshot({**state, "seed": torch.tensor([rank])}, step=4)
        _dump(rank, out_dir, f"save{world}", state)
    _guarded(f"save{world}", rank, out_dir, body)


def load_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """On ``world`` ranks: ``dcp.load`` each of @1 (dcp.save), @2 (async_save) and @3 (repo.snapshot) into a
    fresh FSDP2 model (another seed), and ``repo.load`` @1 into its DTensors; @4 (per-rank seeds) and @3
    through ``repo.load`` too, recording the warnings."""
    def body() -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        import ckptrepo
        import ckptrepo.dcp
        mesh = _init(rank, world, port)
        for rev in ("@1", "@2", "@3"):
            model, opt = build(mesh, seed=1)
            state = _state(model, opt)
            state["extra"] = {"epoch": 0, "note": ""}
            dcp.load(state, storage_reader=ckptrepo.dcp.Reader(url, rev))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if rank == 0:
                assert state["extra"] == {"epoch": 3, "note": "dcp"}, state["extra"]
            _dump(rank, out_dir, f"dcp{rev[1:]}-{world}", _state(model, opt))
        repo = ckptrepo.open(url)
        model, opt = build(mesh, seed=1)
        state = _state(model, opt)
        state["extra"] = {"epoch": 0, "note": ""}
        repo.load("@1", into=state)
        _dump(rank, out_dir, f"repo1-{world}", state)
        caught: dict[str, list[str]] = {}
        for rev, extra in (("@3", {}), ("@4", {"seed": torch.tensor([-1])})):
            model, opt = build(mesh, seed=1)
            into = {**_state(model, opt), "extra": {"epoch": 0, "note": ""}, **extra}
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                repo.load(rev, into=into)
            caught[rev] = [str(w.message) for w in got]
        if rank == 0:
            _write_json(out_dir, f"warn-{world}.json", caught)
    _guarded(f"load{world}", rank, out_dir, body)


def dcp_save_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """On ``world`` ranks: ``dcp.save`` the FSDP2 state (seed 0) as step 5."""
    def body() -> None:
        import torch.distributed.checkpoint as dcp

        import ckptrepo.dcp
        mesh = _init(rank, world, port)
        model, opt = build(mesh, seed=0)
        state = _state(model, opt)
        dcp.save(state, storage_writer=ckptrepo.dcp.Writer(url, step=5))
        _dump(rank, out_dir, f"save{world}", state)
    _guarded(f"save{world}", rank, out_dir, body)


def reload_worker(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    """On ``world`` ranks: ``dcp.load`` @5 (saved on 3 ranks) into a fresh FSDP2 model."""
    def body() -> None:
        import torch.distributed.checkpoint as dcp

        import ckptrepo
        import ckptrepo.dcp
        mesh = _init(rank, world, port)
        model, opt = build(mesh, seed=1)
        state = _state(model, opt)
        dcp.load(state, storage_reader=ckptrepo.dcp.Reader(url, "@5"))
        _dump(rank, out_dir, f"dcp5-{world}", state)
    _guarded(f"reload{world}", rank, out_dir, body)
