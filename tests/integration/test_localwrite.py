"""The direct shard writer for local stores (localwrite.py): TensorStore's bytes, its durability, its errors."""
from __future__ import annotations

import errno
import functools
import os
import signal
import uuid

import numpy as np
import pytest
import torch
from support.ckpt_workers import crash_writer, make_state, mp_context
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import SnapshotFailedError
from ckptrepo.storage import _crc as crc
from ckptrepo.storage import _localread as localread
from ckptrepo.storage import _localwrite as localwrite
from ckptrepo.storage import open_store
from ckptrepo.storage._arrays import ArrayInfo, choose_geometry, create_array
from ckptrepo.storage._localwrite import DirectWriter

INNER = 4096            # small geometry: many inner chunks and shards from a few KiB
SHARD = 4 * INNER


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def _write_both_ways(root: str, dtype: str, numel: int, seed: int,
                     bounce: np.ndarray | None) -> tuple[str, str, ArrayInfo]:
    """The same bytes as one array written through TensorStore and one written by DirectWriter."""
    store = open_store(root)
    shard, inner = choose_geometry(dtype, numel, shard_bytes=SHARD, inner_bytes=INNER)
    keys = []
    writer = DirectWriter(root)
    for how in ("ts", "direct"):
        info = ArrayInfo(f"data/{how}-{dtype}-{numel}", dtype, numel, shard, inner)
        handle = create_array(store, info)
        raw = np.random.default_rng(seed).integers(0, 256, numel * info.itemsize, dtype=np.uint8)
        if dtype == "bool":
            raw &= 1
        data = raw.view(handle.dtype.numpy_dtype)
        for start in range(0, numel, shard):
            stop = min(numel, start + shard)
            if how == "ts":
                handle[start:stop].write(data[start:stop], can_reference_source_data_indefinitely=True).result()
            else:
                writer.write_shard(info, start, data[start:stop], bounce)
        keys.append(info.key)
    assert writer.direct_io, "O_DIRECT was refused: only the page-cache path was tested"
    writer.close()
    return keys[0], keys[1], info


CHUNKS = [0.3, 1, 2.5, 4, 5, 9.7, 12, 17.01]   # array sizes in inner chunks (4 per shard)


