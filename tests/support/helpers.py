"""Helpers many tests share: bit-exact comparison of nested states; counting a store's manifest reads;
running the CLI in-process."""
from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch


def assert_bit_exact(a: Any, b: Any, path: str = "state") -> None:
    """Assert ``a`` and ``b`` have the same structure, types, and bytes (NaN payloads included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8) if a.numel() else a
        bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8) if b.numel() else b
        if a.numel():
            assert torch.equal(ab, bb), f"{path}: values differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)} is not an ndarray"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ"
        return
    if isinstance(a, np.random.Generator):
        assert isinstance(b, np.random.Generator), path
        assert_bit_exact(a.bit_generator.state, b.bit_generator.state, path + ".state")
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} vs {list(b)}"
        assert isinstance(a, collections.OrderedDict) == isinstance(b, collections.OrderedDict), path
        for k in a:
            assert_bit_exact(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_exact(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN vs {b}"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def count_manifest_reads(monkeypatch: Any, store: Any,
                         requests: collections.Counter | None = None) -> collections.Counter:
    """From now on, count the reads of each version manifest (``versions/<id>``) through ``store``'s class.

    ``requests``, if given, counts the round trips too: "get" (one manifest), "get_many" (a batch) and
    "batched" (the manifests read in batches).
    """
    from ckptrepo.core._manifest import VERSIONS_PREFIX
    reads: collections.Counter = collections.Counter()
    round_trips = requests if requests is not None else collections.Counter()
    get, get_many = type(store).get, type(store).get_many

    def counting_get(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.startswith(VERSIONS_PREFIX):
            reads[key] += 1
            round_trips["get"] += 1
        return get(self, key, *args, **kwargs)

    def counting_get_many(self: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        manifests = [key for key in keys if key.startswith(VERSIONS_PREFIX)]
        reads.update(manifests)
        if manifests:
            round_trips["get_many"] += 1
            round_trips["batched"] += len(manifests)
        return get_many(self, keys, *args, **kwargs)
    monkeypatch.setattr(type(store), "get", counting_get)
    monkeypatch.setattr(type(store), "get_many", counting_get_many)
    return reads


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run(*args, repo=None, env_repo=None, cwd=None):
    """Run the CLI entry point in-process (fast), exactly as the console script does."""
    from ckptrepo.cli.main import main
    argv = ["ckptrepo"] + (["--repo", repo] if repo else []) + list(args)
    saved_argv, saved_cwd, saved_env = sys.argv, os.getcwd(), os.environ.get("CKPTREPO_REPO")
    # text streams over bytes, as the console script's are: click writes some output (shell completion, from
    # click 8.5 on) as bytes to the stream's buffer
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True) for _ in range(2))
    os.environ.pop("CKPTREPO_REPO", None)
    if env_repo:
        os.environ["CKPTREPO_REPO"] = env_repo
    code = 0
    try:
        sys.argv = argv
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.pop("CKPTREPO_REPO", None)
        if saved_env is not None:
            os.environ["CKPTREPO_REPO"] = saved_env
    r = Result(code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode())
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    return r


def outcome_within(seconds: float, call: Callable[[], Any], on_hang: Callable[[], None] | None = None) -> Any:
    """``call()``'s result, or the exception it raised (returned, not raised); fails the test if it has not
    returned after ``seconds`` (a hang). ``on_hang`` is called a few times to unblock it first, so that the
    blocked thread does not outlive the test."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["value"] = err
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    for _ in range(20 if on_hang is not None and t.is_alive() else 0):
        on_hang()
        t.join(0.5)
        if not t.is_alive():
            break
    assert "value" in box, f"{call} still running after {seconds:.0f} s: a hang"
    return box["value"]


def reap(procs: list[Any], wait_s: float) -> None:
    """Join each worker process, killing one still alive after ``wait_s``: none may outlive its test."""
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            p.kill()
            p.join()


@contextlib.contextmanager
def ui_serving(make: Callable[[], Any]) -> Iterator[Any]:
    """The web page's server that ``make()`` builds, serving from a thread until the block ends; then shut down
    and closed, and its threads joined: one still answering a request would outlive the test, and a later
    test in this process (under pytest-xdist, of another file too) that counts the page's threads would count
    it."""
    earlier = set(threading.enumerate())
    server = make()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        for thread in set(threading.enumerate()) - earlier:
            if thread.name.startswith("ckptrepo-ui"):
                thread.join(30)


def dcp_save(state: Any, url: str, **kw: Any) -> Any:
    """``dcp.save`` of ``state`` through ``ckptrepo.dcp.Writer(url, **kw)`` without a process group; the
    version it committed."""
    import torch.distributed.checkpoint as dcp

    from ckptrepo.dcp import Writer

    writer = Writer(url, **kw)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.version
