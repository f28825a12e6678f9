"""Folders in a shared place that ckptrepo writes and reads back: the HF resume folder of ``checkpoint_folder``.

Another local user can create any name in the shared temp directory before us, and read what we leave there
with the default modes (issue 39): the folder a resume reads must be one this process made, private to the
user, and gone when the process ends."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import ckptrepo

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "reused folders"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from ckptrepo.integrations.hf import checkpoint_folder, hf_config, rng_states  # noqa: E402


def _trainer_version(url: str, step: int = 3) -> tuple[ckptrepo.Repository, dict[str, torch.Tensor]]:
    """A version with what CkptRepoCallback saves (a tiny GPT-2), and its model's weights."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11,
                                                                 n_positions=4, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters())
    repo = ckptrepo.init(url)
    repo.snapshot({"model": model, "optimizer": opt,
                   "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                   "trainer_state": {"global_step": step}, "hf_config": hf_config(model), "rng": rng_states()},
                  step=step)
    return repo, {k: v.clone() for k, v in model.state_dict().items()}


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_a_planted_folder_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    repo, weights = _trainer_version(str(tmp_path / "repo"))
    vid = repo.resolve("HEAD")
    # what another user plants where a resume would look: every name a version's folder could take
    for name in (f"ckptrepo-hf-{os.getuid()}/checkpoint-3-{vid[:16]}", f"ckptrepo-hf-{vid[:12]}",
                 "checkpoint-3"):
        planted = shared / name
        planted.mkdir(parents=True, mode=0o755)
        (planted / "trainer_state.json").write_text('{"global_step": 999}')
        (planted / "model.safetensors").write_bytes(b"planted")
    before = {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    folder = Path(checkpoint_folder(repo, "HEAD"))
    assert folder.is_relative_to(shared) and not any(folder.is_relative_to(p.parent) for p in before)
    assert '"global_step": 3' in (folder / "trainer_state.json").read_text()
    from safetensors.torch import load_file
    loaded = load_file(folder / "model.safetensors")
    assert all(torch.equal(loaded[k], weights[k]) for k in loaded) and loaded
    assert {p: p.read_bytes() for p in before} == before   # the planted files are neither read nor changed


def test_the_folder_is_private_new_each_call_and_removed_at_exit(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _trainer_version(url)
    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o777)
    # in a child process: two calls, then the modes and owners of a folder and of the one holding it
    code = ("import os, stat, sys; from pathlib import Path; from ckptrepo.integrations.hf import checkpoint_folder\n"
            "first, second = checkpoint_folder(sys.argv[1], 'HEAD'), checkpoint_folder(sys.argv[1], '@3')\n"
            "st = [os.lstat(p) for p in (Path(first), Path(first).parent)]\n"
            "print(first, second, *[f'{stat.S_IMODE(s.st_mode):o}:{s.st_uid}' for s in st], sep='\\n')")
    env = {**os.environ, "TMPDIR": str(shared), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second, *modes = done.stdout.split()
    assert first != second and Path(first).parent.parent == shared   # a new folder per call, never one reused
    assert modes == [f"700:{os.getuid()}"] * 2   # the checkpoint folder and the one holding it
    assert list(shared.iterdir()) == []   # every folder it made is gone once the process exited


def test_a_folder_the_caller_names_is_kept(tmp_path: Path) -> None:
    repo, _ = _trainer_version(str(tmp_path / "repo"))
    folder = Path(checkpoint_folder(repo, "HEAD", out=tmp_path / "mine"))
    assert folder == tmp_path / "mine" and (folder / "trainer_state.json").is_file()
    assert _private(Path(checkpoint_folder(repo, "HEAD")).parent)