def test_the_sizes_cover_partial_chunks_partial_shards_and_absent_chunks():
    partial_chunk = [c for c in CHUNKS if c != int(c)]
    partial_shard = [c for c in CHUNKS if c > SHARD // INNER and -(-c // 1) % (SHARD // INNER)]
    assert partial_chunk and partial_shard   # the last shard of 5, 9.7, 17.01 has absent inner chunks in its index
    assert set(partial_chunk) & set(partial_shard)


@pytest.mark.parametrize("io", ["direct", "buffered"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64", "complex128", "bool"])
@pytest.mark.parametrize("chunks", CHUNKS)
def test_shard_objects_are_byte_identical_to_tensorstores(tmp_path, monkeypatch, io, dtype, chunks):
    """Whole shards, a last partial shard (absent inner chunks in its index), a partial last inner chunk.

    ``direct``: O_DIRECT through a bounce buffer of three pages, so chunks and
    their crc32c straddle its refills; ``buffered``: pwritev of views.
    """
    monkeypatch.setattr(localwrite, "BOUNCE_BYTES", 3 * 4096)
    bounce = localwrite._bounce_buffer() if io == "direct" else None
    item = ArrayInfo("x", dtype, 1, 1, 1).itemsize
    numel = max(1, int(chunks * INNER / item))
    ts_key, direct_key, info = _write_both_ways(str(tmp_path), dtype, numel, int(chunks * 100), bounce)
    ts_dir, direct_dir = tmp_path / ts_key / "c", tmp_path / direct_key / "c"
    names = sorted(os.listdir(ts_dir))
    assert names == sorted(os.listdir(direct_dir)) == [str(i) for i in info.shards()]
    for name in names:
        assert (ts_dir / name).read_bytes() == (direct_dir / name).read_bytes(), f"shard {name} differs"
    assert open_store(str(tmp_path)).list(direct_key + "/") == sorted(
        f"{direct_key}/{k}" for k in ["zarr.json"] + [f"c/{n}" for n in names])   # no temporary file left


def _arrays_bytes(root, manifest) -> dict[str, list[bytes]]:
    """Every shard object of a version, by dtype, in shard order."""
    out = {}
    for info in manifest.arrays.values():
        out[info.dtype] = [open(os.path.join(root, info.shard_key(s)), "rb").read() for s in info.shards()]
    return out


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 1001, generator=g),                    # ~1.2 MB float32: several shards
            "b": torch.randn(777, generator=g),
            "h": torch.randn(5000, 13, generator=g).to(torch.bfloat16),  # numel not a multiple of an inner chunk
            "i": torch.randint(-2**40, 2**40, (12345,), generator=g, dtype=torch.int64),
            "m": torch.rand(999, generator=g) > 0.5,
            "step": 7}


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_snapshot_goes_through_the_direct_path_and_loads_bit_exact(tmp_path, monkeypatch, direct_io):
    monkeypatch.setattr(localwrite, "DIRECT_IO", direct_io)
    root = str(tmp_path / "r")
    repo = ckptrepo.init(root)
    state = _state()
    before = localwrite.bytes_written()
    with repo.snapshotter(host_memory="1MiB") as snap:
        assert snap._direct is not None
        v = snap.snapshot(state, step=1).result()
        assert snap._direct.direct_io == direct_io
    written = localwrite.bytes_written() - before
    assert written > v.size > 0   # every byte of data plus the crc32cs and indexes
    assert_bit_exact(state, ckptrepo.open(root).load("HEAD"))
    assert ckptrepo.open(root).fsck().ok
    assert not [f for _, _, files in os.walk(root) for f in files if f.endswith(localwrite.LOCK_SUFFIX)]

    if direct_io:   # written from the tensors' memory: every chunk's encoding starts on a device block
        m = repo.plumbing.manifest(repo.resolve("@1"))
        for key, info in m.arrays.items():
            for s in info.shards():
                raw = (tmp_path / "r" / info.shard_key(s)).read_bytes()
                n = info.shard_elems // info.inner_elems
                index = np.frombuffer(raw[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)
                present = index[index[:, 0] != (1 << 64) - 1]
                assert len(present) and (present[:, 0] % 512 == 0).all(), key
        # and every zarr reader reads them: TensorStore alone (crc32c checked there) gives the same tensors
        monkeypatch.setattr(localread.DirectReader, "for_store", classmethod(lambda cls, store: None))
        assert_bit_exact(state, ckptrepo.open(root).load("@1"))
        return

    # the same state through TensorStore: the very same objects
    monkeypatch.setattr(localwrite, "DIRECT_WRITES", False)
    with repo.snapshotter(host_memory="1MiB") as snap:
        assert snap._direct is None
        snap.snapshot(state, step=2).result()
    assert localwrite.bytes_written() - before == written
    ts_objects = _arrays_bytes(root, repo.plumbing.manifest(repo.resolve("@2")))
    direct_objects = _arrays_bytes(root, repo.plumbing.manifest(repo.resolve("@1")))
    assert ts_objects == direct_objects
    assert max(len(objs) for objs in direct_objects.values()) >= 3, "the state should span several shards"


def test_a_buffer_returns_to_the_pool_only_once_its_shard_is_durable(tmp_path):
    root = str(tmp_path / "r")
    repo = ckptrepo.init(root)
    state = {"w": torch.randn(1 << 20)}   # 4 MiB: 8 shards of 512 KiB with 1 MiB of staging memory
    snap = repo.snapshotter(host_memory="1MiB")
    give, seen = snap.pool.give, []

    def checked_give(buf):   # records, never raises: it runs in a writer thread's completion callback
        seen.append(sum(f.isdigit() for _, _, files in os.walk(os.path.join(root, "data")) for f in files))
        give(buf)

    snap.pool.give = checked_give
    with snap:
        v = snap.snapshot(state, step=0).result(timeout=60)
    (info,) = repo.plumbing.manifest(v.id).arrays.values()
    assert len(seen) == len(info.shards()) >= 8
    late = [(i + 1, n) for i, n in enumerate(seen) if n < i + 1]
    assert not late, f"buffers came back before their shards were renamed into place (nth give, shards): {late}"


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("where", ["write", "fsync", "before_shard_rename"])
def test_a_failing_direct_write_commits_nothing_and_leaves_no_object(tmp_path, monkeypatch, where, direct_io):
    monkeypatch.setattr(localwrite, "DIRECT_IO", direct_io)
    root = str(tmp_path / "r")
    repo = ckptrepo.init(root)
    state = {"w": torch.randn(1 << 19), "h": torch.randn(3000).to(torch.float16)}
    calls = {"n": 0}

    def should_fail() -> bool:
        calls["n"] += 1
        return calls["n"] == 3

    if where == "write":   # a short write (part of the first buffer; page-aligned, as O_DIRECT wants), then ENOSPC
        real = os.pwritev

        def pwritev(fd, buffers, offset):
            if should_fail():
                first = memoryview(buffers[0]).cast("B")
                part = first[:max(4096, first.nbytes // 2 // 4096 * 4096)] if direct_io else first
                assert real(fd, [part], offset) > 0
                raise OSError(errno.ENOSPC, "injected: no space left on device")
            return real(fd, buffers, offset)
        monkeypatch.setattr(localwrite.os, "pwritev", pwritev)
    elif where == "fsync":
        real_fsync = os.fsync

        def fsync(fd):
            if should_fail():
                raise OSError(errno.EIO, "injected: I/O error")
            real_fsync(fd)
        monkeypatch.setattr(localwrite.os, "fsync", fsync)
    else:
        def hook(_name):
            if should_fail():
                raise OSError(errno.EIO, "injected: I/O error before rename")
        faults.set_hook("before_shard_rename", hook)

    snap = repo.snapshotter(host_memory="1MiB", dedup=False)
    h = snap.snapshot(state, step=0)
    with pytest.raises(SnapshotFailedError, match="step 0 was not committed: .*injected"):
        h.result()
    with pytest.raises(SnapshotFailedError, match="injected"):
        snap.snapshot(state, step=1)      # surfaces at the next call, like a TensorStore write error
    faults.clear()
    monkeypatch.undo()
    ok = snap.snapshot(state, step=2).result()
    snap.close()
    assert [v.step for v in repo.log()] == [2] and ok.parents == ()
    assert [f["step"] for f in repo.failures()] == [0]
    vid = h.id
    data = os.path.join(root, "data", vid)
    files = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs]
    assert not [f for f in files if f.endswith(localwrite.LOCK_SUFFIX)], "the temporary file is removed"
    for f in files:   # every object under a final name is whole and valid
        if os.path.basename(os.path.dirname(f)) == "c":
            _assert_valid_shard(f)
    report = repo.fsck()
    assert report.ok, report.errors
    assert_bit_exact(state, repo.load("@2"))


def _assert_valid_shard(path: str) -> None:
    """A shard object's index checks out and every chunk it lists lies inside the file with a valid crc32c."""
    import google_crc32c
    raw = open(path, "rb").read()
    # the index has one (offset, nbytes) pair per inner chunk: find n from the total size
    for n in range(1, 4097):
        tail = 16 * n + 4
        if tail > len(raw):
            break
        idx = raw[-tail:-4]
        if google_crc32c.value(idx) != int.from_bytes(raw[-4:], "little"):
            continue
        entries = np.frombuffer(idx, dtype="<u8").reshape(n, 2)
        present = entries[entries[:, 0] != (1 << 64) - 1]
        if present.size and int(present[:, 0].max() + present[:, 1].max()) <= len(raw) - tail:
            for off, nb in present:
                off, nb = int(off), int(nb)
                body = raw[off:off + nb - 4]
                assert google_crc32c.value(body) == int.from_bytes(raw[off + nb - 4:off + nb], "little"), path
            return
    raise AssertionError(f"{path} is not a complete shard object")


def test_a_kill_before_the_rename_leaves_only_a_hidden_temporary_file(tmp_path):
    url = str(tmp_path / "repo")
    p = mp_context().Process(target=crash_writer, args=(url, 2, "before_shard_rename", 3))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the worker neither finished nor died")
    assert p.exitcode == -signal.SIGKILL
    repo = ckptrepo.open(url)
    report = repo.fsck()
    assert report.ok, report.errors
    assert [v.step for v in reversed(repo.log())] == [0, 1]
    for v in repo.log():
        assert_bit_exact(repo.load(v.id), make_state(v.step))
    committed = {v.id for v in repo.log()}
    interrupted = [d for d in os.listdir(os.path.join(url, "data")) if d not in committed]
    assert len(interrupted) == 1
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(url, "data", interrupted[0])) for f in fs]
    locks = [f for f in files if f.endswith(localwrite.LOCK_SUFFIX)]
    assert locks, files   # the shard whose rename the kill preempted (and any other the writer threads had begun)
    for lock in locks:
        assert not os.path.exists(lock[:-len(localwrite.LOCK_SUFFIX)]), "nothing under the final name"
    for f in files:
        if os.path.basename(os.path.dirname(f)) == "c" and f not in locks:
            _assert_valid_shard(f)
    assert not [k for k in repo.plumbing.store.list("data/") if k.endswith(localwrite.LOCK_SUFFIX)]
    head = repo.plumbing.head_version()
    assert repo.snapshot(make_state(9), step=9).parents == (head,)
    assert_bit_exact(repo.load("HEAD"), make_state(9))
    repo.gc(grace_period_s=0)
    left = [f for _, _, fs in os.walk(os.path.join(url, "data", interrupted[0])) for f in fs]
    assert not left, "gc deletes the leftovers, the temporary file included"


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_other_stores_keep_the_tensorstore_path(request, backend):
    url = f"memory://{uuid.uuid4().hex}" if backend == "memory" else request.getfixturevalue("s3_url")
    assert DirectWriter.for_store(open_store(url)) is None
    repo = ckptrepo.init(url)
    state = _state(1) if backend == "s3" else {"w": _state(1)["w"], "step": 7}   # memory: one segment, see below
    before = localwrite.bytes_written()
    with repo.snapshotter(host_memory="1MiB" if backend == "s3" else "64MiB") as snap:
        assert snap._direct is None
        snap.snapshot(state, step=0).result()
    assert localwrite.bytes_written() == before
    assert_bit_exact(state, ckptrepo.open(url).load("HEAD"))


def test_the_crc32c_matches_google_crc32c_on_views():
    """The checksum of every object against an independent implementation (google_crc32c, test-only)."""
    import google_crc32c
    a = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    for lo, hi in [(0, 1 << 20), (3, 70000), (65536, 65536 + 262144), (5, 5)]:
        assert crc.crc32c(a[lo:hi]) == google_crc32c.value(a[lo:hi].tobytes())
    assert crc.crc32c(a[100:200], 12345) == google_crc32c.extend(12345, a[100:200].tobytes())


def test_a_memory_store_with_reused_staging_buffers():
    """TensorStore's memory kvstore keeps what it is given: a staging buffer handed over by reference
    (can_reference_source_data_indefinitely) and then reused would overwrite shards already stored."""
    url = f"memory://{uuid.uuid4().hex}"
    repo = ckptrepo.init(url)
    state = _state(2)
    with repo.snapshotter(host_memory="1MiB") as snap:   # 2 buffers of 512 KiB for ~1.4 MB of float32
        snap.snapshot(state, step=0).result()
    assert_bit_exact(state, ckptrepo.open(url).load("HEAD"))


def test_a_file_system_that_refuses_o_direct_gets_the_page_cache_path(tmp_path, monkeypatch):
    def refuse(*_args):
        raise OSError(errno.EINVAL, "Invalid argument")
    real_live = localwrite._write_live

    def refuse_live(fd, layout, shard, block, direct_io, crcs):   # O_DIRECT refused at 512 and at 4096 bytes
        if direct_io:
            tried.append(block)
            refuse()
        real_live(fd, layout, shard, block, direct_io, crcs)

    tried: list[int] = []
    monkeypatch.setattr(localwrite, "_write_aligned", refuse)
    monkeypatch.setattr(localwrite, "_write_live", refuse_live)
    root = str(tmp_path / "r")
    repo = ckptrepo.init(root)
    state = _state(3)
    with repo.snapshotter(host_memory="1MiB") as snap:
        snap.snapshot(state, step=0).result()
        assert snap._direct.direct_io is False
    assert tried[0] == 512 and 4096 in tried   # (several writer threads may try 512 before the first refusal)
    assert_bit_exact(state, ckptrepo.open(root).load("HEAD"))
    assert ckptrepo.open(root).fsck().ok


def test_o_direct_refused_midway_through_a_shard_is_retried_while_the_state_is_unchanged(tmp_path, monkeypatch):
    """A device whose blocks turn out to be 4 KiB refuses the 512-byte layout; if that happens after some
    batches of a shard went out (here: at the third write call), the shard is written again with 4 KiB
    blocks from the same, unchanged memory instead of failing the snapshot."""
    monkeypatch.setattr(localwrite, "LIVE_BATCH", 2)
    real, calls = os.pwritev, {"n": 0}

    def pwritev(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EINVAL, "injected: Invalid argument")
        return real(fd, buffers, offset)
    monkeypatch.setattr(localwrite.os, "pwritev", pwritev)
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.randn(1 << 18)}   # 1 MiB: 16 chunks, 8 batches
    with repo.snapshotter(host_memory="64MiB") as snap:
        v = snap.snapshot(state, step=0).result(timeout=60)
        assert snap._direct.block == 4096 and snap._direct.direct_io
    assert calls["n"] > 8
    assert_bit_exact(state, repo.load(v.id))
    assert repo.fsck().ok


