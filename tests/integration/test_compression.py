"""Lossless compression, opt-in per repository (zarr v3 ``blosc`` with zstd after a byte shuffle)."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from support.dist_workers import SPLIT_RULES
from support.helpers import assert_bit_exact, run

import ckptrepo
from ckptrepo.errors import ArgumentError, CorruptionError
from ckptrepo.loading._engine import kvstore_bytes_read
from ckptrepo.parallel.layout import ParallelLayout

INDEX_BYTES = 64 << 10   # shard indexes, read once per shard


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors like a model's: bf16 weights, small fp32 Adam-like moments, fp16, and an int counter."""
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16),
            "exp_avg_sq": torch.randn(256, 1024, generator=g).square() * 1e-8,
            "h": torch.randn(4096, generator=g).half(),
            "step": torch.arange(7)}


def _arrays(repo: ckptrepo.Repository, rev: str = "HEAD") -> dict:
    """The arrays version ``rev`` wrote (not those it reuses through dedup, which keep their own records)."""
    vid = repo.resolve(rev)
    return {k: a for k, a in repo.plumbing.manifest(vid).arrays.items() if k.startswith(f"data/{vid}/")}


def test_init_records_it_and_snapshots_follow_the_repository(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "r"), compression="zstd")
    assert json.loads((tmp_path / "r" / "ckptrepo.json").read_text())["compression"] == "zstd"
    state = _state()
    repo.snapshot(state, step=1)
    arrays = _arrays(repo)
    assert {a.compression for a in arrays.values()} == {"zstd"}
    for key, info in arrays.items():
        meta = json.loads((tmp_path / "r" / key / "zarr.json").read_text())
        inner = meta["codecs"][0]["configuration"]["codecs"]
        assert [c["name"] for c in inner] == ["bytes", "blosc", "crc32c"]
        assert inner[1]["configuration"] | {} == {"cname": "zstd", "clevel": 1, "shuffle": "shuffle",
                                                  "typesize": info.itemsize, "blocksize": 0}
        assert info.to_json()["compression"] == "zstd"
    assert_bit_exact(ckptrepo.open(str(tmp_path / "r")).load(), state)
    # bf16 weights and tiny fp32 moments compress: their exponents are few
    data = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "r" / "data") for f in fs)
    assert data < 0.9 * sum(t.numel() * t.element_size() for t in state.values())
    assert repo.du().stored_bytes == data   # du counts what the objects take


def test_a_snapshotter_overrides_the_repository_and_history_mixes(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "r"))
    with repo.snapshotter(compression="zstd") as snap:
        snap.snapshot(_state(1), step=1).result()
    with repo.snapshotter(compression=False) as snap:
        snap.snapshot(_state(2), step=2).result()
    repo.snapshot(_state(3), step=3)   # the repository's setting: none
    assert {a.compression for a in _arrays(repo, "HEAD~2").values()} == {"zstd"}
    assert {a.compression for a in _arrays(repo, "HEAD~1").values()} == {None}
    assert all("compression" not in a.to_json() for a in _arrays(repo).values())   # plain records as before
    for k, rev in enumerate(["HEAD~2", "HEAD~1", "HEAD"], start=1):
        assert_bit_exact(repo.load(rev), _state(k))
    assert repo.fsck().errors == []


def test_dedup_keeps_the_reused_arrays_own_record(tmp_path) -> None:
    """A version that reuses stored bytes points at the array as it was written, compressed or not."""
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = _state()
    with repo.snapshotter(compression="none") as snap:
        snap.snapshot(state, step=1).result()
        state["step"] = state["step"] + 1   # a new tensor: written again; the others are reused
        snap.snapshot(state, step=2).result()
    with repo.snapshotter(compression="zstd") as snap:
        state["h"] = state["h"] + 1
        snap.snapshot(state, step=3).result()
    def listed(rev: str) -> dict:
        return dict(repo.plumbing.manifest(repo.resolve(rev)).arrays)
    first = listed("HEAD~2")
    for rev in ("HEAD~1", "HEAD"):
        arrays = listed(rev)
        assert all(arrays[k] == first[k] for k in set(first) & set(arrays))
        own = [a for k, a in arrays.items() if repo.resolve(rev) in k]
        assert own and {a.compression for a in own} == ({None} if rev == "HEAD~1" else {"zstd"})
    assert set(first) & set(listed("HEAD~1"))   # reused within the first snapshotter
    assert set(first) & set(listed("HEAD"))     # and by the next, which compares with the branch tip
    assert_bit_exact(repo.load(), state)


@pytest.mark.parametrize("bad", ["lz4", "ZSTD", 3, True])
def test_an_unknown_compression_is_refused_in_one_line(tmp_path, bad) -> None:
    with pytest.raises(ArgumentError) as err:
        ckptrepo.init(str(tmp_path / "r"), compression=bad)
    assert "'zstd', 'none' or None" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "r" / "ckptrepo.json").exists()
    repo = ckptrepo.init(str(tmp_path / "r"))
    with pytest.raises(ArgumentError):
        repo.snapshotter(compression=bad)


