"""Start-up: ``ckptrepo log`` on a local repository loads neither torch, numpy, TensorStore nor rich, and a short
log reads the headers it lists, not the history; ``diff``, ``show --stat``, ``log -p`` and ``stats``, which read
tensor data, load neither torch nor TensorStore. Asserted on what is imported, not on a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.helpers import count_manifest_reads, run

import ckptrepo

HEAVY = ("torch", "numpy", "tensorstore", "rich")
# the subprocesses run the ckptrepo these tests import, whatever else is installed
ENV = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ckptrepo.__file__))))


def _imported(args: list[str], cwd: str) -> set[str]:
    """The top-level packages a fresh ``python -X importtime -m ckptrepo.cli ARGS`` imports."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptrepo.cli", *args], capture_output=True,
                       text=True, cwd=cwd, env=dict(ENV, COLUMNS="120"), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in p.stderr.splitlines()
            if line.startswith("import time:") and "|" in line and "package" not in line}


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("startup") / "repo")
    repo = ckptrepo.init(url)
    with repo.snapshotter() as snap:
        for step in range(30):
            snap.snapshot({"w": torch.full((8,), float(step))}, step=step, metrics={"loss": 1.0 / (step + 1)})
    repo.tag("best", "@20")
    return url


def test_log_imports_neither_torch_numpy_tensorstore_nor_rich(history, tmp_path):
    imported = _imported(["--repo", history, "log", "-n", "10"], str(tmp_path))
    assert "ckptrepo" in imported and "click" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    for args in (["log", "--oneline", "--all"], ["metrics", "--json"], ["show", "best", "--json"]):
        assert not _imported(["--repo", history, *args], str(tmp_path)) & set(HEAVY), args


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Versions of float32, bfloat16, float16, float8 and integer tensors; the newest one without capture-time
    statistics, so that ``stats`` reads its data."""
    url = str(tmp_path_factory.mktemp("startup-data") / "repo")
    repo = ckptrepo.init(url)
    g = torch.Generator().manual_seed(0)
    w = {"layers.0.w": torch.randn(64, 64, generator=g), "half": torch.randn(300, generator=g),
         "f16": torch.randn(40, generator=g), "e4m3": torch.randn(50, generator=g),
         "e5m2": torch.randn(50, generator=g)}
    kinds = {"half": torch.bfloat16, "f16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    for step in range(3):
        state = {k: (v * 1.5 ** step).to(kinds.get(k, torch.float32)) for k, v in w.items()}
        with repo.snapshotter(tensor_stats=step < 2) as snap:
            snap.snapshot(dict(state, count=torch.arange(10), lr=0.1 / (step + 1)), step=step)
    return url


@pytest.mark.parametrize("args", [["diff", "HEAD~1", "HEAD"], ["diff", "HEAD", "--stat", "--json"],
                                  ["show", "--stat", "HEAD"], ["log", "-p"], ["log", "-p", "--json"],
                                  ["stats", "HEAD"], ["stats", "HEAD", "--json"]],
                         ids=lambda a: " ".join(a))
def test_data_commands_import_neither_torch_nor_tensorstore(data, tmp_path, args):
    """They read the data into numpy buffers (bfloat16 and float8 widened by their bits): no tensor is built."""
    imported = _imported(["--repo", data, *args], str(tmp_path))
    assert "numpy" in imported
    assert not imported & {"torch", "tensorstore"}, sorted(imported & {"torch", "tensorstore"})


def test_data_commands_print_what_the_api_computes(data):
    """The same numbers as in a process that has torch (this one): the stats read from data, the diff."""
    repo = ckptrepo.open(data)
    assert repo.plumbing.manifest(repo.resolve("HEAD")).tensor_stats is None   # read from the data
    p = subprocess.run([sys.executable, "-m", "ckptrepo.cli", "--repo", data, "stats", "HEAD", "--json"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == [r.to_json() for r in repo.stats("HEAD")]
    p = subprocess.run([sys.executable, "-m", "ckptrepo.cli", "--repo", data, "diff", "HEAD~1", "HEAD", "--json",
                        "--include-nonfloat"], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    printed, want = json.loads(p.stdout), repo.diff("HEAD~1", "HEAD", include_nonfloat=True).to_json()
    by_name = {t["name"]: t for t in want["tensors"]}
    assert {t["name"]: t for t in printed["tensors"]} == by_name and len(by_name) == 6
    assert printed["objects"] == want["objects"] and [o["path"] for o in want["objects"]] == ["lr"]


def test_import_ckptrepo_is_light_and_its_api_loads_on_first_use(tmp_path):
    code = ("import sys, ckptrepo; heavy = [m for m in ('torch', 'numpy', 'tensorstore', 'rich') if m in sys.modules]; "
            "assert not heavy, heavy; "
            "assert ckptrepo.Repository.__module__ == 'ckptrepo.repository'; "
            "from ckptrepo import ParallelLayout, RetentionPolicy, Version, VersionDetails; "
            "from ckptrepo import clone, init, load, open, rules; "
            "assert callable(open) and rules.__name__ == 'ckptrepo.rules' and 'init' in dir(ckptrepo); "
            "from ckptrepo import *")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), env=ENV,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ckptrepo.nothing  # noqa: B018


def test_item_sizes_known_without_tensorstore_are_tensorstores():
    from ckptrepo.core._schema_fields import ZARR_DTYPES
    from ckptrepo.storage._arrays import ITEMSIZES, numpy_dtype
    assert set(ITEMSIZES) == ZARR_DTYPES
    assert {d: numpy_dtype(d).itemsize for d in ZARR_DTYPES} == ITEMSIZES


def test_short_log_reads_only_the_headers_it_lists(history, monkeypatch):
    repo = ckptrepo.open(history)
    reads = count_manifest_reads(monkeypatch, repo.plumbing.store)
    p = run("log", "-n", "10", repo=history)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 10
    assert sum(reads.values()) <= 11, sum(reads.values())   # the ten listed (and at most one parent)


def test_local_listing_is_tensorstores(tmp_path):
    """A local store lists its folders itself (log needs no TensorStore): the same keys as TensorStore's file
    kvstore, for every prefix, with links (not followed), a FIFO, lock files and empty folders about."""
    import tensorstore as ts

    from ckptrepo.storage._tensorstore import TensorStoreStore, _prefix_end
    root = tmp_path / "r"
    for folder in ("a/b", "a/bc", "empty/inner", "c"):
        (root / folder).mkdir(parents=True)
    for name in ("a/x", "a/b/y", "a/bc/z", "a/b/\u00e4", "ab", ".hidden", "sp ace", "c/z", "c/z.__lock", "c.__lock"):
        (root / name).write_bytes(b"1")
    (root / "other").mkdir()
    (root / "other" / "o").write_bytes(b"1")
    os.symlink(root / "a" / "x", root / "linkfile")
    os.symlink(root / "a", root / "linkdir")
    os.symlink(root / "nowhere", root / "broken")
    os.mkfifo(root / "fifo")
    store = TensorStoreStore.open(str(root))
    kv = ts.KvStore.open({"driver": "file", "path": str(root) + "/"}).result()
    for prefix in ("", "a", "a/", "a/b", "a/b/", "a/bc", "c/", "c", "empty/", "nothing/", "link", "z"):
        rng = ts.KvStore.KeyRange(inclusive_min=prefix.encode(), exclusive_max=_prefix_end(prefix))
        want = sorted(k.decode() for k in (kv.list(rng) if prefix else kv.list()).result()
                      if not k.endswith(b".__lock"))
        assert store.list(prefix) == want, prefix
    assert store.exists("a/x") and not store.exists("a/nothing") and not store.exists("a") and store.exists("fifo")
    assert store.get_many(["a/x", "nothing", "a/b/y"]) == [b"1", None, b"1"]


def test_the_lazy_package_still_reaches_its_modules_as_attributes():
    """`import ckptrepo` then `ckptrepo.repository.X` (what the Lightning adapter does) failed once the API was
    imported lazily: a module not yet imported is no attribute of its package."""
    code = ("import ckptrepo; print(ckptrepo.repository.repo_url('memory://x'), ckptrepo.tools.__name__); "
            "ckptrepo.no_such_thing")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.stdout.split() == ["memory://x", "ckptrepo.tools"], p.stderr[-500:]
    assert "AttributeError: module 'ckptrepo' has no attribute 'no_such_thing'" in p.stderr