def test_a_device_of_4k_blocks_that_takes_the_chunks_and_refuses_the_index(tmp_path, monkeypatch):
    """A 4096-byte-sector disk (a 4Kn loop device in the storage probe) accepts every batch of 512-spaced
    chunks, whose lengths are multiples of 4 KiB, and refuses only the index at a 512-byte boundary, after the
    shard was released: every repo.snapshot() of a state over one shard (64 MiB of a dtype) failed. Emulated
    here: O_DIRECT writes not on 4 KiB boundaries are refused, as such a device does."""
    import fcntl
    real = os.pwritev

    def pwritev(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and (offset % 4096 or sum(len(memoryview(b).cast("B"))
                                                                                 for b in buffers) % 4096):
            raise OSError(errno.EINVAL, "injected: Invalid argument")
        return real(fd, buffers, offset)
    monkeypatch.setattr(localwrite.os, "pwritev", pwritev)
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.randn(1 << 24)}   # 64 MiB: a whole shard, 16 batches of 64 chunks of 4 KiB blocks each
    v = repo.snapshot(state, step=0)
    assert_bit_exact(state, repo.load(v.id))
    assert repo.fsck().ok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64", "complex128", "bool"])
@pytest.mark.parametrize("chunks", CHUNKS + [40])
def test_shards_written_from_the_tensors_memory_read_back_through_tensorstore(tmp_path, monkeypatch, dtype, chunks):
    """fill_live + write_live: big tensors placed at their address's page offset go from their own memory,
    the rest (edges, a one-element tensor, a strided column block, the zeros between and after) through the
    staging buffer, whose stale bytes must not leak; TensorStore decodes the objects (crc32c checked) to the
    same elements, and the hashers see each tensor's bytes in order."""
    import xxhash

    from ckptrepo.saving._writer import StagingPool, fill_live, live_residues, make_plan
    from ckptrepo.state._providers import TORCH_DTYPES, TensorRecord
    item = ArrayInfo("x", dtype, 1, 1, 1).itemsize
    numel = max(1, int(chunks * INNER / item))
    data = torch.from_numpy(np.random.default_rng(int(chunks * 100)).integers(0, 256, numel * item, dtype=np.uint8))
    if dtype == "bool":
        data &= 1
    flat = data.view(TORCH_DTYPES[dtype])
    cut = [0, numel // 3, numel // 3 + 1, numel * 2 // 3, numel]   # a one-element tensor in the middle
    parts = [flat[a:b].clone() for a, b in zip(cut, cut[1:])]
    rows = max(1, (cut[4] - cut[3]) // 5)
    if (cut[4] - cut[3]) % rows == 0:   # the last one as a column block of a wider matrix: strided
        wide = torch.zeros(rows, (cut[4] - cut[3]) // rows * 2 + 3, dtype=flat.dtype)
        wide[:, 1:1 + (cut[4] - cut[3]) // rows] = parts[3].reshape(rows, -1)
        parts[3] = wide[:, 1:1 + (cut[4] - cut[3]) // rows]
        assert not parts[3].is_contiguous() or parts[3].numel() <= 1
    records = [TensorRecord(f"t{i}", p, dtype, tuple(p.shape)) for i, p in enumerate(parts)]
    monkeypatch.setattr("ckptrepo.saving._writer.choose_geometry",
                        lambda d, n, shard_bytes: choose_geometry(d, n, shard_bytes=shard_bytes, inner_bytes=INNER))
    plan = make_plan(records, shard_bytes=SHARD, residues=live_residues(records, INNER))
    store = open_store(str(tmp_path))
    writer = DirectWriter(str(tmp_path))
    key = f"data/live-{dtype}-{numel}"
    info = ArrayInfo(key, dtype, *plan.streams[dtype])
    handle = create_array(store, info)
    pool = StagingPool(SHARD, 1, align=4096)
    hashers = {i: xxhash.xxh3_128() for i in range(len(parts))}
    live = 0
    for seg in plan.segments:
        buf = pool.take()
        buf.fill_(0xAB)   # stale bytes from an earlier shard
        chunks_, live_ = fill_live(seg, parts.__getitem__, buf, INNER, hashers)
        assert [c.ctypes.data != buf.data_ptr() + k * INNER for k, c in enumerate(chunks_)] == live_
        live += sum(live_)
        released = []
        shard = localwrite.LiveShard(chunks_, live_, buf.numpy(), functools.partial(released.append, 1))
        writer.write_live(info, seg.start, shard)
        # all written: nothing left to copy; a shard of copies only never held the tensors
        assert released == ([1] if any(live_) else []) and shard.release() == 0
        pool.give(buf)
    assert writer.direct_io, "O_DIRECT was refused: only the page-cache path was tested"
    if chunks >= 12:
        assert live > 0, "big tensors should go from their own memory"
    stored = handle.read().result()
    expected = np.zeros(info.numel, dtype=stored.dtype)   # zeros wherever no tensor is placed
    for p, pl in zip(parts, plan.placements):
        raw = p.contiguous().reshape(-1).view(torch.uint8).numpy()
        expected[pl.offset:pl.offset + pl.numel] = raw.view(stored.dtype)
    assert stored.tobytes() == expected.tobytes()
    for i, p in enumerate(parts):
        assert hashers[i].intdigest() == xxhash.xxh3_128(p.contiguous().view(torch.uint8).numpy()).intdigest()


def test_release_copies_what_is_not_written_yet_and_the_version_keeps_the_old_bytes(tmp_path):
    """The pre-step barrier while the writers are held up: every chunk still in the tensors is copied out,
    the loop mutates the state, and the version still holds the bytes of its own step."""
    import threading
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.randn(1 << 20), "b": torch.randn(5000)}   # 4 MiB: mostly whole aligned chunks
    truth = {k: v.clone() for k, v in state.items()}
    gate = threading.Event()
    faults.set_hook("before_shard_write", lambda _name: gate.wait(60))
    with repo.snapshotter(host_memory="64MiB") as snap:
        h = snap.snapshot(state, step=1)
        snap.wait_captured()                 # nothing written yet: this copies the live chunks
        assert h.captured()
        for t in state.values():
            t.mul_(-3).add_(1)
        gate.set()
        v = h.result(timeout=60)
    assert h.stats.copied_bytes >= 4 << 20
    assert_bit_exact(truth, repo.load(v.id))


def test_an_undisturbed_snapshot_copies_almost_nothing(tmp_path):
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.randn(4 << 20), "m": torch.randn(1 << 20), "b": torch.randn(5000)}   # 20 MiB
    with repo.snapshotter(host_memory="64MiB") as snap:
        h = snap.snapshot(state, step=1)
        v = h.result(timeout=60)
        assert h.captured()
    assert h.stats.copied_bytes <= 4 * 64 << 10   # the edges of each tensor's chunks
    assert_bit_exact(state, repo.load(v.id))


def test_one_byte_dtypes_load_through_the_direct_path(tmp_path):
    """TensorStore writes no byte order for one-byte types; their arrays still match the manifest, so loads
    read them straight from the files (localread) instead of falling back to TensorStore."""
    repo = ckptrepo.init(str(tmp_path / "r"))
    g = torch.Generator().manual_seed(5)
    state = {"i8": torch.randint(-128, 127, (300_000,), generator=g, dtype=torch.int8),
             "u8": torch.randint(0, 255, (300_000,), generator=g, dtype=torch.uint8),
             "b": torch.rand(300_000, generator=g) > 0.5}
    repo.snapshot(state, step=0)
    from ckptrepo.loading._engine import kvstore_bytes_read
    before, ts_before = localread.bytes_read(), kvstore_bytes_read()
    assert_bit_exact(state, ckptrepo.open(str(tmp_path / "r")).load("HEAD"))
    direct = localread.bytes_read() - before
    assert direct >= 900_000
    assert kvstore_bytes_read() - ts_before - direct < 100_000   # TensorStore read none of the data again


def test_a_state_of_small_tensors_is_captured_without_waiting_for_its_writes(tmp_path):
    """Nothing of it stays in the tensors' memory (every chunk is copied), so it is captured once copied,
    even while its writes are held up."""
    import threading
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {f"t{i}": torch.randn(1000) for i in range(50)}   # 200 KB of small tensors
    gate = threading.Event()
    faults.set_hook("before_shard_write", lambda _name: gate.wait(60))
    with repo.snapshotter(host_memory="64MiB") as snap:
        h = snap.snapshot(state, step=0)
        assert h.wait_captured(timeout=5) and not h.done()
        gate.set()
        v = h.result(timeout=60)
    assert_bit_exact(state, repo.load(v.id))


@pytest.mark.parametrize("direct_io", [True, False])
def test_short_writes_are_resumed_and_the_snapshot_reads_back(tmp_path, monkeypatch, direct_io):
    """The kernel may take less than a whole batch: every pwritev here moves only part of what it was given
    (a page-aligned part of the first buffer, or one buffer fewer), and the version still loads bit-exactly."""
    monkeypatch.setattr(localwrite, "DIRECT_IO", direct_io)
    real = os.pwritev
    shorts = {"n": 0}

    def pwritev(fd, buffers, offset):
        if len(buffers) > 1:
            shorts["n"] += 1
            return real(fd, list(buffers)[:len(buffers) // 2], offset)
        first = memoryview(buffers[0]).cast("B")
        if first.nbytes >= 2 * 4096:
            shorts["n"] += 1
            return real(fd, [first[:first.nbytes // 2 // 4096 * 4096]], offset)
        return real(fd, buffers, offset)
    monkeypatch.setattr(localwrite.os, "pwritev", pwritev)
    live = []
    real_live = localwrite._write_live
    monkeypatch.setattr(localwrite, "_write_live", lambda *a: (live.append(1), real_live(*a))[1])
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.randn(1 << 20), "b": torch.randn(5000).to(torch.bfloat16), "s": torch.tensor(3)}
    with repo.snapshotter(dedup=False) as snap:
        v = snap.snapshot(state, step=0).result()
    assert shorts["n"] > 0 and localwrite.bytes_written() > 0
    assert bool(live) == direct_io   # from the tensors' memory (batches of chunks and crc32c blocks) with O_DIRECT
    assert_bit_exact(state, repo.load(v.id))
    assert repo.fsck().ok


def _rewrite_shard(path: str, n: int, order: list[int], gap: int) -> None:
    """Store a shard's ``n`` inner chunk encodings in ``order`` with ``gap`` bytes between them (what another
    zarr writer may do), with an index (and its crc32c) that says where each one is now."""
    with open(path, "rb") as f:
        raw = f.read()
    entries = np.frombuffer(raw[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)
    body, index = bytearray(), np.full((n, 2), (1 << 64) - 1, dtype="<u8")
    for c in order:
        off, nb = int(entries[c, 0]), int(entries[c, 1])
        index[c] = (len(body), nb)
        body += raw[off:off + nb] + b"\xee" * gap
    idx = index.tobytes()
    with open(path, "wb") as f:
        f.write(bytes(body) + idx + crc.crc32c(idx).to_bytes(4, "little"))


@pytest.mark.parametrize("gap", [0, 100, 5000])   # read through (up to 4 KiB), or a separate read
def test_a_shard_with_chunks_out_of_order_loads_through_the_direct_path(tmp_path, gap):
    """The direct reader plans each read from the index when the chunks are not at one stride from the first;
    such shards load bit-exact, without falling back to TensorStore, whole and in strided parts."""
    from ckptrepo.loading._engine import kvstore_bytes_read
    from ckptrepo.rules import Rules, Split
    repo = ckptrepo.init(str(tmp_path / "r"))
    g = torch.Generator().manual_seed(9)
    state = {"model": {"w": torch.randn(64, 16_383, generator=g)}}   # 4 MiB: 64 KiB inner chunks, one shard
    repo.snapshot(state, step=0)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    (info,) = m.arrays.values()
    n = info.shard_elems // info.inner_elems
    chunks = -(-info.numel // info.inner_elems)
    assert 60 <= chunks <= n
    layout = ckptrepo.ParallelLayout(tp=3, rules=Rules([("w", Split(1))]))
    want = [repo.load("HEAD", parallel_layout=layout, rank=rank)["model"]["w"] for rank in range(3)]
    assert torch.equal(torch.cat(want, 1), state["model"]["w"])
    order = [*range(chunks - 1, 19, -1), *range(10, 20), *range(9, -1, -1)]   # 10-19 in order: one run
    _rewrite_shard(os.path.join(str(tmp_path / "r"), info.shard_key(0)), n, order, gap)
    before, ts_before = localread.bytes_read(), kvstore_bytes_read()
    assert_bit_exact(state, ckptrepo.open(str(tmp_path / "r")).load("HEAD"))
    direct = localread.bytes_read() - before
    assert direct >= info.numel * 4 and kvstore_bytes_read() - ts_before - direct < 100_000
    for rank in range(3):   # column slices: rows out of every chunk, copied out of the reader's scratch
        assert torch.equal(repo.load("HEAD", parallel_layout=layout, rank=rank)["model"]["w"], want[rank])


def test_a_load_of_more_shards_than_the_open_file_limit_reads_them_directly(tmp_path):
    """The direct reader held every shard of a load open until it ended: a version of more shards than the
    open-file limit (1024 by default: 64 GiB of 64 MiB shards) failed to load. It now holds one per task."""
    import resource

    from ckptrepo.loading._engine import kvstore_bytes_read
    repo = ckptrepo.init(str(tmp_path / "r"))
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3_000_000, generator=g)}
    with repo.snapshotter(host_memory="128KiB") as snap:   # 64 KiB shards: ~190 of them
        snap.snapshot(state, step=1).result(timeout=120)
    shards = sum(len(files) for _, _, files in os.walk(str(tmp_path / "r" / "data")))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 64
    assert shards > limit - len(os.listdir("/proc/self/fd")) + 100
    before, ts_before = localread.bytes_read(), kvstore_bytes_read()
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        got = repo.load("HEAD")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert_bit_exact(state, got)
    direct = localread.bytes_read() - before
    assert direct >= 12_000_000 and kvstore_bytes_read() - ts_before - direct < 100_000   # no fallback either


@pytest.mark.parametrize("edit", [{"storage_transformers": [{"name": "unknown"}]},
                                  {"an_extension": {"must_understand": True}}, {"fill_value": 5.0}])
def test_a_zarr_json_the_direct_reader_does_not_understand_is_left_to_tensorstore(tmp_path, edit):
    """The direct reader compared only the fields it reads: a storage transformer or an extension TensorStore
    refuses loaded anyway on the direct path, while TensorStore, fsck and stats called the array corrupt."""
    import json

    from ckptrepo.storage._arrays import metadata_matches
    repo = ckptrepo.init(str(tmp_path / "r"))
    repo.snapshot({"w": torch.randn(100_000)}, step=1)
    (key, info), = repo.plumbing.manifest(repo.resolve("HEAD")).arrays.items()
    path = tmp_path / "r" / key / "zarr.json"
    stored = json.loads(path.read_text())
    assert metadata_matches(info, stored)
    stored.update(edit)
    assert not metadata_matches(info, stored)
    path.write_text(json.dumps(stored))
    if "fill_value" not in edit:   # a fill value for absent chunks: TensorStore reads the array
        with pytest.raises(ckptrepo.errors.CorruptionError, match=key):
            ckptrepo.open(str(tmp_path / "r")).load("HEAD")
