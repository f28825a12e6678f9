"""The asynchronous snapshot hook: consistency under in-place mutation, ordering, backpressure, faults."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo import faults
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import SnapshotFailedError


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def make_state(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"params": {f"w{i}": torch.randn(64, 33 + i, generator=g) for i in range(n)},
            "half": torch.randn(1000, generator=g).to(torch.bfloat16), "counter": torch.zeros((), dtype=torch.int64)}


def mutate(state):
    for t in state["params"].values():
        t.mul_(1.5).add_(0.25)
    state["half"].add_(1)
    state["counter"].add_(1)


def test_every_version_equals_the_state_at_its_step_despite_mutation(repo):
    state = make_state()
    expected = {}
    with repo.snapshotter(host_memory="16MiB") as snap:
        for step in range(8):
            h = snap.snapshot(state, step=step, metrics={"step": step})
            expected[step] = copy.deepcopy(state)       # the truth at snapshot time
            snap.wait_captured()                          # the barrier before an in-place change
            mutate(state)
        snap.wait()
    assert [v.step for v in repo.log()] == list(range(7, -1, -1))
    for step, truth in expected.items():
        assert_bit_exact(truth, repo.load(f"@{step}"))
    assert h.done() and h.result().step == 7
    assert repo.plumbing.plans.misses == 1, "the plan is computed once for an unchanged structure"


def test_module_buffers_copied_each_snapshot_do_not_make_a_new_plan(repo):
    """A big module buffer is copied at every snapshot (forward may change it): at a new address each
    time, but the plan (which places big tensors at their address's offset in a page) stays the same."""
    model = torch.nn.Linear(256, 256)
    model.register_buffer("mask", torch.randn(512, 512))   # 1 MiB, like a causal mask
    with repo.snapshotter(host_memory="16MiB") as snap:
        for step in range(4):
            snap.snapshot({"model": model}, step=step)
            snap.wait_captured()
            with torch.no_grad():
                model.weight.add_(1)
                model.bias.add_(1)   # (an unchanged one would be deduplicated: a second plan, for the rest)
                model.mask.mul_(2)
        snap.wait()
    assert repo.plumbing.plans.misses == 1
    assert torch.equal(repo.load("@3")["model"]["mask"], model.mask / 2)
    # malloc gives big blocks a fixed offset within a page, but not reused heap memory: the copy fixes it
    from ckptrepo.saving._eager_copies import page_aligned_copy
    for shape, dtype in [((512, 512), torch.float32), ((70_001,), torch.bfloat16), ((3, 6000), torch.int64)]:
        t = torch.randn(shape).to(dtype)
        c = page_aligned_copy(t)
        assert c.data_ptr() % 4096 == 0 and c.dtype == t.dtype and torch.equal(c, t)
    small = torch.randn(100, 3).t()    # below two inner chunks no write comes from its memory: a plain copy
    c = page_aligned_copy(small)
    assert c.is_contiguous() and torch.equal(c, small) and c.data_ptr() != small.data_ptr()


def test_attached_optimizer_waits_for_capture_before_stepping(repo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    truths = {}
    with repo.snapshotter() as snap:
        snap.attach(opt)
        for step in range(6):
            x = torch.randn(16, 32)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()                      # waits for the previous snapshot's capture only
            opt.zero_grad()
            handle = snap.snapshot({"model": model, "optimizer": opt}, step=step, metrics={"loss": loss.item()})
            truths[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        snap.wait()
    for step, truth in truths.items():
        assert_bit_exact(truth, repo.load(f"@{step}"))
    s = handle.stats
    assert s.bytes > 0 and s.total_s >= s.capture_s > 0 and s.blocking_s >= 0 and s.gbps > 0
    assert repo.capture_stats("HEAD")["bytes"] == s.bytes


def test_several_snapshots_in_flight_commit_in_order(repo):
    state = make_state(n=4)
    gate_open = []

    def slow(_):
        if not gate_open:
            time.sleep(0.05)

    faults.set_hook("before_shard_write", slow)
    with repo.snapshotter() as snap:
        handles = []
        for step in range(5):
            handles.append(snap.snapshot(state, step=step))
            snap.wait_captured()
            mutate(state)
        gate_open.append(True)
        snap.wait()
    log = repo.log()
    assert [v.step for v in log] == [4, 3, 2, 1, 0]
    for newer, older in zip(log, log[1:]):
        assert newer.parents == (older.id,)
    assert [h.result().id for h in handles] == [v.id for v in reversed(log)]


def test_a_pool_grown_in_the_background_stays_within_its_bound():
    """grow_in_background allocates up to what it is asked for and never past the pool's bound, alongside take()
    allocating for itself; every buffer it makes is handed out once."""
    from ckptrepo.saving._writer import StagingPool
    pool = StagingPool(1 << 16, 5, align=4096)
    taken = [pool.take()]
    pool.grow_in_background(3)
    deadline = time.monotonic() + 30
    while pool._growing is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._allocated == 3 and len(pool._free) == 2
    pool.grow_in_background(50)                     # bounded by max_buffers
    while pool._growing is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    taken += [pool.take() for _ in range(4)]
    assert pool._allocated == 5 and not pool._free
    assert len({b.data_ptr() for b in taken}) == 5 and all(b.data_ptr() % 4096 == 0 for b in taken)
    pool.grow_in_background(5)                      # enough exist: nothing starts
    assert pool._growing is None


def test_backpressure_with_a_pool_smaller_than_one_snapshot(repo):
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(8)}   # 32 MiB
    truth = copy.deepcopy(state)
    with repo.snapshotter(host_memory="4MiB") as snap:
        assert snap.shard_bytes == 2 << 20
        h = snap.snapshot(state, step=0)
        snap.wait_captured()
        for t in state.values():
            t.zero_()
        snap.wait()
        assert snap.pool.allocated_bytes <= (4 << 20) + 2 * 4096   # two buffers, each page-aligned
    assert h.stats.bytes == 32 << 20
    assert_bit_exact(truth, repo.load("HEAD"))
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    assert m.arrays[f"data/{m.id}/0/float32"].shard_elems * 4 == 2 << 20


def test_host_memory_stays_within_the_bound(tmp_path):
    """Measured in a fresh process: peak RSS growth during a 96 MiB snapshot with a 16 MiB pool."""
    code = textwrap.dedent(f"""
        import resource, json, torch, ckptrepo
        def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        state = {{f"t{{i}}": torch.randn(3 << 20) for i in range(8)}}
        repo = ckptrepo.init({str(tmp_path / 'r')!r})
        repo.snapshot({{"warm": torch.randn(1000)}}, step=0)
        base = peak()
        with repo.snapshotter(host_memory="16MiB") as snap:
            snap.snapshot(state, step=1).result()
            pool = snap.pool.allocated_bytes
        print(json.dumps({{"growth": peak() - base, "pool": pool}}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    figures = json.loads(p.stdout.strip().splitlines()[-1])
    assert figures["pool"] <= (16 << 20) + 2 * 4096   # two 8 MiB buffers, each page-aligned
    # the staging pool plus TensorStore's encoded copy of each shard in flight, plus slack for threads
    assert figures["growth"] <= 2 * (16 << 20) + (24 << 20), figures


def test_a_committed_snapshot_is_not_kept_alive_by_the_threads(repo):
    """Once wait() returns, nothing of the snapshot stays reachable: a job held by a thread waiting for its next
    item (or by a finished write's future) lived until the next snapshot, long enough for the cyclic GC to move
    its thousands of objects into its oldest generation, which brings on full collections of the training
    process (~0.2 s each with a model loaded)."""
    import gc

    from ckptrepo.saving._snapshot_job import SnapshotJob
    state = make_state(n=3)
    with repo.snapshotter(dedup=False) as snap:
        for step in range(2):
            snap.snapshot(state, step=step)
        snap.wait()
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is SnapshotJob]
        assert not alive, f"{len(alive)} committed snapshot job(s) still reachable"
    header = repo.plumbing.header(repo.resolve("HEAD"))
    assert header.step == 1 and not isinstance(header, Manifest)


def test_a_failing_write_never_stops_training_and_surfaces_at_the_next_call(repo):
    state = make_state(n=3)
    writes = {"n": 0, "fail_at": None}

    def fail_nth(_):
        writes["n"] += 1
        if writes["n"] == writes["fail_at"]:
            raise OSError("injected: no space left on device")

    faults.set_hook("before_shard_write", fail_nth)
    snap = repo.snapshotter(dedup=False)   # the unchanged state must be written again for the fault to hit
    h0 = snap.snapshot(state, step=0)
    h0.result()
    writes["fail_at"] = writes["n"] + 2   # the second shard write of the next snapshot fails
    h1 = snap.snapshot(state, step=1)
    with pytest.raises(SnapshotFailedError, match="step 1 was not committed: .*no space left"):
        h1.result()
    with pytest.raises(SnapshotFailedError, match="no space left"):
        snap.snapshot(state, step=2)      # the error surfaces at the next call...
    h3 = snap.snapshot(state, step=3)     # ...and the one after works again
    snap.close()
    assert h3.result().parents == (h0.id,), "the failed version is skipped, history stays linear"
    assert [v.step for v in repo.log()] == [3, 0]
    assert_bit_exact(state, repo.load("@0"))
    failures = repo.failures()
    assert [f["step"] for f in failures] == [1] and "no space left" in failures[0]["error"]
    report = repo.fsck()
    assert report.ok and any("failed and was not committed" in w for w in report.warnings)


def test_a_failing_capture_fails_only_its_snapshot(repo):
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(8)}   # 8 MiB: 4 segments of 2 MiB
    calls = {"n": 0, "fail": False}

    def fail_second_segment(_):
        calls["n"] += 1
        if calls["fail"] and calls["n"] == 2:
            raise RuntimeError("injected: device lost")

    faults.set_hook("before_capture", fail_second_segment)
    with repo.snapshotter(host_memory="4MiB", dedup=False) as snap:   # the unchanged state is written again
        good = snap.snapshot(state, step=0).result()
        calls.update(n=0, fail=True)
        bad = snap.snapshot(state, step=1)
        with pytest.raises(SnapshotFailedError, match="device lost"):
            bad.result(timeout=60)       # no hang: the segments never captured are accounted for
        assert bad.captured()
        with pytest.raises(SnapshotFailedError):
            snap.wait_captured()
        calls["fail"] = False
        assert snap.snapshot(state, step=2).result(timeout=60).parents == (good.id,)
    assert [v.step for v in repo.log()] == [2, 0]
    assert_bit_exact(state, repo.load("@2"))


def test_a_failure_without_a_message_is_named_by_its_type(repo):
    """The one-line error quotes the first line of the cause, or its type when the cause has no message."""
    def fail(_):
        raise MemoryError()

    repo.snapshot({"t": torch.ones(4)}, step=0)
    faults.set_hook("before_shard_write", fail)
    with repo.snapshotter(dedup=False) as snap:
        h = snap.snapshot({"t": torch.ones(4)}, step=1)
        with pytest.raises(SnapshotFailedError, match=r"step 1 was not committed: .*MemoryError$"):
            h.result(timeout=60)
        faults.set_hook("before_shard_write", None)
        with pytest.raises(SnapshotFailedError, match="MemoryError"):
            snap.wait()
    assert "MemoryError" in repo.failures()[0]["error"]


def test_exit_with_snapshots_in_flight_finishes_them(tmp_path):
    url = str(tmp_path / "r")
    code = textwrap.dedent(f"""
        import torch, ckptrepo
        repo = ckptrepo.init({url!r})
        snap = repo.snapshotter()
        for step in range(3):
            snap.snapshot({{"w": torch.full((1 << 18,), float(step))}}, step=step)
        # no wait(), no close(): the atexit hook must finish the snapshots
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [2, 1, 0]
    assert repo.load("@2")["w"][0].item() == 2.0


def test_snapshotter_refuses_a_detached_head(repo):
    repo.snapshot({"w": torch.zeros(1)}, step=0)
    repo.checkout(repo.resolve("HEAD"))   # a version id detaches (checkout HEAD on a branch stays on it)
    with pytest.raises(ckptrepo.DetachedHeadError):
        repo.snapshotter()


def test_log_stats_in_the_cli(repo, capsys, monkeypatch):
    repo.snapshot(make_state(n=2), step=5)
    from ckptrepo.cli.main import main
    monkeypatch.setattr(sys, "argv", ["ckptrepo", "--repo", repo.url, "log", "--stats"])
    main()
    out = capsys.readouterr().out
    assert "blocking" in out and "capture" in out and ("iB/s" in out or " B/s" in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_capture_is_consistent_and_ordered_by_events(repo):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 20, device=dev, generator=g) for i in range(16)}
    state["cpu"] = torch.arange(10)
    truths = {}
    with repo.snapshotter(host_memory="64MiB") as snap:
        assert snap.pool.pin
        for step in range(4):
            for t in (v for k, v in state.items() if k != "cpu"):
                t.mul_(1.01).add_(step)   # queued on the training stream just before the snapshot
            snap.snapshot(state, step=step)
            truths[step] = {k: v.detach().cpu().clone() for k, v in state.items()}
            snap.wait_captured()
        snap.wait()
    for step, truth in truths.items():
        assert_bit_exact(truth, repo.load(f"@{step}"))


def test_snapshots_leave_no_cyclic_garbage(repo):
    """A snapshot's records, tensor objects and job are freed by reference counting once it commits, not left
    to the cyclic collector: with a big model loaded a full collection costs ~0.2 s of the training loop."""
    import gc

    from ckptrepo.saving._snapshot_job import SnapshotJob
    from ckptrepo.state._providers import TensorRecord
    from ckptrepo.storage._localwrite import LiveShard
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with repo.snapshotter(host_memory="16MiB") as snap:
            snap.attach(opt)
            for step in range(3):
                snap.snapshot({"model": model, "optimizer": opt}, step=step)
                opt.step()
            snap.wait()
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, (TensorRecord, SnapshotJob, LiveShard))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == [], f"{len(ours)} snapshot objects were only freed by the cyclic collector"


def test_a_snapshotter_does_not_grow_with_the_versions_it_commits(repo):
    """A training run snapshots thousands of times through one repository handle: the handle keeps a bounded
    number of manifests, so what Python holds (and every full collection walks) stays flat. It used to keep
    every committed manifest: thousands of objects per snapshot of a real model."""
    import gc
    state = make_state(n=40)
    counts = []
    with repo.snapshotter() as snap:
        for _ in range(3):
            for _ in range(25):
                mutate(state)
                snap.snapshot(state, step=int(state["counter"]))
            snap.wait()
            gc.collect()
            counts.append(len(gc.get_objects()))
    per_snapshot = (counts[2] - counts[1]) / 25
    assert per_snapshot < 10, f"the process holds {per_snapshot:.0f} more objects per snapshot taken ({counts})"
    assert [v.step for v in repo.log()][:2] == [75, 74] and len(repo.log()) == 75


def test_buffers_of_a_state_dict_that_forward_changes_are_captured_at_snapshot(repo):
    """DCP's idiom, `{"model": model.state_dict()}`: the snapshot never sees the module, and the next forward
    changes BatchNorm's running statistics in place while the version is written (every version came back
    with later statistics). Tensors of up to 64 KiB are copied at snapshot()."""
    bn = torch.nn.BatchNorm1d(4096)
    opt = torch.optim.SGD(bn.parameters(), lr=0.1)
    expected = []
    with repo.snapshotter(host_memory="2MiB") as snap:
        snap.attach(opt)
        for step in range(4):
            bn(torch.randn(2, 4096)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected.append({k: v.clone() for k, v in bn.state_dict().items()})
            snap.snapshot({"model": bn.state_dict()}, step=step)
            with torch.no_grad():
                bn(torch.randn(2, 4096))     # forward of the next step, before the snapshot is written
    for step in range(4):
        got = repo.load(f"@{step}")["model"]
        for k, v in expected[step].items():
            assert torch.equal(got[k], v), (step, k)


class AppState:
    """DCP's documented wrapper: a Stateful object whose state dict is the model's and the optimizer's."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])


@pytest.mark.parametrize("wrap, attach", [("state_dict", True), ("app_state", True), ("app_state", False)])
def test_big_buffers_that_forward_changes_are_captured_at_snapshot(repo, wrap, attach):
    """BatchNorm statistics over 64 KiB (32768 channels), handed over by `model.state_dict()` or inside a Stateful
    `AppState`: the next forward's update landed in the version, which loaded and passed fsck. With an optimizer
    attached every tensor it does not own (up to 16 MiB) is copied at snapshot(); modules held by a Stateful
    object are found and their buffers copied, attached or not."""
    from ckptrepo import faults
    bn = torch.nn.BatchNorm1d(32768)
    opt = torch.optim.SGD(bn.parameters(), lr=0.1)
    faults.set_hook("before_capture", lambda name: time.sleep(0.3))   # slow storage: forward runs first
    try:
        with repo.snapshotter() as snap:
            if attach:
                snap.attach(opt)
            bn(torch.randn(2, 32768)).sum().backward()
            opt.step()
            expected = bn.running_mean.clone()
            state = {"model": bn.state_dict(), "opt": opt.state_dict()} if wrap == "state_dict" \
                else {"app": AppState(bn, opt)}
            snap.snapshot(state, step=1)
            with torch.no_grad():
                bn(torch.randn(2, 32768))     # forward of the next step, before the snapshot is written
            snap.wait()
    finally:
        faults.clear()
    got = repo.load("HEAD")
    saved = got["model"] if wrap == "state_dict" else got["app"]["model"]
    assert torch.equal(saved["running_mean"], expected)


def test_snapshots_from_several_threads_start_one_pipeline(repo, monkeypatch):
    """Threads calling snapshot() at once on a new snapshotter each started the capture, flush and commit
    threads: snapshots failed against their own commits and close() never returned."""
    import threading

    start = threading.Thread.start

    def slow_start(self):
        time.sleep(0.05)   # widen the window between the snapshotter's check for its threads and their start
        start(self)
    snap = repo.snapshotter()
    monkeypatch.setattr(threading.Thread, "start", slow_start)
    barrier = threading.Barrier(4)
    handles = []

    def worker(k):
        barrier.wait()
        handles.append(snap.snapshot({"t": torch.full((100,), float(k))}, step=k))
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    monkeypatch.undo()
    assert len(snap._threads) == 3
    closer = threading.Thread(target=snap.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() did not return"
    assert sorted(v.step for v in repo.log()) == [0, 1, 2, 3]
    assert all(repo.load(f"@{k}")["t"][0] == k for k in range(4))


def _finishes(call, timeout=30.0):
    """Run ``call`` in a thread; fail (instead of hanging the suite) if it has not returned in ``timeout``."""
    import threading
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{call} still blocked after {timeout} s"


def _ctrl_c_inside(monkeypatch, obj, name):
    """Make ``obj.name`` deliver a real Ctrl-C (SIGINT to this process) as it starts, then do its work."""
    import signal
    real = getattr(obj, name)

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, interrupted)


def test_ctrl_c_inside_snapshot_or_the_pre_step_hook_leaves_nothing_hanging(repo, monkeypatch):
    """A Ctrl-C between queueing a job for capture and for commit left it in flight for good (wait(), close()
    and the exit hung), and one inside a live shard's release lost the job's hold (the next optimizer.step()
    hung). The interrupt is held until those steps are done, then raised."""
    from ckptrepo.storage._localwrite import LiveShard
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    with repo.snapshotter() as snap:
        snap.attach(opt)
        snap.snapshot(state, step=0)
        snap.wait()
        with monkeypatch.context() as m:
            _ctrl_c_inside(m, snap._commit_q, "put")
            with pytest.raises(KeyboardInterrupt):
                snap.snapshot(state, step=1)
        _finishes(snap.wait)
        assert [v.step for v in repo.log()] == [1, 0]
        from ckptrepo import faults
        faults.set_hook("before_capture", lambda name: time.sleep(0.2))   # writes still running at the step
        model(torch.randn(2, 512)).sum().backward()
        opt.step()   # changed: written, not reused by dedup
        try:
            snap.snapshot(state, step=2)
            with monkeypatch.context() as m:
                _ctrl_c_inside(m, LiveShard, "release")
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
        finally:
            faults.clear()
        _finishes(opt.step)
        h = snap.snapshot(state, step=3)
        snap.wait()
        assert h.result().step == 3


def test_after_a_conflict_the_snapshotter_says_so_and_commits_nothing_more(repo):
    """The ConflictError told the user to "take the snapshot again", but every later snapshot of that
    snapshotter failed too (0 of 30 for the losing writer), after writing its data. Committing them on the
    other writer's tip instead would chain states taken from the diverged run onto it, those already in
    flight included. Now the error says this snapshotter commits nothing more, later snapshot() calls are
    refused before writing anything, and a new snapshotter commits."""
    import threading

    from ckptrepo import faults
    snap = repo.snapshotter()
    go, calls = threading.Event(), []

    def hold_first_capture(name):
        calls.append(name)
        if len(calls) == 1:   # this snapshotter's first capture waits until the other writer has committed
            go.wait(30)
    faults.set_hook("before_capture", hold_first_capture)
    try:
        h1 = snap.snapshot({"w": torch.ones(4)}, step=2)
        h2 = snap.snapshot({"w": torch.ones(4)}, step=3)          # in flight when the conflict surfaces
        other = repo.snapshot({"w": torch.zeros(4)}, step=1)     # another writer moves the branch meanwhile
        go.set()
        with pytest.raises(ckptrepo.errors.SnapshotFailedError, match="commits nothing more to it"):
            snap.wait()
    finally:
        go.set()
        faults.clear()
    for h in (h1, h2):
        with pytest.raises(ckptrepo.errors.SnapshotFailedError):
            h.result()
    with pytest.raises(ckptrepo.errors.ConflictError, match="load the branch tip and snapshot with a new"):
        snap.snapshot({"w": torch.ones(4)}, step=4)
    assert [v.id for v in repo.log()] == [other.id]
    snap.close()
    with pytest.raises(ckptrepo.errors.CkptRepoError, match="closed; attach the optimizer to a new one"):
        snap.attach(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    with repo.snapshotter() as fresh:
        v = fresh.snapshot({"w": torch.ones(4)}, step=4).result(timeout=60)
    assert list(v.parents) == [other.id]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_neither_hangs_at_exit_nor_uses_the_parents_snapshotter(tmp_path):
    """A child forked with a snapshot in flight hung at exit (its atexit close() waited for the parent's
    threads), and a snapshot() in it was accepted and never ran. Run as a script: the child must exit the
    normal way, atexit hooks included, which it cannot do inside pytest."""
    script = textwrap.dedent(f"""
        import os, sys, time, torch, ckptrepo
        from ckptrepo import faults
        repo = ckptrepo.init({str(tmp_path / "r")!r})
        snap = repo.snapshotter()
        faults.set_hook("before_capture", lambda name: time.sleep(0.5))
        snap.snapshot({{"w": torch.ones(1000)}}, step=1)
        pid = os.fork()
        if pid == 0:
            try:
                snap.snapshot({{"w": torch.ones(1000)}}, step=2)
                sys.exit(3)
            except ckptrepo.errors.CkptRepoError as err:
                sys.exit(0 if "forked child" in str(err) else 4)
        deadline = time.time() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.time() > deadline:
                os.kill(pid, 9)
                sys.exit(5)
            time.sleep(0.05)
        if os.waitstatus_to_exitcode(done[1]) != 0:
            sys.exit(10 + os.waitstatus_to_exitcode(done[1]))
        snap.close()
        print([v.step for v in repo.log()])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[1]", out


def test_snapshots_in_flight_are_bounded(repo):
    """Nothing bounded them: snapshot() returned at once however far storage was behind (300 calls left 4.7 GiB
    in flight, and copies made at snapshot() outside host_memory took ~900 MiB). The call past
    max_in_flight waits for the oldest to commit."""
    from ckptrepo import faults
    faults.set_hook("before_capture", lambda name: time.sleep(0.1))   # storage slower than the loop
    try:
        with repo.snapshotter(max_in_flight=2) as snap:
            seen = []
            for step in range(6):
                snap.snapshot({"w": torch.full((1000,), float(step))}, step=step)
                seen.append(len(snap._pending_jobs()))
            snap.wait()
    finally:
        faults.clear()
    assert max(seen) == 2, seen
    assert [v.step for v in repo.log()] == [5, 4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="max_in_flight must be a whole number of at least 1"):
        repo.snapshotter(max_in_flight=0)


def test_frozen_weights_are_not_copied_at_snapshot_whether_module_or_bare(repo):
    """With an optimizer attached, tensors it does not own are copied at snapshot() (buffers that forward
    changes). A frozen base is not the optimizer's either, but forward never changes it: copied every snapshot
    (a `base.state_dict()` of 100 x 4 MiB held the loop 0.1-0.7 s a snapshot, review finding), it put the whole
    frozen model's bytes on the training thread. A module's parameters are never copied; a bare tensor is
    copied until a snapshot finds it unchanged since the previous one (address and version counter)."""
    from ckptrepo.saving._eager_copies import copy_what_forward_may_change, step_owned
    from ckptrepo.state._providers import flatten
    # statistics of 128 KiB: over EAGER_COPY_BYTES, so only the version rule tells them from frozen weights
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(32768), torch.nn.Linear(512, 8))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with repo.snapshotter() as snap:
        snap.attach(opt)
        owned = step_owned(snap._optimizers)   # what the attached optimizer leaves live
    last = {}
    for step in range(3):
        for state in ({"model": model}, {"bare": model.state_dict()}):
            _, records = flatten(state)
            before = {r.name: r.tensor.data_ptr() for r in records}
            if "bare" in state:
                last = copy_what_forward_may_change(state, records, owned, last)
            else:
                copy_what_forward_may_change(state, records, owned, {})
            after = {r.name: r.tensor.data_ptr() for r in records}
            root = "model" if "model" in state else "bare"
            assert (after[f"{root}/0.weight"] == before[f"{root}/0.weight"]) == (root == "model" or step > 0)
            assert after[f"{root}/1.running_mean"] != before[f"{root}/1.running_mean"], (step, root)
        with torch.no_grad():
            model[1].running_mean.add_(1)   # what forward does to it: copied at every snapshot
    with repo.snapshotter() as snap:
        snap.attach(opt)
        for step in range(3):
            expected = model[1].running_mean.clone()
            h = snap.snapshot({"bare": model.state_dict(), "opt": opt}, step=step)
            with torch.no_grad():
                model[1].running_mean.add_(1)   # forward of the next step, before the version is written
            snap.wait()
            assert torch.equal(repo.load(h.result().id)["bare"]["1.running_mean"], expected)