def test_cli_init_takes_compression(tmp_path) -> None:
    url = str(tmp_path / "r")
    r = run("init", url, "--compression", "zstd")
    assert r.returncode == 0, r.stderr
    assert ckptrepo.open(url).plumbing.config["compression"] == "zstd"
    r = run("init", url, "--exist-ok", "--compression", "none")
    assert r.returncode == 0, r.stderr
    assert ckptrepo.open(url).plumbing.config["compression"] is None
    r = run("init", str(tmp_path / "r2"), "--compression", "lz4")
    assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr


def test_a_version_reads_bit_exact_with_zarr_python_and_tensorstore_alone(tmp_path) -> None:
    zarr = pytest.importorskip("zarr")
    import tensorstore as ts
    repo = ckptrepo.init(str(tmp_path / "r"), compression="zstd")
    state = _state()
    repo.snapshot(state, step=1)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    for t in m.tensors:
        (piece,) = t.pieces
        path = str(tmp_path / "r" / piece.array)
        n = int(np.prod(piece.box[1]))
        want = state[t.name].reshape(-1)
        want = want.view(torch.int16).numpy() if want.dtype == torch.bfloat16 else want.numpy()
        by_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()[
            piece.offset:piece.offset + n].read().result()
        assert np.asarray(by_ts).tobytes() == want.tobytes(), t.name
        if t.dtype != "bfloat16":   # zarr-python has no bfloat16 data type (TensorStore's, from ml_dtypes)
            by_zarr = zarr.open_array(path, mode="r")[piece.offset:piece.offset + n]
            assert np.asarray(by_zarr).tobytes() == want.tobytes(), t.name


def test_a_layout_load_reads_only_the_chunks_it_needs(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    full = {"col.weight": torch.randn(2048, 512, generator=g),    # 4 MiB each, random: barely compresses
            "row.weight": torch.randn(512, 2048, generator=g), "norm.weight": torch.randn(2048, generator=g)}
    repo = ckptrepo.init(str(tmp_path / "r"), compression="zstd")
    repo.snapshot({"model": full}, step=1)
    for name, rank, want in (("col.weight", 1, full["col.weight"].chunk(2, dim=0)[1]),
                             ("norm.weight", 1, full["norm.weight"])):
        into = {"model": {name: torch.empty(want.shape)}}
        before = kvstore_bytes_read()
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=SPLIT_RULES), rank=rank, into=into)
        read = kvstore_bytes_read() - before
        assert torch.equal(into["model"][name], want)
        assert read <= want.numel() * 4 * 1.02 + 2 * (64 << 10) + INDEX_BYTES + 4096, (name, read)


def _flip_in_first_chunk(shard: str) -> None:
    with open(shard, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_corrupted_compressed_chunk_is_detected_and_named(tmp_path) -> None:
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url, compression="zstd")
    repo.snapshot(_state(), step=1)
    key = next(k for k in _arrays(repo) if k.endswith("/float32"))
    _flip_in_first_chunk(os.path.join(url, key, "c", "0"))
    with pytest.raises(CorruptionError, match=f"{key}/c/0"):
        ckptrepo.open(url).load()
    errors = ckptrepo.open(url).fsck().errors
    assert any(f"{key}/c/0" in e for e in errors), errors


