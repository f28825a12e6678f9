"""The local tier against itself (issue 39): a remote that is the repository under another name, a config
edited by hand to say so, and a remote that pruned what was evicted here.

Each case drives the CLI (and the API where the CLI has no command) and asserts what a user sees: one line
that says what to do, never a traceback; no version loses its data; fsck exits non-zero, naming the version,
whenever a version's data is nowhere.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from support.ckpt_workers import make_state
from support.helpers import assert_bit_exact, run

import ckptrepo
from ckptrepo.core._manifest import update_config
from ckptrepo.core._same_store import probe_same_store
from ckptrepo.errors import RemoteError, RevisionError
from ckptrepo.storage import open_store

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "the local tier against itself"

SPELLINGS = ["path", "symlink", "file_url", "file_colon", "trailing_slash", "dot_segments", "subdirectory",
             "parent"]


def spell(local: Path, how: str) -> str:
    if how == "symlink":
        link = local.parent / "alias"
        link.symlink_to(local)
        return str(link)
    return {"path": str(local), "file_url": f"file://{local}", "file_colon": f"file:{local}",
            "trailing_slash": f"{local}//", "dot_segments": f"{local}/../{local.name}/.",
            "subdirectory": f"{local}/remote", "parent": str(local.parent)}[how]


def _repo(tmp_path: Path, steps: int = 3) -> ckptrepo.Repository:
    repo = ckptrepo.init(str(tmp_path / "local"))
    for step in range(steps):
        repo.snapshot(make_state(step, big=False), step=step)
    return repo


def _one_line_error(r: Any, rc: int, *needles: str) -> None:
    """The CLI's result ``r`` failed with exit code ``rc`` and one line on stderr holding each of ``needles``."""
    assert r.returncode == rc, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), lines


@pytest.mark.parametrize("how", SPELLINGS)
def test_remote_add_of_itself_is_one_line(tmp_path, how):
    repo = _repo(tmp_path, steps=1)
    url = spell(tmp_path / "local", how)
    _one_line_error(run("remote", "add", "origin", url, repo=repo.url), 2, "cannot be its own remote")
    assert repo.remotes() == {}


@pytest.mark.parametrize("how", SPELLINGS)
def test_a_config_edited_to_itself_is_refused_by_every_command_that_writes(tmp_path, how):
    repo = _repo(tmp_path)
    update_config(repo.plumbing.store, {"remotes": {"origin": {"url": spell(tmp_path / "local", how)}}})
    for command in (("push", "origin"), ("fetch", "origin"), ("pull", "origin")):
        _one_line_error(run(*command, repo=repo.url), 2, "cannot be its own remote")
    with pytest.raises(RemoteError, match="cannot be its own remote") as err:
        repo.snapshotter(push_to="origin", local_keep_last=1)
    assert "\n" not in str(err.value)
    assert run("fsck", repo=repo.url).returncode == 0
    for v in repo.log():
        assert v.local and v.remotes == ()
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))


def test_a_config_edited_to_itself_after_eviction_is_named_by_fsck_log_and_load(tmp_path):
    """Evicted to a real remote, then the config names the repository itself: the evicted versions' data is
    nowhere that ckptrepo will read, and every command says so."""
    repo = _repo(tmp_path)
    repo.remote_add("origin", str(tmp_path / "remote"))
    repo.push("origin")
    repo.evict("origin", keep_last=1)
    update_config(repo.plumbing.store, {"remotes": {"origin": {"url": f"file://{tmp_path / 'local'}"}}})
    r = run("fsck", repo=repo.url)
    assert r.returncode == 1 and r.stdout.count("which is this repository itself") >= 2, r.stdout + r.stderr
    marks = [re.search(r"\[[^]]*\]", line).group() for line in run("log", "--oneline", repo=repo.url).stdout
             .splitlines()]
    assert marks == ["[local]", "[-]", "[-]"]
    with pytest.raises(RevisionError, match="is this repository itself"):
        ckptrepo.open(repo.url).load("@0")


def test_a_remote_that_pruned_evicted_versions(tmp_path):
    repo = _repo(tmp_path, steps=4)
    repo.remote_add("origin", str(tmp_path / "remote"))
    repo.push("origin")
    repo.evict("origin", keep_last=1)
    r = run("gc", "--keep-last", "2", "--grace", "0", repo=str(tmp_path / "remote"))
    assert r.returncode == 0, r.stderr
    assert run("fsck", repo=str(tmp_path / "remote")).returncode == 0   # the remote pruned on purpose
    marks = [re.search(r"\[[^]]*\]", line).group() for line in run("log", "--oneline", repo=repo.url).stdout
             .splitlines()]
    assert marks == ["[local origin]", "[origin]", "[-]", "[-]"]
    r = run("fsck", repo=repo.url)
    assert r.returncode == 1 and r.stdout.count("exists nowhere") == 2 and "ckptrepo prune" in r.stdout
    with pytest.raises(RevisionError, match="has its data nowhere") as err:
        repo.load("@0")
    assert "\n" not in str(err.value)
    assert_bit_exact(repo.load("@2"), make_state(2, big=False))


def test_the_probe_sees_the_store_itself_under_any_name_and_leaves_nothing(tmp_path):
    here = ckptrepo.init(str(tmp_path / "local")).plumbing.store
    (tmp_path / "alias").symlink_to(tmp_path / "local")
    (tmp_path / "other").mkdir()
    for url in (f"file://{tmp_path}/local", str(tmp_path / "alias"), f"{tmp_path}/other/../local"):
        assert probe_same_store(here, open_store(url)), url
    assert not probe_same_store(here, open_store(str(tmp_path / "other")))
    assert here.list("pushes/") == [] and os.listdir(tmp_path / "other") == []


def test_clone_into_the_source_itself_leaves_nothing_behind(tmp_path):
    """A clone inside the repository it copies would be its own remote's objects: refused before anything is
    written there."""
    repo = _repo(tmp_path, steps=1)
    target = tmp_path / "local" / "copy"
    _one_line_error(run("clone", repo.url, str(target)), 2, "cannot be its own remote")
    assert not target.exists()
    assert run("fsck", repo=repo.url).returncode == 0
