"""Dedup across the repository: whatever process saw a tensor last, unchanged bytes are stored once.

Each piece of a manifest carries the digest of its stored bytes, so a snapshot compares with its parent
version however that was written: an earlier ``repo.snapshot`` call, another snapshotter, a process that
has since restarted.
"""
from __future__ import annotations

import pytest
import torch
from support.dedup_workers import changed_bytes, lora, result, resume_and_snapshot, run_alone, train_step
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo.parallel.layout import ParallelLayout

MiB = 1 << 20


def sizes_by_step(repo: ckptrepo.Repository) -> dict[int, int]:
    return {v.step: v.size for v in repo.log()}


def test_ten_snapshot_calls_of_a_frozen_tensor_hold_its_bytes_once(repo):
    """16 MiB frozen and 0.5 MiB that change: ten `repo.snapshot` calls hold about 21 MiB, not 165."""
    g = torch.Generator().manual_seed(0)
    state = {"frozen": torch.randn(4 * MiB, generator=g), "adapter": torch.randn(MiB // 8, generator=g)}
    truths = []
    for step in range(10):
        state["adapter"].add_(1.0)
        repo.snapshot(state, step=step)
        truths.append({k: v.clone() for k, v in state.items()})
    distinct = 16 * MiB + 10 * MiB // 2
    usage = repo.du()
    assert distinct <= usage.total_bytes <= 1.3 * distinct, usage.total_bytes / distinct
    sizes = sizes_by_step(repo)
    assert sizes[0] == 16 * MiB + MiB // 2 and all(sizes[s] == MiB // 2 for s in range(1, 10)), sizes
    for step, truth in enumerate(truths):
        assert_bit_exact(truth, repo.load(f"@{step}"))
    assert repo.fsck().ok


def test_lora_through_snapshot_calls_and_new_snapshotters_writes_only_what_changed(repo):
    model, opt = lora()
    state = {"model": model, "optimizer": opt}
    truths = {}
    for step in range(6):
        train_step(model, opt, step)
        if step < 3:
            repo.snapshot(state, step=step)
        else:   # a new snapshotter for each: its first snapshot compares with the branch tip
            with repo.snapshotter() as snap:
                snap.attach(opt)
                snap.snapshot(state, step=step)
        truths[step] = {k: v.clone() for k, v in model.state_dict().items()}   # a plain dict, as loaded
    changed = changed_bytes(model, opt)
    sizes = sizes_by_step(repo)
    for step in range(1, 6):
        assert changed <= sizes[step] <= 1.1 * changed, (step, sizes[step], changed)
    for step, truth in truths.items():
        assert_bit_exact(truth, dict(repo.load(f"@{step}")["model"]))


def test_a_restarted_process_reuses_what_the_one_before_stored(repo, tmp_path):
    url = repo.plumbing.url
    out = tmp_path / "out"
    out.mkdir()
    out = str(out)
    run_alone(resume_and_snapshot, url, [0, 1], out, "first")
    run_alone(resume_and_snapshot, url, [2, 3], out, "second")
    first, second = result(out, "first"), result(out, "second")
    changed = second["changed"]
    assert first["sizes"][0] > 10 * changed, "the first version of all writes the frozen base"
    for size in first["sizes"][1:] + second["sizes"]:
        assert changed <= size <= 1.1 * changed, (first, second)
    model, opt = lora()
    loaded = repo.load("@3", into={"model": model, "optimizer": opt})
    assert loaded is not None
    base = lora()[0]
    for name, p in base.named_parameters():
        if not p.requires_grad:
            assert torch.equal(model.get_parameter(name), p), name
    assert repo.fsck().ok


def test_a_parent_whose_data_is_gone_is_not_pointed_at(repo):
    """A parent whose array left this store (an evicted or damaged version) is not reused: all is written."""
    w = torch.randn(100_000)
    first = repo.snapshot({"w": w}, step=0)
    store = repo.plumbing.store
    shard = next(k for k in store.list(f"data/{first.id}/") if "/c/" in k)
    store.delete(shard)
    second = repo.snapshot({"w": w}, step=1)
    assert second.size == w.numel() * 4
    assert torch.equal(repo.load("@1")["w"], w)


def test_a_parent_that_cannot_be_read_costs_only_the_dedup(repo, monkeypatch):
    from ckptrepo.saving import _dedup
    w = torch.randn(10_000)
    repo.snapshot({"w": w}, step=0)

    def failing(*_args):
        raise OSError("transient list failure")
    monkeypatch.setattr(_dedup, "missing_objects", failing)
    assert repo.snapshot({"w": w}, step=1).size == w.numel() * 4
    assert torch.equal(repo.load("@1")["w"], w)


def test_a_conjugate_view_is_not_taken_for_its_base(repo):
    y = torch.randn(100, dtype=torch.complex64)
    with repo.snapshotter() as snap:
        snap.snapshot({"z": y.conj()}, step=0)
        snap.wait()
        snap.snapshot({"z": y}, step=1)   # same storage, stride and version counter: only the conj bit differs
    repo.snapshot({"z": y.conj()}, step=2)   # compared with the parent's digest alone
    assert torch.equal(repo.load("@0")["z"], y.conj().resolve_conj())
    assert torch.equal(repo.load("@1")["z"], y)
    assert torch.equal(repo.load("@2")["z"], y.conj().resolve_conj())


def test_same_bytes_under_another_shape_or_dtype_are_written(repo):
    w = torch.randn(64, 32)
    repo.snapshot({"w": w}, step=0)
    assert repo.snapshot({"w": w.reshape(32, 64)}, step=1).size == w.numel() * 4
    assert repo.snapshot({"w": w.view(torch.int32).reshape(32, 64)}, step=2).size == w.numel() * 4
    assert repo.snapshot({"w": w.view(torch.int32).reshape(32, 64)}, step=3).size == 0
    assert torch.equal(repo.load("@3")["w"], w.view(torch.int32).reshape(32, 64))
    assert torch.equal(repo.load("@1")["w"], w.reshape(32, 64))


def test_each_piece_of_a_layout_snapshot_is_deduped_with_its_statistics(repo):
    """A snapshot through a layout stores pieces of global tensors: an unchanged piece is reused, and the
    version's statistics still cover every element."""
    g = torch.Generator().manual_seed(0)
    frozen, moving = torch.randn(256, 256, generator=g), torch.randn(64, 64, generator=g)
    state = {"frozen": frozen, "moving": moving}
    lay = ParallelLayout(tp=1, pp=1, dp=1)
    repo.snapshot(state, step=0, parallel_layout=lay)
    moving.add_(1.0)
    v = repo.snapshot(state, step=1, parallel_layout=lay)
    assert v.size == moving.numel() * 4
    assert_bit_exact(state, repo.load("@1"))
    stats = {s.name.split("@")[0]: s for s in repo.stats("@1")}   # names without a rule's: per rank
    assert abs(stats["frozen"].norm - frozen.double().norm().item()) < 1e-6 * frozen.double().norm().item()
    assert abs(stats["moving"].mean - moving.double().mean().item()) < 1e-6


def test_manifests_record_each_piece_digest(repo):
    w = torch.randn(1000)
    v = repo.snapshot({"w": w, "e": torch.zeros(0)}, step=0)
    m = repo.plumbing.manifest(v.id)
    (piece,) = next(t for t in m.tensors if t.name == "w").pieces
    from ckptrepo.saving._content_hash import xxh3_digest
    assert piece.digest == xxh3_digest(w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unchanged_cuda_tensors_cross_neither_pcie_nor_the_disk(repo):
    """CUDA tensors are hashed on the device: a frozen one is neither copied to the host nor written, within
    a snapshotter, by a new one, and by `repo.snapshot`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    frozen = torch.randn(1 << 20, device="cuda", generator=g)
    adapter = torch.randn(1 << 14, device="cuda", generator=g)
    state = {"frozen": frozen, "adapter": adapter, "cpu": torch.arange(10.0)}
    handles = []
    with repo.snapshotter() as snap:
        for step in range(3):
            adapter.add_(1.0)
            handles.append(snap.snapshot(state, step=step))
            snap.wait()
    with repo.snapshotter() as snap:
        adapter.add_(1.0)
        handles.append(snap.snapshot(state, step=3))
    adapter.add_(1.0)
    last = repo.snapshot(state, step=4)
    small = adapter.numel() * 4
    assert handles[0].stats.bytes == frozen.numel() * 4 + small + 40
    assert [h.stats.bytes for h in handles[1:]] == [small] * 3 and last.size == small
    assert [h.stats.copied_bytes for h in handles[1:]] == [small] * 3, "the frozen tensor stayed on the GPU"
    assert torch.equal(repo.load("@4")["frozen"], frozen.cpu())
    assert torch.equal(repo.load("@4")["adapter"], adapter.cpu())
    m = repo.plumbing.manifest(last.id)
    digest = next(t for t in m.tensors if t.name == "frozen").pieces[0].digest
    from ckptrepo.saving._content_hash import WORDSUM, wordsum_digests
    assert digest[0] == WORDSUM and digest == wordsum_digests([frozen.cpu()])[0]
