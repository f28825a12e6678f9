"""A warning the library gives names the caller's line (``warnings.warn``'s filename and line), not a module
deep inside ckptrepo: that is where a user looks, and where ``-W error`` or a filter by module applies."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import BackpressureWarning


@pytest.fixture(autouse=True)
def _no_hooks():
    yield
    faults.clear()


def test_a_load_into_another_layout_warns_at_the_callers_line(tmp_path: Path) -> None:
    from support.megatron_ref import GPTConfig, init_full_params, shard_full

    from ckptrepo.rules import megatron_gpt
    repo = ckptrepo.init(str(tmp_path / "r"))
    cfg = GPTConfig()
    rules = megatron_gpt(cfg.layers, cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    repo.snapshot(shard_full(cfg, ckptrepo.ParallelLayout(), 0, init_full_params(cfg)), step=1,
                  parallel_layout=ckptrepo.ParallelLayout(rules=rules))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo.load("HEAD", parallel_layout=ckptrepo.ParallelLayout(pp=2, rules=rules), rank=1)
    changed = [w for w in caught if "layout changed" in str(w.message)]
    assert changed and all(w.filename == __file__ for w in changed), [(w.filename, w.lineno) for w in changed]


def test_a_full_local_tier_warns_at_the_snapshot_call(tmp_path: Path) -> None:
    repo = ckptrepo.init(str(tmp_path / "local"))
    repo.remote_add("origin", str(tmp_path / "remote"))
    release = threading.Event()
    faults.set_hook("push_before_ref", lambda _p: release.wait(60))   # the first push holds
    state = {"w": torch.zeros(64 * 1024)}
    with repo.snapshotter(push_to="origin", local_max_bytes=int(state["w"].nbytes * 1.5), on_full="skip") as snap:
        snap.snapshot(state, step=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snap.snapshot(state, step=1)
        release.set()
    full = [w for w in caught if issubclass(w.category, BackpressureWarning)]
    assert full and all(w.filename == __file__ for w in full), [(w.filename, w.lineno) for w in full]
