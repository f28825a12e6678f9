"""Rollback end to end: train a tiny GPT with a snapshot every step, resume from @10 in a fresh process.

The resumed run must reproduce the original losses of steps 11..20 bit for bit
(model, AdamW, LambdaLR, torch/Python/numpy RNGs all restored), land on a new
branch whose history goes back through the @10 version, and leave the original
branch and its 20 versions untouched.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import assert_bit_exact

import ckptrepo

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"


def train(repo: Path, losses: Path, *extra: str) -> dict[int, str]:
    """Run the example in a fresh interpreter; return {step: float.hex(loss)} of the steps it ran."""
    cmd = [sys.executable, str(SCRIPT), "--repo", str(repo), "--steps", "20", "--losses-out", str(losses), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return {int(k): v for k, v in json.loads(losses.read_text()).items()}


@pytest.mark.slow   # two end-to-end training runs of examples/train_gpt.py
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_from_step_10_is_bit_exact_and_keeps_old_versions(tmp_path, mode):
    repo_path = tmp_path / "repo"
    flags = ["--async"] if mode == "async" else []

    # Run 1: steps 1..20 on main, one version per step.
    first = train(repo_path, tmp_path / "first.json", *flags)
    assert sorted(first) == list(range(1, 21))
    repo = ckptrepo.open(str(repo_path))
    assert repo.current_branch() == "main"
    main_log = repo.log()
    assert len(main_log) == 20
    assert [v.step for v in main_log] == list(range(20, 0, -1))
    main_ids = [v.id for v in main_log]
    main_tip = repo.branches()["main"]
    v10 = repo.version("@10")
    assert v10.step == 10 and v10.id in main_ids
    for v in main_log:  # the metrics stored with each version are the losses the run printed
        assert float.hex(v.metrics["loss"]) == first[v.step]

    # Run 2, in a fresh process: roll back to @10 on a new branch and train to step 20 again.
    resumed = train(repo_path, tmp_path / "resumed.json", "--resume", "@10", *flags)
    assert sorted(resumed) == list(range(11, 21))
    mismatched = {s: (first[s], resumed[s]) for s in resumed if resumed[s] != first[s]}
    assert not mismatched, f"resumed losses differ from the original run: {mismatched}"

    repo = ckptrepo.open(str(repo_path))
    branch = repo.current_branch()
    assert branch is not None and branch != "main" and branch.startswith("resume-10")
    branches = repo.branches()
    assert set(branches) == {"main", branch}

    # The new branch: 10 new versions (steps 20..11) whose first-parent chain reaches the @10 version.
    new_log = repo.log(branch)
    assert len(new_log) == 20
    new_versions = [v for v in new_log if v.id not in set(main_ids)]
    assert sorted(v.step for v in new_versions) == list(range(11, 21))
    chain, vid = [], branches[branch]
    for _ in range(10):
        v = repo.version(vid)
        chain.append(v.step)
        assert len(v.parents) == 1
        vid = v.parents[0]
    assert chain == list(range(20, 10, -1))
    assert vid == v10.id
    assert [v.id for v in new_log if v.step <= 10] == [v.id for v in main_log if v.step <= 10]
    for v in new_versions:
        assert float.hex(v.metrics["loss"]) == first[v.step]

    # Rollback kept the original history reachable and unchanged.
    assert branches["main"] == main_tip
    assert [v.id for v in repo.log("main")] == main_ids
    assert repo.version("main").step == 20
    assert len(repo.log(all=True)) == 30

    # And the two step-20 states agree bit for bit (weights and optimizer moments, not just the loss).
    a, b = repo.load("main"), repo.load(branch)
    assert a["step"] == b["step"] == 20
    assert_bit_exact(a["model"], b["model"], "model")
    assert_bit_exact(a["optimizer"], b["optimizer"], "optimizer")
    assert_bit_exact(a["scheduler"], b["scheduler"], "scheduler")
    assert_bit_exact(a["rng"], b["rng"], "rng")
