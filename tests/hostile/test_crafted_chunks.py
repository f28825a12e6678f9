"""Crafted chunks (issue 39): stored bytes changed so that every chunk checksum still passes, and compressed
chunks that inflate far beyond their declared size.

A crc32c is linear: changing a chunk's values and then 4 bytes solved for keeps its crc32c, so the stored
checksum, the chunk table and the table's digest all stay valid. Only the piece's content digest (xxh3-128
of its bytes, in the manifest) tells; load and fsck check it where they hold a piece whole.
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptrepo
import ckptrepo.loading._engine as engine
from ckptrepo.errors import CorruptionError, DigestMismatchError
from ckptrepo.loading import _device_load
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.storage import _localread
from ckptrepo.storage._crc import crc32c

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "crafted chunks"


# ---- the crc32c-preserving change ---------------------------------------------------------------------------
def restore_crc(buf: bytearray, pos: int, target: int) -> None:
    """Change the 4 bytes of ``buf`` at ``pos`` so that its crc32c is ``target``.

    For a fixed length, crc(x ^ e) = crc(x) ^ crc(e) ^ crc(zeros): flipping bit i of the 4 bytes changes the
    crc by a fixed vector ``col[i]``. Solving ``sum col[i] = crc(buf) ^ target`` over GF(2) (32 equations, 32
    unknowns) gives the bits to flip."""
    n = len(buf)
    zero = crc32c(bytes(n))
    cols = []
    for bit in range(32):
        e = bytearray(n)
        e[pos + bit // 8] = 1 << (bit % 8)
        cols.append(crc32c(bytes(e)) ^ zero)
    want = crc32c(bytes(buf)) ^ target
    # Gaussian elimination on the augmented columns: rows are the 32 crc bits
    rows = [(sum(((cols[j] >> r) & 1) << j for j in range(32)), (want >> r) & 1) for r in range(32)]
    pivots: list[tuple[int, int, int]] = []   # (bit, row mask, rhs)
    for mask, rhs in rows:
        for pbit, pmask, prhs in pivots:
            if mask >> pbit & 1:
                mask, rhs = mask ^ pmask, rhs ^ prhs
        if mask:
            pbit = mask.bit_length() - 1
            pivots = [(b, m ^ mask if m >> pbit & 1 else m, r ^ rhs if m >> pbit & 1 else r) for b, m, r in pivots]
            pivots.append((pbit, mask, rhs))
        else:
            assert rhs == 0, "no solution at this position"
    for pbit, _mask, rhs in pivots:   # reduced: each pivot row names its bit alone (free bits stay 0)
        if rhs:
            buf[pos + pbit // 8] ^= 1 << (pbit % 8)
    assert crc32c(bytes(buf)) == target


VALUES = b"\x00\x00\x80\x7f" * 4   # four float32 infinities


def change_keeping_crc(shard: str, inner_bytes: int, chunks: int, chunk: int, at: int, values: bytes = VALUES) -> None:
    """Overwrite bytes ``at...`` of inner chunk ``chunk`` of a plain shard object with ``values`` and restore the
    chunk's crc32c through the 4 bytes 64 further on: the shard index, the chunk's stored crc32c and the chunk
    table stay valid."""
    with open(shard, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - 16 * chunks - 4)
        index = np.frombuffer(f.read(16 * chunks), dtype="<u8").reshape(chunks, 2)
        offset, nbytes = int(index[chunk, 0]), int(index[chunk, 1])
        assert nbytes == inner_bytes + 4
        f.seek(offset)
        raw = bytearray(f.read(inner_bytes))
        crc = int.from_bytes(f.read(4), "little")
        assert crc32c(bytes(raw)) == crc
        raw[at:at + len(values)] = values
        restore_crc(raw, at + 64, crc)
        f.seek(offset)
        f.write(bytes(raw))


def _repo(root: Path) -> tuple[ckptrepo.Repository, dict[str, torch.Tensor]]:
    repo = ckptrepo.init(str(root))
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(300, generator=g)}   # w: 1 MiB, 16 chunks
    repo.snapshot(state, step=1)
    return repo, state


def _craft(repo: ckptrepo.Repository, root: Path, tensor: str = "w", k: int = 0) -> str:
    """Change the first chunk of ``tensor``'s piece ``k`` keeping every crc32c; returns the version id."""
    vid = repo.resolve("HEAD")
    m = repo.plumbing.manifest(vid)
    piece = next(t for t in m.tensors if t.name == tensor).pieces[k]
    info = m.arrays[piece.array]
    first = piece.offset // info.inner_elems
    shard = root / piece.array / "c" / str(first // (info.shard_elems // info.inner_elems))
    per_shard = info.shard_elems // info.inner_elems
    change_keeping_crc(str(shard), info.inner_bytes, per_shard, first % per_shard,
                       (piece.offset % info.inner_elems) * info.itemsize)
    return vid


@pytest.fixture(params=["direct", "tensorstore"])
def read_path(request, monkeypatch):
    if request.param == "tensorstore":
        monkeypatch.setattr(engine, "DIRECT_READS", False)
    else:   # small reader tasks: a piece spans many, which finish in any order
        monkeypatch.setattr(_localread, "DIRECT_TASK_BYTES", 64 << 10)
    return request.param


def test_the_crafted_change_keeps_every_chunk_check(tmp_path):
    """The premise: the changed chunk still reads through TensorStore's crc32c and the chunk table."""
    repo, state = _repo(tmp_path / "r")
    vid = _craft(repo, tmp_path / "r")
    m = repo.plumbing.manifest(vid)
    (piece,) = next(t for t in m.tensors if t.name == "w").pieces
    from ckptrepo.storage._arrays import open_array
    from ckptrepo.storage._chunktable import chunk_crcs, first_mismatch, read_table
    info = m.arrays[piece.array]
    raw = np.asarray(open_array(repo.plumbing.store, info)[0:info.numel].read().result()).view(np.uint8)
    assert first_mismatch(read_table(repo.plumbing.store, info), 0, chunk_crcs(info, raw)) is None
    assert raw[piece.offset * 4:(piece.offset + 4) * 4].tobytes() == VALUES   # the values changed


def test_load_names_the_changed_piece(tmp_path, read_path):
    repo, state = _repo(tmp_path / "r")
    vid = _craft(repo, tmp_path / "r")
    with pytest.raises(DigestMismatchError, match=rf"version {vid[:12]}: tensor w, piece at \[0, 0\] of size "
                                                  rf"\[256, 1024\] .*does not match the content digest"):
        repo.load("HEAD")
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD", into=into)
    with pytest.raises(DigestMismatchError, match="tensor w"):   # a layout load reads each piece whole here
        repo.load("HEAD", parallel_layout=ParallelLayout(), rank=0)


def test_a_small_tensor_read_with_its_neighbours_is_named(tmp_path, read_path):
    """A tensor that shares a reader task with others (checked together once that task is done)."""
    repo, _ = _repo(tmp_path / "r")
    _craft(repo, tmp_path / "r", "b")
    with pytest.raises(DigestMismatchError, match=r"tensor b, piece at \[0\] of size \[300\]"):
        repo.load("HEAD")


def test_an_intact_repository_loads_bit_exact(tmp_path, read_path):
    """No false alarm: every tensor read whole, many sharing chunks, on either path and into given tensors."""
    repo, state = _repo(tmp_path / "r")
    g = torch.Generator().manual_seed(1)
    state.update({f"s{i}": torch.randn(i + 1, generator=g).to(dt) for i, dt in
                  enumerate([torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8] * 4)})
    repo.snapshot(state, step=2)
    out = repo.load("HEAD")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    repo.load("HEAD", into=into)
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert repo.fsck().ok


def test_the_device_pipeline_checks_what_it_stages(tmp_path, monkeypatch):
    """The GPU load path hashes the staged host bytes; here with the CPU standing in for the device and
    buffers far smaller than the tensor, so its digest is taken over many batches, in order."""
    monkeypatch.setattr(_device_load, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_device_load, "BUFFER_BYTES", 64 << 10)
    monkeypatch.setattr(_device_load, "BUFFERS", 3)
    repo, state = _repo(tmp_path / "r")
    out = repo.load("HEAD", device="cpu")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    out = repo.load("HEAD", parallel_layout=ParallelLayout(), rank=0)   # target pieces, each cut over 16 batches
    assert all(torch.equal(out[k], v) for k, v in state.items())
    _craft(repo, tmp_path / "r")
    _plain_and_layout_loads_name_w(repo)


def _plain_and_layout_loads_name_w(repo: ckptrepo.Repository) -> None:
    """Both a plain load and a layout load of HEAD refuse tensor ``w``, whose first chunk ``_craft`` changed."""
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD", device="cpu")
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD", parallel_layout=ParallelLayout(), rank=0)


def test_column_blocks_loaded_into_whole_rows_are_checked(tmp_path, read_path):
    """A tensor saved as column blocks and loaded into whole rows: each block lands in strided rows of the target
    (the direct reader copies them there chunk by chunk), and is still checked whole."""
    from ckptrepo.rules import Rules, Split
    repo = ckptrepo.init(str(tmp_path / "r"))
    g = torch.Generator().manual_seed(5)
    state = {"short": torch.randn(96, 3000, generator=g)}
    repo.snapshot({"model": state}, step=1, parallel_layout=ParallelLayout(rules=Rules([("short", Split(1))])))
    pieces = next(t for t in repo.plumbing.manifest(repo.resolve("HEAD")).tensors if t.name == "model/short").pieces
    assert len(pieces) > 1
    into = {"short": torch.full_like(state["short"], float("nan"))}
    repo.load("HEAD", into={"model": into})
    assert torch.equal(into["short"], state["short"])
    _craft(repo, tmp_path / "r", "model/short", 1)
    box = pieces[1].box
    with pytest.raises(DigestMismatchError, match=rf"tensor model/short, piece at \[{box[0][0]}, {box[0][1]}\]"):
        repo.load("HEAD", into={"model": into})


def test_fsck_names_the_changed_piece(tmp_path):
    repo, _ = _repo(tmp_path / "r")
    vid = _craft(repo, tmp_path / "r")
    report = repo.fsck()
    assert not report.ok
    assert any(e.startswith(f"version {vid[:12]}: tensor w, piece at [0, 0] of size [256, 1024]")
               and "does not match the content digest" in e for e in report.errors), report.errors


def test_a_clone_of_a_changed_repository_is_refused_by_load_and_fsck(tmp_path, read_path):
    origin, _ = _repo(tmp_path / "origin")
    vid = _craft(origin, tmp_path / "origin")
    full = ckptrepo.clone(tmp_path / "origin", tmp_path / "full")
    with pytest.raises(DigestMismatchError, match=f"version {vid[:12]}: tensor w"):
        full.load("HEAD")
    assert any("tensor w" in e and "content digest" in e for e in full.fsck().errors)
    lazy = ckptrepo.clone(tmp_path / "origin", tmp_path / "lazy", lazy=True)   # read from the origin's store
    with pytest.raises(DigestMismatchError, match=f"version {vid[:12]}: tensor w"):
        lazy.load("HEAD")


def test_a_reused_piece_is_checked_where_it_is_stored(tmp_path):
    """A version that reuses an unchanged tensor (dedup) reads it from its parent's array: the check holds
    there too, and fsck names the piece once."""
    repo, state = _repo(tmp_path / "r")
    parent = repo.resolve("HEAD")
    state["b"] = state["b"] + 1
    repo.snapshot(state, step=2)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    assert next(t for t in m.tensors if t.name == "w").pieces[0].array.startswith(f"data/{parent}/")
    shutil.copytree(tmp_path / "r", tmp_path / "copy")   # a pristine copy: the old one must still load
    _craft(repo, tmp_path / "r")
    with pytest.raises(DigestMismatchError, match=f"version {parent[:12]}: tensor w"):
        repo.load("HEAD")
    errors = [e for e in repo.fsck().errors if "content digest" in e]
    assert len(errors) == 1, errors
    assert torch.equal(ckptrepo.open(str(tmp_path / "copy")).load("HEAD")["w"], state["w"])


def _reseal(root: Path, vid: str, change) -> None:
    import msgpack

    from ckptrepo.core._manifest import seal
    path = root / "versions" / vid
    raw = msgpack.unpackb(path.read_bytes()[:-4], raw=False, strict_map_key=False)
    change(raw)
    path.write_bytes(seal(raw))


def test_a_wordsum_digest_is_checked_on_the_host(tmp_path, read_path):
    """A CUDA snapshot records WORDSUM digests (taken on its device); a load without a GPU, and fsck, check them
    with the same function in numpy: as recorded, the state loads; changed, it is named."""
    from ckptrepo.saving._content_hash import wordsum_digests
    repo, state = _repo(tmp_path / "r")
    vid = repo.resolve("HEAD")

    def to_wordsum(raw):
        for t in raw["tensors"]:
            t["pieces"][0]["digest"] = wordsum_digests([state[t["name"]]])[0]
    _reseal(tmp_path / "r", vid, to_wordsum)
    assert repo.plumbing.manifest(vid).tensors[0].pieces[0].digest[0] == 2
    out = repo.load("HEAD")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert repo.fsck().ok
    _craft(repo, tmp_path / "r")
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD")
    assert any("tensor w" in e and "content digest" in e for e in repo.fsck().errors)


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_device_pipeline_checks_wordsum_on_the_device(tmp_path, monkeypatch, where):
    """A GPU load checks a CUDA snapshot's WORDSUM digests on the device, after the copies, with capture's own
    function (numpy's, on the host, would be slower than the reads); here with the CPU standing in for the
    device, and, for comparison, with the check on the host."""
    from ckptrepo.saving._content_hash import wordsum_digests
    monkeypatch.setattr(_device_load, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_device_load, "DEVICE_DIGESTS", ("cpu",) if where == "device" else ())
    monkeypatch.setattr(_device_load, "BUFFER_BYTES", 64 << 10)
    monkeypatch.setattr(_device_load, "BUFFERS", 3)
    repo, state = _repo(tmp_path / "r")

    def to_wordsum(raw):
        for t in raw["tensors"]:
            t["pieces"][0]["digest"] = wordsum_digests([state[t["name"]]])[0]
    _reseal(tmp_path / "r", repo.resolve("HEAD"), to_wordsum)
    for out in (repo.load("HEAD", device="cpu"), repo.load("HEAD", parallel_layout=ParallelLayout(), rank=0)):
        assert all(torch.equal(out[k], v) for k, v in state.items())
    _craft(repo, tmp_path / "r")
    _plain_and_layout_loads_name_w(repo)


def test_a_piece_without_a_digest_loads_unchecked(tmp_path, read_path):
    """Versions written before digests (or by the DCP and Megatron adapters) have none: nothing to check."""
    repo, state = _repo(tmp_path / "r")
    vid = repo.resolve("HEAD")

    def strip(raw):
        for t in raw["tensors"]:
            for p in t["pieces"]:
                p.pop("digest", None)
    _reseal(tmp_path / "r", vid, strip)
    out = repo.load("HEAD")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert repo.fsck().ok


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_a_cuda_snapshot_is_checked_on_gpu_and_cpu_loads(tmp_path):
    """A CUDA state's pieces carry WORDSUM digests; the GPU load checks the staged host bytes, a CPU load the
    bytes it read."""
    repo = ckptrepo.init(str(tmp_path / "r"))
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 1024, generator=g).cuda(), "b": torch.randn(300, generator=g).cuda()}
    repo.snapshot(state, step=1)
    vid = repo.resolve("HEAD")
    assert repo.plumbing.manifest(vid).tensors[0].pieces[0].digest[0] == 2
    out = repo.load("HEAD", device="cuda")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    _craft(repo, tmp_path / "r")
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD", device="cuda")
    with pytest.raises(DigestMismatchError, match="tensor w"):
        repo.load("HEAD")


