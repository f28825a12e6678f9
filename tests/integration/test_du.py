"""du: bytes unique to a version and shared with others when pieces point into another version's arrays."""
from __future__ import annotations

import dataclasses

import torch

import ckptrepo
from ckptrepo.core._manifest import VERSIONS_PREFIX
from ckptrepo.core.schema import encode_manifest


def test_unique_and_shared_bytes_follow_the_arrays(repo, tmp_path):
    """v2's float64 tensor reuses v1's stored bytes (as dedup will), so v1's float64 array is shared by both."""
    url = str(tmp_path / "repo")
    frozen = torch.randn(10, dtype=torch.float64)                    # 80 B
    v1 = repo.snapshot({"w": torch.randn(6), "frozen": frozen}, step=1)   # w: 24 B of float32
    v2 = repo.snapshot({"w": torch.randn(6), "frozen": frozen}, step=2)
    m1, m2 = repo.plumbing.manifest(v1.id), repo.plumbing.manifest(v2.id)
    shared_key = f"data/{v1.id}/0/float64"
    tensors = (m2.tensors[0], m2.tensors[1]._replace(pieces=m1.tensors[1].pieces), *m2.tensors[2:])
    arrays = {k: v for k, v in m2.arrays.items() if not k.endswith("float64")}
    arrays[shared_key] = m1.arrays[shared_key]
    reshaped = dataclasses.replace(m2, tensors=tensors, arrays=arrays)
    repo.plumbing.store.put(VERSIONS_PREFIX + v2.id, encode_manifest(reshaped))
    repo.plumbing.store.delete_prefix(f"data/{v2.id}/0/float64/")

    usage = ckptrepo.open(url).du()
    rows = {u.version.id: u for u in usage.versions}
    assert [u.version.id for u in usage.versions] == [v2.id, v1.id]
    assert (rows[v1.id].unique_bytes, rows[v1.id].shared_bytes) == (24, 80)
    assert (rows[v2.id].unique_bytes, rows[v2.id].shared_bytes, rows[v2.id].total_bytes) == (24, 80, 104)
    assert usage.total_bytes == 24 + 24 + 80                         # the shared array counted once

    ckptrepo.open(url).gc(keep_last=1)                                # prunes v1; its float64 array lives on for v2
    usage = ckptrepo.open(url).du()
    rows = {u.version.id: u for u in usage.versions}
    assert rows[v1.id].version.pruned and (rows[v1.id].unique_bytes, rows[v1.id].shared_bytes) == (0, 0)
    assert (rows[v2.id].unique_bytes, rows[v2.id].shared_bytes) == (104, 0)
    assert usage.total_bytes == 104
    assert usage.to_json()["versions"][0] == {"id": v2.id, "step": 2, "pruned": False, "unique_bytes": 104,
                                              "shared_bytes": 0, "bytes": 104}


def test_a_tiny_state_takes_pages_on_disk_not_64_kib_chunks(tmp_path):
    """Every array had a whole 64 KiB inner chunk: 20 snapshots of a 16-float tensor, an int64 and a 3-element
    bool mask took 3.8 MiB on disk while `du` said 1.5 KiB. An inner chunk is now at most what the array
    needs, rounded up to a page."""
    import os
    repo = ckptrepo.init(str(tmp_path / "r"))
    state = {"w": torch.arange(16.0), "step": torch.tensor(7), "mask": torch.tensor([True, False, True])}
    for step in range(10):
        repo.snapshot(state, step=step)
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "r" / "data") for f in fs)
    assert on_disk < 10 * 3 * 6 * 1024, on_disk     # a 4 KiB chunk, its index and zarr.json per array
    out = repo.load("HEAD")
    assert torch.equal(out["w"], state["w"]) and out["step"].item() == 7 and out["mask"].tolist() == [True, False, True]


def test_du_and_gc_report_what_the_store_holds_not_only_the_tensor_bytes(tmp_path):
    """Small arrays pad their last chunk and every chunk carries a checksum and an index entry: du said 1.21 MB
    of a repository whose data files held 1.61, and gc's "freed" undercounted the same way. The stored figures
    are the files' sizes on a local store; elsewhere the sharded layout's size."""
    import os

    from ckptrepo.storage._arrays import layout_bytes
    root = tmp_path / "r"
    repo = ckptrepo.init(str(root))
    g = torch.Generator().manual_seed(0)
    for s in range(3):
        repo.snapshot({"w": torch.randn(256, 256, generator=g), "e": torch.randn(64, 1024, generator=g).bfloat16(),
                       "i": torch.arange(1000) + s}, step=s)

    def on_disk(*vids):
        return sum(os.path.getsize(os.path.join(d, f)) for v in vids for d, _, files in os.walk(root / "data" / v)
                   for f in files)
    ids = [v.id for v in repo.log()]
    usage = repo.du()
    assert usage.stored_bytes == on_disk(*ids) > usage.total_bytes * 1.2
    dry = repo.gc(keep_last=1, grace_period_s=0, dry_run=True)
    assert dry.stored_bytes_freed == on_disk(*ids[1:]) and dry.bytes_freed < dry.stored_bytes_freed
    mem = ckptrepo.init("memory://du-layout")
    mem.snapshot({"e": torch.randn(64, 1000).bfloat16()}, step=0)
    arrays = mem.plumbing.manifest(mem.resolve("HEAD")).arrays
    assert mem.du().stored_bytes == sum(layout_bytes(a) for a in arrays.values())
    assert mem.du().stored_bytes == (-(-64000 // (32 << 10)) * ((64 << 10) + 4) + 2 * 16 + 4)
