"""The pre-step hook of a live capture waits for neither the disk nor the statistics pass (issue 31, part 4).

A CPU state bound for a local store is written from the tensors' own memory. When the optimizer is about to
change them, ``LiveShard.release`` copies what is still needed; it must not wait for a write in flight (a slow
disk) nor for the capture thread's hashes and statistics of the bytes, and what is stored, and its statistics,
must still be the bytes as they were at ``snapshot()``.
"""
from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest
import torch

import ckptrepo
from ckptrepo.saving import _capture_stage
from ckptrepo.saving._writer import LIVE_ALIGN, StagingPool, aligned_empty, fill_live, live_residues, make_plan
from ckptrepo.state._providers import TensorRecord
from ckptrepo.storage import _localwrite as localwrite
from ckptrepo.storage import open_store
from ckptrepo.storage._arrays import INNER_BYTES, ArrayInfo, create_array
from ckptrepo.storage._crc import crc32c

WAIT_S = 10.0   # what "returns at once" may take on a loaded CI machine; a hang takes forever


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_release_returns_while_a_write_is_in_flight_and_the_object_keeps_the_old_bytes(tmp_path, monkeypatch):
    """A release used to wait for the writer's batch in flight (up to 4 MiB per writer at the disk's pace); now it
    copies that batch too and returns, and the writer writes the batch again from the copy, with its crc32cs."""
    numel = 3 * localwrite.LIVE_BATCH * INNER_BYTES // 4   # three batches of chunks, all live
    t = aligned_empty(numel * 4, LIVE_ALIGN).view(torch.float32)
    t.copy_(torch.arange(numel, dtype=torch.float32))
    before = t.clone()
    records = [TensorRecord("w", t, "float32", (numel,))]
    plan = make_plan(records, shard_bytes=numel * 4, residues=live_residues(records, INNER_BYTES))
    (seg,) = plan.segments
    info = ArrayInfo("data/live-release", "float32", *plan.streams["float32"])
    handle = create_array(open_store(str(tmp_path)), info)
    buf = StagingPool(numel * 4 + LIVE_ALIGN, 1, align=LIVE_ALIGN).take()
    chunks, live = fill_live(seg, [t].__getitem__, buf, info.inner_bytes)
    assert all(live)
    released: list[int] = []
    shard = localwrite.LiveShard(chunks, live, buf.numpy(), functools.partial(released.append, 1))

    in_flight, disk = threading.Event(), threading.Event()
    real = localwrite._pwritev_all

    def slow_disk(fd, iov, offset, nbytes=None):
        if offset == 0 and not in_flight.is_set():   # the first batch: held until the test lets it through
            in_flight.set()
            assert disk.wait(WAIT_S)
        return real(fd, iov, offset, nbytes)
    monkeypatch.setattr(localwrite, "_pwritev_all", slow_disk)
    out: dict[str, np.ndarray] = {}
    writer = _in_thread(lambda: out.update(crcs=localwrite.DirectWriter(str(tmp_path)).write_live(info, 0, shard)))
    assert in_flight.wait(WAIT_S)
    copied: list[int] = []
    release = _in_thread(lambda: copied.append(shard.release()))
    release.join(WAIT_S / 2)
    assert not release.is_alive(), "the release waited for the write in flight"
    assert copied == [numel * 4] and released == [1]   # every chunk, the batch in flight included
    t.fill_(-1.0)   # the optimizer step: the batch in flight read the tensor while it changed
    disk.set()
    writer.join(WAIT_S)
    assert not writer.is_alive()
    assert np.array_equal(handle.read().result(), before.numpy())
    raw = before.view(torch.uint8).numpy()
    cb = info.inner_bytes
    assert out["crcs"].tolist() == [crc32c(raw[k * cb:(k + 1) * cb]) for k in range(len(chunks))]


def test_the_pre_step_hook_does_not_wait_for_the_statistics_and_they_are_of_the_captured_bytes(tmp_path,
                                                                                               monkeypatch):
    """The capture thread hashed and summarised every live tensor before it set the job staged, and the pre-step
    hook waited for that pass (about 0.2 s per 0.23 GB on two busy cores). Now the pass runs after the writes are
    queued and reads whatever the hook copied; the statistics and the data are those at ``snapshot()``, and equal
    those of a snapshot where nothing got in the way (the pieces fed do not depend on the timing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024)).sum().backward()
    repo = ckptrepo.init(tmp_path / "r")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    quiet = repo.snapshot({"model": model}, step=0)   # the same bytes, no hook, no release

    gate = threading.Event()
    real = _capture_stage.feed_live

    def slow_feed(*args, **kwargs):
        assert gate.wait(WAIT_S)
        return real(*args, **kwargs)
    monkeypatch.setattr(_capture_stage, "feed_live", slow_feed)
    with repo.snapshotter(dedup=False) as snap:
        snap.attach(opt)
        h = snap.snapshot({"model": model}, step=1)
        stepped = _in_thread(opt.step)   # waits for capture: the release, not the statistics
        stepped.join(WAIT_S / 2)
        assert not stepped.is_alive(), "optimizer.step() waited for the statistics pass"
        assert h.captured() and h.stats.copied_bytes > 4 << 20
        assert not torch.equal(model[0].weight, expected["0.weight"])   # the step ran
        time.sleep(0.05)
        gate.set()
        snap.wait()
    version = h.result()
    loaded = repo.load(version.id)["model"]
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k
    rows = repo.plumbing.manifest(version.id).tensor_stats.rows()
    ref = repo.plumbing.manifest(quiet.id).tensor_stats.rows()
    for name, row in ref.items():
        for col in ("norm", "mean", "std", "min", "max", "absmax", "nan", "inf"):
            assert rows[name][col] == row[col], (name, col)
    (weight,) = [name for name in rows if name.endswith("0.weight")]
    assert rows[weight]["norm"] == pytest.approx(float(expected["0.weight"].double().norm()), rel=1e-6)


def test_a_pool_smaller_than_the_snapshot_feeds_as_it_goes(tmp_path):
    """A buffer of a live shard comes back only once its write and its feed are over; with a pool of two buffers
    for sixteen shards the capture feeds the queued shards before it waits for one (else it waited for ever, or,
    given back after the write alone, a buffer was reused while its bytes were still to be fed or copied)."""
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(8)}   # 32 MiB in 2 MiB shards
    truth = {k: v.clone() for k, v in state.items()}
    repo = ckptrepo.init(tmp_path / "r")
    with repo.snapshotter(host_memory="4MiB") as snap:
        h = snap.snapshot(state, step=0)
        snap.wait_captured()
        for t in state.values():
            t.zero_()
        snap.wait()
    loaded = repo.load(h.result().id)
    rows = repo.plumbing.manifest(h.result().id).tensor_stats.rows()
    for k, v in truth.items():
        assert torch.equal(loaded[k], v), k
        assert rows[k]["norm"] == pytest.approx(float(v.double().norm()), rel=1e-6), k
        assert rows[k]["max"] == float(v.max()), k
