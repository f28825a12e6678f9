"""Hostile remotes: a repository cloned, fetched or pushed to that lies, redirects, links out of itself, or is
served by an endpoint that stalls or floods.

Each case builds a small sound repository, makes it hostile by hand, and checks that ckptrepo neither reads nor
writes outside the places the user named, keeps its memory bounded, ends in bounded time, and says what is wrong
in one line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptrepo
from ckptrepo.errors import CkptRepoError

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "hostile remotes"

ROOT = Path(__file__).resolve().parents[2]


def _source(path: Path, steps: int = 2) -> ckptrepo.Repository:
    repo = ckptrepo.init(path)
    for step in range(steps):
        repo.snapshot({"w": torch.arange(64, dtype=torch.float32) + step}, step=step)
    return repo


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ckptrepo.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _set_config(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "ckptrepo.json").read_bytes())
    cfg.update(fields)
    (path / "ckptrepo.json").write_text(json.dumps(cfg))


# ---- a remote's own remotes ------------------------------------------------------------------------------------

def test_clone_never_follows_the_remotes_a_remote_names(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    tip = src.log()[0].id
    elsewhere = tmp_path / "elsewhere"   # a place the user never named, holding the data the remote points at
    shutil.copytree(tmp_path / "src", elsewhere)
    shutil.rmtree(tmp_path / "src" / "data" / tip)
    (tmp_path / "src" / "evicted").mkdir(exist_ok=True)
    (tmp_path / "src" / "evicted" / tip).write_text(json.dumps({"remote": "evil"}))
    _set_config(tmp_path / "src", remotes={"evil": {"url": str(elsewhere)}})

    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(tmp_path / "src", tmp_path / "c")
    msg = _one_line(err.value)
    assert tip[:12] in msg and "evil" in msg
    assert not (tmp_path / "c" / "data" / tip).exists()
    assert str(elsewhere) not in json.dumps(json.loads((tmp_path / "c" / "ckptrepo.json").read_bytes()))
