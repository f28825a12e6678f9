"""Hostile files and hostile manifests meet clear errors, never a hang or a memory bomb (issue 27, sections 4
and 7).

A local store reads only regular files: a FIFO in an object's place blocked every command forever, and a
symbolic link to /dev/zero read until memory ran out. Small objects are bounded (docs/format.md, "Size
limits"), a manifest's array keys and geometry are checked when it is decoded, and the sizes it declares
are checked against the stored objects before a load or fsck allocates for them.

Every command runs in a daemon thread with a deadline, so a regression fails the test instead of hanging
the suite; a thread left blocked on a FIFO is released by opening the FIFO's other end.
"""
from __future__ import annotations

import functools
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from support.helpers import outcome_within, run

import ckptrepo
from ckptrepo.core._manifest import seal, unseal
from ckptrepo.errors import CkptRepoError, CorruptionError
from ckptrepo.storage._chunktable import table_digest, table_key
from ckptrepo.storage._tensorstore import TensorStoreStore

DEADLINE_S = 60.0


def _release(path: Path) -> None:
    """Unblock whatever waits on FIFOs under ``path``: a reader blocked in open() returns once a writer opens."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            if stat.S_ISFIFO(os.lstat(p).st_mode):
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass


def no_hang(fn: Callable[[], Any], repo: Path, deadline: float = DEADLINE_S) -> Any:
    """``fn()``'s result (or the exception it raised, returned), failing the test if it runs past ``deadline``
    (blocked on a FIFO?)."""
    return outcome_within(deadline, fn, on_hang=lambda: _release(repo))


@pytest.fixture
def repo_dir(tmp_path):
    """A repository with two versions on main, a tag, and a failure record."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    v1 = repo.snapshot({"w": torch.randn(1000), "n": torch.arange(10)}, step=1).id
    v2 = repo.snapshot({"w": torch.randn(1000), "n": torch.arange(10)}, step=2).id
    repo.tag("t1", v1)
    (path / "failures").mkdir()
    (path / "failures" / ("f" * 32)).write_bytes(seal({"id": "f" * 32, "step": 3, "time": 1.0, "error": "boom"}))
    return path, v1, v2


def _object(path: Path, kind: str, v1: str, v2: str) -> Path:
    return {
        "HEAD": path / "HEAD",
        "config": path / "ckptrepo.json",
        "branch": path / "refs" / "heads" / "main",
        "tag": path / "refs" / "tags" / "t1",
        "manifest": path / "versions" / v2,
        "failure": path / "failures" / ("f" * 32),
        "zarr.json": path / "data" / v2 / "0" / "float32" / "zarr.json",
        "shard": path / "data" / v2 / "0" / "float32" / "c" / "0",
    }[kind]


KINDS = ["HEAD", "config", "branch", "tag", "manifest", "failure", "zarr.json", "shard"]


def _replace(target: Path, how: str) -> None:
    target.unlink()
    if how == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")


def _commands(path: Path, v1: str) -> list[tuple[str, Callable[[], Any]]]:
    url = str(path)
    return [
        ("log", lambda: run("log", "--all", repo=url)),
        ("show", lambda: run("show", v1, repo=url)),
        ("fsck", lambda: run("fsck", repo=url)),
        ("gc", lambda: run("gc", "--grace", "0", "--dry-run", repo=url)),
        ("load", lambda: ckptrepo.open(url).load("HEAD")),
    ]


@pytest.mark.parametrize("how", ["fifo", "devzero"])
@pytest.mark.parametrize("kind", KINDS)
def test_no_object_in_place_of_a_file_hangs_or_is_read(repo_dir, kind, how):
    """A FIFO in place of any object blocked every command that read it; a link to /dev/zero read until
    MemoryError. Now each is named as what it is, and fsck fails on it."""
    path, v1, v2 = repo_dir
    _replace(_object(path, kind, v1, v2), how)
    what = "a named pipe (FIFO)" if how == "fifo" else "a device"
    outcomes = {name: no_hang(call, path) for name, call in _commands(path, v1)}
    for name, got in outcomes.items():
        if isinstance(got, BaseException):
            assert isinstance(got, CkptRepoError), f"{name}: {got!r}"
            assert "\n" not in str(got), f"{name}: {got}"
    fsck = outcomes["fsck"]
    if kind == "failure":   # a failed snapshot's leftover: named, not an error of the repository
        assert what in fsck.stdout + fsck.stderr, fsck.stdout + fsck.stderr
        return
    assert fsck.returncode != 0, fsck.stdout
    if kind == "config":
        assert what in fsck.stderr, fsck.stderr
        return
    assert what in fsck.stdout + fsck.stderr or kind == "zarr.json", fsck.stdout + fsck.stderr
    if kind in ("HEAD", "branch", "manifest", "zarr.json", "shard"):   # what load("HEAD") reads
        assert isinstance(outcomes["load"], CorruptionError), outcomes["load"]