def test_another_versions_compressed_shard_is_caught_by_the_chunk_table(tmp_path) -> None:
    """The table holds each chunk's crc32c over its decoded bytes: a valid shard of another version fails it."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url, compression="zstd")
    repo.snapshot(_state(1), step=1)
    repo.snapshot(_state(2), step=2)
    old, new = (next(k for k in _arrays(repo, rev) if k.endswith("/bfloat16")) for rev in ("HEAD~1", "HEAD"))
    with open(os.path.join(url, old, "c", "0"), "rb") as f:
        data = f.read()
    with open(os.path.join(url, new, "c", "0"), "wb") as f:
        f.write(data)
    with pytest.raises(CorruptionError, match="another version's or stale"):
        ckptrepo.open(url).load()
    assert any("another version's or stale" in e for e in ckptrepo.open(url).fsck().errors)


def test_a_clone_copies_compressed_versions(tmp_path) -> None:
    src = ckptrepo.init(str(tmp_path / "a"), compression="zstd")
    src.snapshot(_state(), step=1)
    clone = ckptrepo.clone(str(tmp_path / "a"), str(tmp_path / "b"))
    assert_bit_exact(clone.load(), _state())
    assert clone.fsck().errors == []


# ---- compressed chunks on the direct local read path ----------------------------------------------------------
def _shard_bytes(root, arrays: dict) -> int:
    return sum(os.path.getsize(os.path.join(root, k, "c", f)) for k in arrays for f in os.listdir(root / k / "c"))


def test_a_local_load_inflates_compressed_chunks_on_the_direct_path(tmp_path) -> None:
    """The direct reader reads every compressed frame itself (counted by its own byte counter, not TensorStore's)
    and the tensors come back bit-exact, a short last chunk and tensors sharing chunks included."""
    from ckptrepo.storage import bytes_read
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url, compression="zstd")
    state = _state() | {"odd": torch.randn(70_001, generator=torch.Generator().manual_seed(5))}
    repo.snapshot(state, step=1)
    stored = _shard_bytes(tmp_path / "r", _arrays(repo))
    before = bytes_read()
    assert_bit_exact(ckptrepo.open(url).load(), state)
    direct = bytes_read() - before
    assert stored <= direct <= stored + 4096, (direct, stored)   # every frame and index, once
    into = {k: torch.empty_like(v) for k, v in state.items()}
    ckptrepo.open(url).load(into=into)
    assert_bit_exact(into, state)


@pytest.mark.parametrize("name,dim", [("row.weight", 1), ("col.weight", 0)])
def test_a_compressed_layout_load_is_bit_exact_on_both_read_paths(tmp_path, monkeypatch, name, dim) -> None:
    """Rows of a row-parallel split (strided targets) and blocks of a column split, from compressed chunks."""
    from ckptrepo.loading import _engine
    g = torch.Generator().manual_seed(0)
    full = {"col.weight": torch.randn(1024, 96, generator=g) * 0.02, "row.weight": torch.randn(96, 1024, generator=g),
            "norm.weight": torch.randn(96, generator=g)}
    repo = ckptrepo.init(str(tmp_path / "r"), compression="zstd")
    repo.snapshot({"model": full}, step=1)
    for direct in (True, False):
        monkeypatch.setattr(_engine, "DIRECT_READS", direct)
        for rank in range(4):
            want = full[name].chunk(4, dim=dim)[rank]
            into = {"model": {name: torch.empty(want.shape)}}
            repo.load("HEAD", parallel_layout=ParallelLayout(tp=4, rules=SPLIT_RULES), rank=rank, into=into)
            assert torch.equal(into["model"][name], want), (direct, rank)


def _rewrite_frame(shard: str, chunk: int, chunks: int, change) -> None:
    """Change inner chunk ``chunk``'s blosc frame with ``change(bytearray)`` and restore its crc32c."""
    from ckptrepo.storage._crc import crc32c
    with open(shard, "r+b") as f:
        raw = f.read()
        offset, size = np.frombuffer(raw[-16 * chunks - 4:-4], dtype="<u8").reshape(chunks, 2)[chunk].tolist()
        frame = bytearray(raw[offset:offset + size - 4])
        change(frame)
        f.seek(offset)
        f.write(bytes(frame) + crc32c(bytes(frame)).to_bytes(4, "little"))


@pytest.mark.parametrize("how", ["cbytes", "stream"])
def test_a_frame_with_a_valid_crc32c_that_lies_is_refused_and_named(tmp_path, how) -> None:
    """A frame whose crc32c was restored after a change: one whose header claims more compressed bytes than are
    stored (the codec would read past them), or whose stream was changed (it inflates to other bytes, which the
    chunk table catches). Either is corruption, named, on the direct path and through TensorStore alike."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url, compression="zstd")
    state = _state()
    repo.snapshot(state, step=1)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    info = m.arrays[next(t for t in m.tensors if t.name == "w").pieces[0].array]

    def change(frame: bytearray) -> None:
        if how == "cbytes":
            frame[12:16] = (len(frame) + 4096).to_bytes(4, "little")
        else:
            frame[len(frame) // 2] ^= 0x01
    _rewrite_frame(str(tmp_path / "r" / info.key / "c" / "0"), 1, info.shard_elems // info.inner_elems, change)
    with pytest.raises(CorruptionError, match=f"{info.key}"):
        ckptrepo.open(url).load()
    assert any(info.key in e for e in ckptrepo.open(url).fsck().errors)


def test_without_numcodecs_tensorstore_decodes(tmp_path) -> None:
    """numcodecs is what the direct path inflates with; where it is missing, compressed loads stay correct."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url, compression="zstd")
    repo.snapshot(_state(), step=1)
    code = ("import sys; sys.modules['numcodecs'] = None\n"
            "import torch, ckptrepo\nfrom ckptrepo.storage import bytes_read\n"
            f"out = ckptrepo.open({url!r}).load()\n"
            "import hashlib\nwords = {k: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()"
            " for k, t in sorted(out.items())}\n"
            "print(bytes_read(), ' '.join(words.values()))\n")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    direct, *words = done.stdout.split()
    assert int(direct) < 4096   # only metadata, no frame, went through the direct reader
    expected = [hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
                for _, t in sorted(_state().items())]
    assert words == expected   # bit-exact: every tensor's bytes, not a float sum whose order may differ
