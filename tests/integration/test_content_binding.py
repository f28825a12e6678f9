"""Content binding (format 2): a version's arrays are checked against the chunk table its manifest names, so a
swapped, stale or foreign object is named as corruption on every read path and by fsck."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import ckptrepo
import ckptrepo.loading._engine as engine
from ckptrepo.core._manifest import seal
from ckptrepo.errors import CorruptionError
from ckptrepo.storage._arrays import open_array
from ckptrepo.storage._chunktable import TABLE_NAME, chunk_crcs, read_table, table_key

FIXTURE = Path(__file__).parent.parent / "fixtures" / "format1_repo"


def _two_versions(root: str) -> tuple[ckptrepo.Repository, str, str, dict[str, torch.Tensor]]:
    repo = ckptrepo.init(root)
    state = {"w": torch.randn(700, 300), "b": torch.randn(300)}
    parent = repo.snapshot(state, step=1).id
    state = {k: v + 1 for k, v in state.items()}
    head = repo.snapshot(state, step=2).id
    return repo, parent, head, state


def _shard(root: str, vid: str, n: int = 0) -> str:
    return os.path.join(root, "data", vid, "0", "float32", "c", str(n))


@pytest.fixture(params=["direct", "tensorstore"])
def read_path(request, monkeypatch):
    if request.param == "tensorstore":
        monkeypatch.setattr(engine, "DIRECT_READS", False)
    return request.param


def test_a_shard_swapped_with_the_parents_is_named_by_load_and_fsck(tmp_path, read_path):
    root = str(tmp_path / "r")
    repo, parent, head, _ = _two_versions(root)
    shutil.copy(_shard(root, parent), _shard(root, head))
    with pytest.raises(CorruptionError, match=f"data/{head}/0/float32/c/0 holds data the manifest does not name"):
        repo.load("HEAD")
    assert repo.load(parent)   # the parent's own data still loads
    report = repo.fsck()
    assert not report.ok
    assert any(f"data/{head}/0/float32/c/0 holds data its manifest does not name" in e for e in report.errors)


def test_a_whole_array_copied_from_another_version_is_refused(tmp_path, read_path):
    root = str(tmp_path / "r")
    repo, parent, head, _ = _two_versions(root)
    dst = os.path.join(root, "data", head, "0", "float32")
    shutil.rmtree(dst)
    shutil.copytree(os.path.join(root, "data", parent, "0", "float32"), dst)
    # named by its chunk table, or by its zarr.json when the copy's length differs (TensorStore opens it first)
    with pytest.raises(CorruptionError, match=f"{TABLE_NAME} does not match the manifest|float32 is corrupt"):
        repo.load("HEAD")
    assert not repo.fsck().ok


def test_a_missing_chunk_table_is_named(tmp_path, read_path):
    root = str(tmp_path / "r")
    repo, _, head, _ = _two_versions(root)
    os.remove(os.path.join(root, table_key(f"data/{head}/0/float32")))
    with pytest.raises(CorruptionError, match=f"data/{head}/0/float32/{TABLE_NAME} is missing"):
        repo.load("HEAD")
    assert any("is missing" in e for e in repo.fsck().errors)


def test_the_intact_repository_loads_bit_exact_on_both_paths(tmp_path, read_path):
    repo, _, _, state = _two_versions(str(tmp_path / "r"))
    out = repo.load("HEAD")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    report = repo.fsck()
    assert report.ok and not report.warnings


@pytest.mark.parametrize("where", ["local", "memory"])
def test_each_writers_chunk_table_is_the_crc32c_of_the_stored_chunks(tmp_path, where):
    """The direct writer takes each chunk's crc32c as it writes; TensorStore's path takes them before its write."""
    state = {"w": torch.randn(1000, 100), "i": torch.arange(7), "h": torch.randn(70_000).half()}
    repo = ckptrepo.init(str(tmp_path / "r") if where == "local" else "memory://binding-writers")
    vid = repo.snapshot(state, step=0).id
    for info in repo.plumbing.manifest(vid).arrays.values():
        stored = open_array(repo.plumbing.store, info).read().result()
        table = read_table(repo.plumbing.store, info)
        assert table is not None and table.tolist() == chunk_crcs(info, stored.view(np.uint8)).tolist()


def _reseal(root: str, vid: str, change) -> None:
    path = os.path.join(root, "versions", vid)
    with open(path, "rb") as f:
        raw = msgpack.unpackb(f.read()[:-4], raw=False, strict_map_key=False)
    change(raw)
    with open(path, "wb") as f:
        f.write(seal(raw))


def test_a_resealed_piece_moved_1024_elements_on_is_refused(tmp_path):
    root = str(tmp_path / "r")
    repo, _, head, _ = _two_versions(root)

    def shift(raw):
        first = raw["tensors"][0]["pieces"][0]
        first["offset"] += 1024
    _reseal(root, head, shift)
    with pytest.raises(CorruptionError, match="overlap in array|outside its box or array"):
        repo.load("HEAD")
    assert not repo.fsck().ok


def test_a_resealed_piece_pointing_into_another_versions_array_is_caught_by_fsck(tmp_path):
    """The parent's array verifies, so only its manifest can say the piece is not one the parent stored."""
    root = str(tmp_path / "r")
    repo, parent, head, _ = _two_versions(root)
    key = f"data/{parent}/0/float32"

    def foreign(raw):
        raw["arrays"][key] = raw["arrays"][f"data/{head}/0/float32"] | {}
        raw["arrays"][key]["digest"] = repo.plumbing.manifest(parent).arrays[key].digest
        for t in raw["tensors"]:
            if t["name"] == "b":
                t["pieces"][0]["array"] = key
                t["pieces"][0]["offset"] = 1024   # valid bytes of the parent's "w", not a piece it stored
    _reseal(root, head, foreign)
    report = repo.fsck()
    assert any(f"tensor b points into {key} at element 1024" in e for e in report.errors), report.errors


def test_a_piece_deduplicated_into_the_parents_array_passes(tmp_path):
    repo = ckptrepo.init(str(tmp_path / "r"))
    frozen, moving = torch.randn(300, 300), torch.randn(10)
    with repo.snapshotter() as snap:
        for step in range(3):
            moving += 1
            snap.snapshot({"frozen": frozen, "moving": moving}, step=step).result()
    head = repo.plumbing.manifest(repo.resolve("HEAD"))
    assert any(not p.array.startswith(f"data/{head.id}/") for t in head.tensors for p in t.pieces)
    report = repo.fsck()
    assert report.ok and not report.warnings, report
    assert torch.equal(repo.load("HEAD")["frozen"], frozen)


def test_format1_versions_load_and_fsck_calls_them_not_content_bound(tmp_path):
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    repo = ckptrepo.open(str(root))
    report = repo.fsck()
    assert report.ok
    assert any("not content-bound" in w for w in report.warnings)
    # a new version in the old repository is content-bound: its arrays carry the digest
    vid = repo.snapshot({"x": torch.ones(3)}, step=99).id
    assert all(a.digest is not None for a in repo.plumbing.manifest(vid).arrays.values())


def test_a_format2_array_without_its_digest_is_damage(tmp_path):
    root = str(tmp_path / "r")
    repo, _, head, _ = _two_versions(root)
    _reseal(root, head, lambda raw: raw["arrays"][f"data/{head}/0/float32"].pop("digest"))
    assert any("has no chunk-table digest" in e for e in repo.fsck().errors)