def test_a_fifo_lock_file_does_not_block_a_ref_update(repo_dir):
    """TensorStore's file store writes a value through ``<key>.__lock``: a FIFO there blocked every write of
    that key (a snapshot, a checkout) forever. The write is refused, naming the lock file."""
    path, v1, v2 = repo_dir
    os.mkfifo(path / "HEAD.__lock")
    got = no_hang(lambda: ckptrepo.open(str(path)).checkout(v1, branch="side"), path)
    assert isinstance(got, CorruptionError) and "HEAD.__lock" in str(got), got
    os.unlink(path / "HEAD.__lock")
    ckptrepo.open(str(path)).checkout("side")   # removed, as the message says: the write works
    assert (path / "HEAD").read_text() == "ref: refs/heads/side"


def test_an_oversized_head_is_refused_without_being_read(repo_dir):
    """A 300 MB HEAD was read whole and accepted. HEAD holds a version id or a branch name: anything over
    the format's limit for a ref is refused from its size alone."""
    path, v1, v2 = repo_dir
    with open(path / "HEAD", "r+b") as f:
        f.truncate(300 << 20)   # sparse: no disk, no time
    t0 = time.monotonic()
    got = no_hang(lambda: ckptrepo.open(str(path)).log(), path)
    assert isinstance(got, CorruptionError) and "object HEAD is 314572800 bytes" in str(got), got
    assert time.monotonic() - t0 < 10
    r = run("fsck", repo=str(path))
    assert r.returncode != 0 and "HEAD is 314572800 bytes" in r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["manifest", "config", "branch"])
def test_every_small_object_has_a_size_limit(repo_dir, kind):
    path, v1, v2 = repo_dir
    target = _object(path, kind, v1, v2)
    limit = {"manifest": 1 << 30, "config": 64 << 10, "branch": 8 << 10}[kind]
    with open(target, "r+b") as f:
        f.truncate(limit + 1)
    got = no_hang(lambda: ckptrepo.open(str(path)).load("HEAD"), path)
    assert isinstance(got, CorruptionError) and f"is {limit + 1} bytes, more than the {limit}" in str(got), got


def test_the_store_reads_only_regular_files_on_every_read(tmp_path):
    """Each read of the storage protocol, not only ``get``: TensorStore's own file store blocks on a FIFO."""
    store = TensorStoreStore.open(str(tmp_path / "s"))
    store.put("ok", b"value")
    os.mkfifo(tmp_path / "s" / "fifo")
    (tmp_path / "s" / "zero").symlink_to("/dev/zero")
    for key in ("fifo", "zero"):
        for read in (store.get, store.get_with_generation, lambda k: store.get_many([k]),
                     lambda k: store.get_range(k, 0, 4), lambda k: store.compare_and_swap(k, b"x", b"\x02")):
            got = no_hang(functools.partial(read, key), tmp_path)
            assert isinstance(got, CorruptionError) and f"object {key} is" in str(got), (key, read, got)
        # something is there: reading it says what
        assert no_hang(functools.partial(store.exists, key), tmp_path) is True
    assert store.get("ok", max_bytes=5) == b"value"
    with pytest.raises(CorruptionError, match="object ok is 5 bytes, more than the 4"):
        store.get("ok", max_bytes=4)
    with pytest.raises(CorruptionError, match="object ok is 5 bytes, more than the 4"):
        store.get_many(["ok"], max_bytes=4)


def test_a_memory_store_bounds_values_too():
    store = TensorStoreStore.open("memory://hardening-bounds")
    store.put("k", b"12345")
    with pytest.raises(CorruptionError, match="object k is 5 bytes, more than the 4"):
        store.get("k", max_bytes=4)
    with pytest.raises(CorruptionError, match="object k is 5 bytes"):
        store.get_with_generation("k", max_bytes=4)


