"""Hugging Face ``Trainer`` under DDP (2 CPU processes under torchrun, gloo): rank 0 alone snapshots the whole
state, with every rank's RNG states, and a fresh 2-process run resumed from ``checkpoint_folder`` of a
middle version logs the same losses, bit for bit, and ends with the same weights."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from support.helpers import assert_bit_exact  # noqa: E402

import ckptrepo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests" / "support" / "hf_ddp_run.py"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def test_ddp_resume_from_a_version_continues_bit_for_bit(tmp_path):
    url, first, second = str(tmp_path / "repo"), tmp_path / "first", tmp_path / "second"
    torchrun("train", url, str(first))
    expected = losses(first)
    assert sorted(expected) == list(range(1, STEPS + 1))

    repo = ckptrepo.open(url)
    versions = repo.log()
    assert [v.step for v in versions] == list(range(STEPS, 0, -1))   # one version per step, from rank 0 alone
    assert repo.plumbing.manifest(versions[0].id).layout.world_size == 1
    rng = repo.load("@10")["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])   # each rank's own states

    torchrun("resume", url, str(second), "@10")
    resumed = losses(second)
    assert resumed == {s: expected[s] for s in range(11, STEPS + 1)}
    assert_bit_exact(torch.load(second / "final.pt"), torch.load(first / "final.pt"))
