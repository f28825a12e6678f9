"""A process forked after a load loads too (issue 39): fork copies only the calling thread, so the child must not
hand its reads to the parent's reader threads, which it does not have. Each child is bounded by a timeout and
killed if it hangs; its result must be the parent's, bit for bit. The children compare bytes with hashlib, not
torch: a torch op spread over OpenMP threads can hang in a forked child whatever ckptrepo does."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import select
from typing import Any

import pytest
import torch

import ckptrepo
from ckptrepo.storage import _localread

WAIT = 60   # seconds a child may take to load a few MiB; the hang it guards against is for ever


def _digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(state["model"]):
        h.update(name.encode() + state["model"][name].numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("fork") / "repo")
    g = torch.Generator().manual_seed(0)
    ckptrepo.init(url).snapshot({"model": {f"l{i}": torch.randn(256, 1024, generator=g) for i in range(4)}}, step=1)
    return url


def _child_loads(url: str, repo: ckptrepo.Repository, out: Any) -> None:
    out.send((_digest(ckptrepo.load(url)), _digest(repo.load())))


def test_a_child_forked_after_a_load_loads_the_same_bytes(url: str) -> None:
    repo = ckptrepo.open(url)
    expected = _digest(repo.load())   # the parent's reader threads exist from here on
    assert _localread._pool is not None
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_child_loads, args=(url, repo, theirs), daemon=True)
    child.start()
    try:
        assert ours.poll(WAIT), "the forked child did not finish its loads: it hangs"
        assert ours.recv() == (expected, expected)
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert _digest(repo.load()) == expected   # the parent's own pool is untouched


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_bare_os_fork_child_loads_too(url: str) -> None:
    expected = _digest(ckptrepo.load(url))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report, and never return into pytest
        code = 1
        try:
            os.write(write, _digest(ckptrepo.load(url)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], WAIT)
        assert ready, "the forked child did not finish its load: it hangs"
        assert os.read(read, 100).decode() == expected
    finally:
        os.close(read)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