# ---- manifests that name keys outside the repository, or sizes the store does not hold --------------------

def _edit_manifest(path: Path, vid: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Decode, edit and re-seal ``versions/<vid>``: its crc32c is then valid, as a forger's would be."""
    file = path / "versions" / vid
    m = unseal(file.read_bytes(), "test")
    edit(m)
    file.write_bytes(seal(m))


def _rekey(m: dict[str, Any], old: str, new: str) -> None:
    m["arrays"] = {new if k == old else k: a for k, a in m["arrays"].items()}
    for t in m["tensors"]:
        for p in t["pieces"]:
            if p["array"] == old:
                p["array"] = new


@pytest.mark.parametrize("key", ["../other/data/{vid}/0/float32", "/abs/data/{vid}/0/float32",
                                 "data/{vid}/../../../other/data/{vid}/0/float32", "data/{vid}//0/float32",
                                 "data/{vid}/0/float64"])
def test_a_manifest_naming_keys_outside_the_repository_is_refused_on_every_path(tmp_path, monkeypatch, key):
    """A re-sealed manifest whose array key is ``../…`` or absolute made the direct read path load another
    repository's data. Every key a manifest names is checked when it is decoded, whichever path reads it."""
    from ckptrepo.loading import _engine
    other = ckptrepo.init(str(tmp_path / "other"))
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"w": torch.zeros(1000)}, step=1).id
    ovid = other.snapshot({"w": torch.ones(1000)}, step=1, message=vid)
    # the other repository's array, reachable from this one's root through the forged key
    (tmp_path / "other" / "data" / ovid.id).rename(tmp_path / "other" / "data" / vid)
    own = f"data/{vid}/0/float32"
    _edit_manifest(path, vid, lambda m: _rekey(m, own, key.format(vid=vid)))
    for direct in (True, False):
        monkeypatch.setattr(_engine, "DIRECT_READS", direct)
        with pytest.raises(CorruptionError, match=f"manifest versions/{vid}: array key .* is not data/<id>/<rank>/"
                                                  f"<dtype>|manifest versions/{vid}: array .* dtype"):
            ckptrepo.open(str(path)).load(vid)
    r = run("fsck", repo=str(path))
    assert r.returncode != 0 and f"versions/{vid}" in r.stdout + r.stderr


@pytest.mark.parametrize("field, value, needle", [
    ("numel", -1, "no whole sizes"), ("inner_elems", 0, "no whole sizes"), ("numel", 2.5, "no whole sizes"),
    ("shard_elems", 1000, "not a whole number of"), ("numel", True, "no whole sizes"),
    ("shard_elems", 1 << 40, "shards of"), ("numel", 1 << 62, "a size of"),
])
def test_a_manifest_declaring_an_impossible_geometry_is_refused_when_decoded(tmp_path, field, value, needle):
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"w": torch.zeros(1000)}, step=1).id

    def edit(m: dict[str, Any]) -> None:
        a = m["arrays"][f"data/{vid}/0/float32"]
        a[field] = value
        if field == "shard_elems" and value > 1000:
            a["inner_elems"] = value
    _edit_manifest(path, vid, edit)
    with pytest.raises(CorruptionError, match=f"manifest versions/{vid}: array .*{needle}"):
        ckptrepo.open(str(path)).load(vid)
    assert not ckptrepo.open(str(path)).fsck().ok


