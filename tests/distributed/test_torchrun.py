"""The torchrun path end to end: examples/train_tp.py launched by the real launcher (env:// rendezvous, gloo).

Two processes train a tensor-parallel MLP (DTensors from ``parallelize_module``) and snapshot every step;
then the run is resumed from the middle on one process and on two. The resumed losses must follow the
original run's: exactly on two processes (the same reductions), within float rounding on one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckptrepo

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_tp.py")


def torchrun(nproc: int, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", EXAMPLE, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    return {int(k): v for k, v in out["losses"].items()}


def test_a_torchrun_job_resumes_from_its_snapshots_on_one_process_and_on_two(tmp_path):
    repo_path = str(tmp_path / "repo")
    original = torchrun(2, "--repo", repo_path, "--steps", "6")
    assert sorted(original) == [1, 2, 3, 4, 5, 6]
    one = torchrun(1, "--repo", repo_path, "--steps", "6", "--resume", "@3")
    assert sorted(one) == [4, 5, 6]
    assert [one[s] for s in (4, 5, 6)] == pytest.approx([original[s] for s in (4, 5, 6)], rel=1e-5)
    two = torchrun(2, "--repo", repo_path, "--steps", "6", "--resume", "@3")
    assert {s: two[s] for s in (4, 5, 6)} == {s: original[s] for s in (4, 5, 6)}
    repo = ckptrepo.open(repo_path)
    # every run committed every step: the original on main, each resume on a branch of its own from step 3
    assert [v.step for v in repo.log("main")] == [6, 5, 4, 3, 2, 1]
    resumed = [b for b in repo.branches() if b.startswith("resume-3-")]
    assert len(resumed) == 2 and all([v.step for v in repo.log(b)] == [6, 5, 4, 3, 2, 1] for b in resumed)
    for b in resumed:   # the one-process version and the two-process one both load whole, unsharded
        assert repo.load(b)["model"]["up.weight"].shape == (256, 64)
    assert repo.fsck().ok
