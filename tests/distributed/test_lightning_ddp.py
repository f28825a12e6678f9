"""Lightning under DDP (2 CPU processes, gloo; forked and spawned): rank 0 alone saves each checkpoint through
``CkptRepoIO`` as one version, with the whole state, and the last one holds exactly the weights the fit ended
with."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from support.helpers import assert_bit_exact  # noqa: E402

import ckptrepo  # noqa: E402
from ckptrepo.integrations._checkpoint_files import read_pointer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])   # ddp_spawn pickles the plugin into each process
def test_ddp_fit_saves_from_rank_zero_alone(tmp_path, strategy):
    url, ckpt_dir = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "lightning_ddp_run.py"), strategy, url,
                           ckpt_dir, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    repo = ckptrepo.open(url)
    versions = repo.log()
    # per epoch end (4 steps: 64 samples over 2 ranks in batches of 8) the top-1 file and last.ckpt; the final
    # weights Lightning hands from rank 0 to the main process are no version
    assert [v.step for v in versions] == [8, 8, 4, 4]
    assert repo.plumbing.manifest(versions[0].id).layout.world_size == 1   # rank 0 alone, the whole state
    pointer = read_pointer(Path(ckpt_dir) / "last.ckpt")
    assert pointer is not None and pointer.version in (versions[0].id, versions[1].id)   # last.ckpt: the epoch-1 state
    saved = repo.load(versions[0].id)["state_dict"]
    assert_bit_exact(dict(saved), torch.load(tmp_path / "final.pt"))
    assert sorted(repo.tags()) == ["epoch=1-step=8.ckpt", "last.ckpt"]