def _inflate(path: Path, vid: str, numel: int, shard: int | None = None, inner: int | None = None) -> str:
    """Make tensor ``w`` (the float32 array, 1000 elements) declare ``numel`` elements, in the manifest and in
    the array's ``zarr.json`` (which has no checksum), so that every check but the stored sizes agrees."""
    key = f"data/{vid}/0/float32"

    def edit(m: dict[str, Any]) -> None:
        a = m["arrays"][key]
        a["numel"] = numel
        if shard is not None:
            a["shard_elems"], a["inner_elems"] = shard, inner
        t = next(t for t in m["tensors"] if t["name"] == "w")
        t["shape"] = [numel]
        t["pieces"][0]["box"] = [[0], [numel]]
        # a chunk table of the declared length, its digest in the manifest: the forgery is consistent there too
        table = np.zeros(-(-numel // a["inner_elems"]), dtype="<u4")
        (path / table_key(key)).write_bytes(table.tobytes())
        a["digest"] = table_digest(table)
    _edit_manifest(path, vid, edit)
    meta_file = path / key / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["shape"] = [numel]
    if shard is not None:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [shard]
        meta["codecs"][0]["configuration"]["chunk_shape"] = [inner]
    meta_file.write_text(json.dumps(meta))
    return key


def _max_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("numel, shard, inner, damage", [
    (1 << 31, None, None, "c/1 is missing (it does not exist)"),           # 8 GiB in 1024-element shards
    (1 << 33, 1 << 28, 1 << 14, "c/0 is corrupt ("),  # 2^33 elements in 1 GiB shards
])
def test_a_declared_size_the_shards_cannot_hold_fails_before_allocating(tmp_path, numel, shard, inner, damage):
    """A manifest declaring an 8 GiB tensor over a tiny shard allocated the 8 GiB (bad_alloc under a memory
    cap); 2^33 elements or more ended in a bare RuntimeError. The shard objects are looked at first."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"w": torch.randn(1000)}, step=1).id
    key = _inflate(path, vid, numel, shard, inner)
    before = _max_rss_mb()
    for direct in (True, False):
        from ckptrepo.loading import _engine
        saved, _engine.DIRECT_READS = _engine.DIRECT_READS, direct
        try:
            got = no_hang(lambda: ckptrepo.open(str(path)).load(vid), path)
        finally:
            _engine.DIRECT_READS = saved
        assert isinstance(got, CorruptionError), got
        assert f"object {key}/{damage}" in str(got) and "affected tensors: w;" in str(got), got
    assert _max_rss_mb() - before < 1024
    report = no_hang(lambda: ckptrepo.open(str(path)).fsck(), path)
    assert not report.ok and any(f"{key}/{damage.split(' (')[0]}" in e for e in report.errors), report.errors
    missing = [e for e in report.errors if "missing" in e or "lacks" in e]
    assert len(missing) <= 6, report.errors   # thousands of declared shards: a few named, the rest counted


def test_fsck_does_not_allocate_a_declared_16_gib_shard_index(tmp_path):
    """One inner chunk per element and 2^30 per shard: a 16 GiB index that fsck's read allocated (5.5 GB
    RSS, then an abort). The geometry is refused when the manifest is decoded."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"w": torch.randn(1000)}, step=1).id
    _inflate(path, vid, 1 << 30, shard=1 << 30, inner=1)
    before = _max_rss_mb()
    report = no_hang(lambda: ckptrepo.open(str(path)).fsck(), path)
    assert not report.ok and any("shard index of 17179869184 bytes" in e for e in report.errors), report.errors
    assert _max_rss_mb() - before < 1024
    with pytest.raises(CorruptionError, match="shard index"):
        ckptrepo.open(str(path)).load(vid)


def test_a_load_still_reads_arrays_whose_shards_are_larger_than_their_floor(tmp_path):
    """The stored-size check is a floor: chunks written from memory sit in aligned slots, so a real shard is
    often larger than its chunks and index; a multi-shard array loads as before."""
    from support.ckpt_workers import SMALL_HOST_MEMORY, assert_same, make_state
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    with repo.snapshotter(host_memory=SMALL_HOST_MEMORY) as snap:
        vid = snap.snapshot(make_state(3), step=3).result().id
    assert_same(ckptrepo.open(str(path)).load(vid), make_state(3))
    assert ckptrepo.open(str(path)).fsck().ok


def test_a_tensor_too_big_for_memory_is_named_not_a_bare_runtime_error(tmp_path, monkeypatch):
    """Once the stored objects back the declared sizes, what fails is memory: torch's RuntimeError becomes
    one line naming the tensors and their bytes."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"big": torch.randn(100_000), "small": torch.randn(10)}, step=1).id
    real_empty = torch.empty

    def empty(*shape: Any, **kwargs: Any) -> torch.Tensor:   # a memory cap, as DefaultCPUAllocator reports it
        n = 1
        for d in (shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, torch.Size)) else shape):
            n *= d
        if n >= 100_000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 400000 bytes")
        return real_empty(*shape, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(MemoryError, match=r"not enough memory for tensor\(s\) big.* \(40\d+ bytes\): .*can.t allocate"):
        ckptrepo.open(str(path)).load(vid)