# ---- a zstd bomb ----------------------------------------------------------------------------------------------
def blosc_bomb(nbytes: int, typesize: int = 4, block: int = 1 << 20) -> bytes:
    """A valid blosc frame (zstd, byte shuffle) of a few KiB that inflates to ``nbytes`` zeros: one compressed
    block of zeros, which every block of the frame points at (blosc reads each block where its offset says)."""
    from numcodecs import blosc
    one = blosc.compress(np.zeros(block // typesize, dtype=f"<u{typesize}"), b"zstd", 1, blosc.SHUFFLE, block)
    assert struct.unpack("<II", one[4:12]) == (block, block)
    stream = one[16 + 4:]   # after the header and the one block's offset
    blocks = nbytes // block
    head = 16 + 4 * blocks
    return one[:4] + struct.pack("<III", nbytes, block, head + len(stream)) + struct.pack("<i", head) * blocks + stream


def plant_in_shard(shard: str, chunks: int, chunk: int, frame: bytes) -> None:
    """Rewrite a compressed shard object (chunks back to back, then the index) with ``frame`` as inner chunk
    ``chunk``'s encoding: its crc32c and the index's crc32c are valid, so only its declared size is wrong."""
    with open(shard, "rb") as f:
        raw = f.read()
    index = np.frombuffer(raw[-16 * chunks - 4:-4], dtype="<u8").reshape(chunks, 2)
    encoded = [raw[int(o):int(o) + int(n)] for o, n in index]
    encoded[chunk] = frame + crc32c(frame).to_bytes(4, "little")
    out, entries, at = bytearray(), [], 0
    for e in encoded:
        entries += [at, len(e)]
        out += e
        at += len(e)
    table = np.array(entries, dtype="<u8").tobytes()
    with open(shard, "wb") as f:
        f.write(bytes(out) + table + crc32c(table).to_bytes(4, "little"))


_PEAK = """
import resource, sys, json
import ckptrepo
repo = ckptrepo.open(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    if sys.argv[2] == "load":
        repo.load("HEAD")
        outcome = "loaded"
    else:
        report = repo.fsck()
        outcome = "ok" if report.ok else "\\n".join(report.errors)
except Exception as err:
    outcome = type(err).__name__ + ": " + str(err)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"outcome": outcome, "grew_kib": grew}))
"""


def _peak(root: Path, what: str) -> dict:
    """Run a load or fsck of ``root`` in a child process; its outcome and how far its peak resident set grew."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _PEAK, str(root), what], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bombed(root: Path) -> tuple[ckptrepo.Repository, str]:
    repo = ckptrepo.init(str(root), compression="zstd")
    g = torch.Generator().manual_seed(0)
    repo.snapshot({"w": torch.randn(64, 1024, generator=g), "b": torch.randn(300, generator=g)}, step=1)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    (piece,) = next(t for t in m.tensors if t.name == "w").pieces
    info = m.arrays[piece.array]
    per_shard = info.shard_elems // info.inner_elems
    first = piece.offset // info.inner_elems
    plant_in_shard(str(root / piece.array / "c" / str(first // per_shard)), per_shard, first % per_shard,
                   blosc_bomb(1 << 30, info.itemsize))
    return repo, info.shard_key(first // per_shard)


@pytest.mark.parametrize("what", ["load", "fsck"])
def test_a_zstd_bomb_is_refused_before_it_inflates(tmp_path, what):
    """A chunk of a few KiB whose blosc header declares 1 GiB: named as corruption, and never decompressed."""
    _, shard = _bombed(tmp_path / "r")
    got = _peak(tmp_path / "r", what)
    assert shard in got["outcome"] and "declares" in got["outcome"], got
    if what == "load":
        assert got["outcome"].startswith("CorruptionError: ") and "\n" not in got["outcome"], got
    assert got["grew_kib"] < 256 << 10, got   # well under the 1 GiB the chunk would inflate to


def test_a_zstd_bomb_is_refused_on_every_store(repo_url):
    """The headers are read through the store's own kvstore (memory, S3: moto on 127.0.0.1): an intact compressed
    version loads bit-exact, one holding a bomb is named by load and fsck."""
    repo = ckptrepo.init(repo_url, compression="zstd")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(300, generator=g)}
    repo.snapshot(state, step=1)
    out = repo.load("HEAD")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    store = repo.plumbing.store
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    (piece,) = next(t for t in m.tensors if t.name == "w").pieces
    info = m.arrays[piece.array]
    per_shard = info.shard_elems // info.inner_elems
    key = info.shard_key(piece.offset // info.shard_elems)
    with tempfile.TemporaryDirectory() as d:
        local = os.path.join(d, "shard")
        with open(local, "wb") as f:
            f.write(store.get(key, 1 << 30))
        plant_in_shard(local, per_shard, piece.offset // info.inner_elems % per_shard, blosc_bomb(1 << 30))
        with open(local, "rb") as f:
            store.put(key, f.read())
    with pytest.raises(CorruptionError, match=f"{key} is corrupt .*declares 1073741824 bytes"):
        repo.load("HEAD")
    assert any(key in e and "declares 1073741824 bytes" in e for e in repo.fsck().errors)
