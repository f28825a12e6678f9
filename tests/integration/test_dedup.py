"""Dedup: unchanged tensors are not written again, and never at the cost of a bit-exact load."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from support.dedup_workers import LoRALinear
from support.helpers import assert_bit_exact

from ckptrepo import faults
from ckptrepo.errors import SnapshotFailedError


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sizes_by_step(repo) -> dict[int, int]:
    return {v.step: v.size for v in repo.log()}


def test_lora_fine_tune_writes_only_adapters_and_optimizer_state(repo):
    torch.manual_seed(0)
    d, rank, layers = 512, 8, 4   # frozen base ~4 MiB, adapters 128 KiB
    model = torch.nn.Sequential(*[LoRALinear(d, rank) for _ in range(layers)])
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    truths = {}
    with repo.snapshotter() as snap:
        snap.attach(opt)
        for step in range(5):
            loss = model(torch.randn(16, d)).pow(2).mean()
            loss.backward()
            opt.step()          # waits for the previous snapshot's capture
            opt.zero_grad()
            snap.snapshot({"model": model, "optimizer": opt, "step": step}, step=step)
            truths[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
            if step == 0:
                snap.wait()   # dedup compares with the last committed version: let the first one land
        snap.wait()

    adapters = sum(nbytes(p) for p in trainable)
    opt_state = sum(nbytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    expected = adapters + opt_state    # exp_avg, exp_avg_sq and the per-parameter step scalars
    full = sum(nbytes(t) for t in model.state_dict().values()) + opt_state
    sizes = sizes_by_step(repo)
    assert sizes[0] == full, "the first version writes everything"
    for step in range(1, 5):
        assert expected <= sizes[step] <= 1.1 * expected, (step, sizes[step], expected)
    usage = repo.du()
    # the frozen base is stored once (arrays also hold the few KiB of zeros that page-align big tensors)
    assert sum(sizes.values()) <= usage.total_bytes <= 1.01 * sum(sizes.values())
    assert repo.plumbing.plans.misses == 2, "one plan for the full state, one for the changing part"
    for step, truth in truths.items():
        assert_bit_exact(truth, repo.load(f"@{step}"))
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    first = repo.resolve("@0")
    base = next(t for t in m.tensors if t.name == "model/0.base.weight")
    assert base.pieces[0].array.startswith(f"data/{first}/"), "the base points at the first version's bytes"
    assert base.pieces[0].array in m.arrays, "a reused array is listed in the manifest"
    assert repo.fsck().ok


def test_changes_that_keep_the_version_counter_are_not_deduped(repo):
    w = torch.arange(4096, dtype=torch.float32)   # "frozen"
    x = torch.zeros(256)                          # changes every step
    state = {"w": w, "x": x}
    truths = {}
    version = w._version
    with repo.snapshotter() as snap:
        def take(step):   # waits for the commit: a snapshot dedups against the last *committed* version
            snap.snapshot(state, step=step)
            truths[step] = copy.deepcopy(state)
            snap.wait()
            x.add_(1)

        take(0)
        take(1)                    # w unchanged: reused
        w.data[0] = 42.0           # through .data: the version counter does not move
        take(2)
        w.numpy()[1] = 7.0         # through a numpy view: neither
        take(3)
        take(4)                    # unchanged again: reused
        state["w"] = w.clone()     # a new tensor object with the same values
        take(5)
        take(6)
        take(7)
        snap.wait()
    assert w._version == version, "the trap: these writes are invisible to the version counter"
    for step, truth in truths.items():
        assert_bit_exact(truth, repo.load(f"@{step}"))
    sizes = sizes_by_step(repo)
    small, big = nbytes(x), nbytes(x) + nbytes(w)
    assert sizes[0] == big and sizes[1] == small
    assert sizes[2] == big and sizes[3] == big, "a change through .data or numpy is written"
    assert sizes[4] == small
    assert sizes[7] == small, "a replaced tensor is deduped again once it stays put"
    assert repo.fsck().ok


def test_dedup_can_be_turned_off(repo):
    state = {"w": torch.ones(1000)}
    with repo.snapshotter(dedup=False) as snap:
        for step in range(3):
            snap.snapshot(state, step=step)
    assert set(sizes_by_step(repo).values()) == {4000}


def test_gc_keeps_arrays_that_kept_versions_reuse(repo):
    frozen = torch.randn(50_000)
    x = torch.zeros(1000)
    state = {"frozen": frozen, "x": x}
    with repo.snapshotter() as snap:
        for step in range(4):
            snap.snapshot(state, step=step)
            snap.wait()
            x.add_(1)
        snap.wait()
        first = repo.resolve("@0")
        r = repo.gc(keep_last=1, grace_period_s=0)
        assert len(r.pruned) == 3
        assert r.bytes_freed == 2 * nbytes(x), "the first version's array is still used by the kept one"
        assert repo.plumbing.store.list(f"data/{first}/"), "the reused array survives the pruning of its version"
        assert_bit_exact({"frozen": frozen, "x": torch.full((1000,), 3.0)}, repo.load("HEAD"))
        assert repo.fsck().ok

        # the snapshotter goes on reusing the bytes of the pruned first version
        snap.snapshot(state, step=4)
        snap.wait()
        assert sizes_by_step(repo)[4] == nbytes(x)
        assert_bit_exact(state, repo.load("@4"))
        repo.gc(keep_last=1, grace_period_s=0)
        assert_bit_exact(state, repo.load("HEAD"))
        assert repo.fsck().ok

        # once the frozen tensor changes, nothing kept refers to the first version's array: it goes
        frozen.mul_(2)
        snap.snapshot(state, step=5)
        snap.wait()
        repo.gc(keep_last=1, grace_period_s=0)
        assert repo.plumbing.store.list(f"data/{first}/") == []
        assert_bit_exact(state, repo.load("HEAD"))
        assert repo.fsck().ok


def test_reused_bytes_deleted_by_gc_while_in_flight_fail_the_snapshot_not_the_repository(repo):
    w = torch.arange(10_000, dtype=torch.float32)
    original = w.clone()
    x = torch.zeros(100)
    state = {"w": w, "x": x}
    gates = [threading.Event(), threading.Event()]
    calls = []

    def hold(_name):
        calls.append(1)
        if len(calls) <= 2:
            assert gates[len(calls) - 1].wait(30)

    with repo.snapshotter() as snap:
        snap.snapshot(state, step=0)
        snap.wait()
        faults.set_hook("after_data", hold)
        w.data.add_(1)                            # step 1 writes w (and x): nothing of step 0 is reused
        x.add_(1)
        h1 = snap.snapshot(state, step=1)
        snap.wait_captured()
        w.data.copy_(original)                    # step 2 has the bytes of step 0 again: reuses them
        x.add_(1)
        h2 = snap.snapshot(state, step=2)
        snap.wait_captured()
        gates[0].set()
        h1.result(30)
        r = repo.gc(keep_last=1, grace_period_s=0)   # prunes step 0: nothing kept refers to its array
        assert repo.resolve("@0") in r.pruned
        gates[1].set()
        with pytest.raises(SnapshotFailedError, match="deleted"):
            snap.wait()
        with pytest.raises(SnapshotFailedError, match="deleted"):
            h2.result(30)
        h3 = snap.snapshot(state, step=3)          # writes everything again
        snap.wait()
    assert h3.result().size == nbytes(w) + nbytes(x)
    assert_bit_exact(state, repo.load("@3"))
    assert repo.fsck().ok


def test_strided_views_are_deduped_and_round_trip(repo):
    """A 1-D strided view (x[::2]) could not be hashed as bytes: every snapshot after the first failed."""
    base, w = torch.randn(100_000), torch.randn(256, 256)   # both past EAGER_COPY_BYTES: hashed where they are
    state = {"every_other": base[::2], "columns": w[:, :128]}
    handles = []
    with repo.snapshotter() as snap:
        for step in range(3):
            if step == 2:
                base[0] = 7.0                    # changed in place: written again, the other reused
            handles.append(snap.snapshot(state, step=step))
            snap.wait()                          # dedup compares with the last committed version
    assert [h.result().step for h in handles] == [0, 1, 2]
    assert handles[1].stats.bytes == 0 and handles[2].stats.bytes == 50_000 * 4
    assert repo.load("@1")["every_other"][0] != 7.0 and repo.load("@2")["every_other"][0] == 7.0
    for step in range(3):
        assert torch.equal(repo.load(f"@{step}")["columns"], w[:, :128])
    assert torch.equal(repo.load("@2")["every_other"], base[::2])
