"""Versions written as chunks of global tensors by ranks a framework coordinates (saving/_pieces.py): each
"rank" writes its boxes, one commit makes them a version that loads whole, in any boxes, and bit-exact."""
from __future__ import annotations

import pytest
import torch
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo.core._manifest import new_version_id
from ckptrepo.errors import ConflictError, LayoutError
from ckptrepo.loading._engine import kvstore_bytes_read
from ckptrepo.saving._pieces import (
    GlobalChunk,
    commit_chunks,
    read_branch_base,
    read_chunks,
    tensor_order,
    write_rank_chunks,
)
from ckptrepo.state._providers import flatten
from ckptrepo.storage._arrays import INNER_BYTES


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(600, 256, generator=g), "b": torch.arange(7, dtype=torch.int64),
            "h": torch.randn(5, 3, generator=g).to(torch.bfloat16), "e": torch.empty(0, 4)}


def _rank_chunks(state: dict[str, torch.Tensor], rank: int) -> list[GlobalChunk]:
    """Rank 0 holds rows [0, 170) of w and all of b and e, rank 1 the rest of w and all of h (a strided view)."""
    w, h = state["w"], state["h"]
    if rank == 0:
        return [GlobalChunk("model/w", (600, 256), (0, 0), w[:170]), GlobalChunk("model/b", (7,), (0,), state["b"]),
                GlobalChunk("model/e", (0, 4), (0, 0), state["e"])]
    return [GlobalChunk("model/w", (600, 256), (170, 0), w[170:]),
            GlobalChunk("model/h", (5, 3), (0, 0), h.t().contiguous().t())]


def _commit(repo: ckptrepo.Repository, state: dict[str, torch.Tensor], step: int, shard_bytes: int | None = None
            ) -> str:
    from ckptrepo.core._manifest import new_version_id
    plumbing = repo.plumbing
    base = read_branch_base(plumbing)
    vid = new_version_id()
    writes = [write_rank_chunks(plumbing, vid, r, _rank_chunks(state, r), shard_bytes) for r in (1, 0)]
    order = tensor_order(writes)
    tree, _ = flatten({"model": {n.split("/")[1]: torch.empty(0) for n in order}})
    # the skeleton's leaf i must be tensor i of the version: rebuild it in the commit's order
    commit_chunks(plumbing, vid, writes, tree, 2, step=step, message="chunks", metrics={"loss": 1.5}, base=base)
    return vid


@pytest.mark.parametrize("where", ["local", "memory"])   # the direct writer's shards, and TensorStore's
def test_chunks_of_two_ranks_commit_one_version_that_loads_bit_exact(tmp_path, where: str) -> None:
    repo = ckptrepo.init(str(tmp_path / "repo") if where == "local" else f"memory://pieces-{tmp_path.name}")
    state = _state()
    # small shards: more segments than staging buffers, each buffer written and reused several times
    vid = _commit(repo, state, step=3, shard_bytes=INNER_BYTES)
    v = repo.version("HEAD")
    assert v.id == vid and v.step == 3 and v.metrics == {"loss": 1.5}
    loaded = repo.load("HEAD")["model"]
    assert_bit_exact({k: state[k] for k in loaded}, loaded)
    m = repo.plumbing.manifest(vid)
    assert {k.split("/")[2] for k in m.arrays} == {"0", "1"}   # each rank wrote arrays of its own
    assert len({t.name: t for t in m.tensors}["model/w"].pieces) == 2
    assert max(len(list(a.shards())) for a in m.arrays.values()) > 4
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)


def test_read_chunks_fills_any_box_and_reads_only_its_bytes(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "repo"))
    state = _state()
    vid = _commit(repo, state, step=1)
    m = repo.plumbing.manifest(vid)
    # a box across both ranks' pieces, and a column slice: only the elements wanted are needed
    rows = torch.empty(40, 256)
    cols = torch.empty(600, 16)
    before = kvstore_bytes_read()
    stats = read_chunks(repo.plumbing, m, [GlobalChunk("model/w", (600, 256), (150, 0), rows)])
    read = kvstore_bytes_read() - before
    assert torch.equal(rows, state["w"][150:190])
    assert stats.needed_bytes == 40 * 256 * 4
    # the rows' bytes, the verified inner chunks at their ends in both ranks' arrays, and the shard indexes
    assert read <= stats.needed_bytes + 4 * INNER_BYTES + 2 * 4096
    read_chunks(repo.plumbing, m, [GlobalChunk("model/w", (600, 256), (0, 64), cols)])
    assert torch.equal(cols, state["w"][:, 64:80])
    with pytest.raises(LayoutError, match="saved as float32"):
        read_chunks(repo.plumbing, m,
                    [GlobalChunk("model/w", (600, 256), (0, 0), torch.zeros(1, 1, dtype=torch.int32))])


def test_a_branch_moved_during_the_save_is_a_conflict_and_gaps_are_refused(tmp_path) -> None:
    from ckptrepo.core._manifest import new_version_id
    repo = ckptrepo.init(str(tmp_path / "repo"))
    state = _state()
    base = read_branch_base(repo.plumbing)
    repo.snapshot({"x": torch.ones(2)}, step=0)   # another writer commits meanwhile
    vid = new_version_id()
    writes = [write_rank_chunks(repo.plumbing, vid, r, _rank_chunks(state, r)) for r in (0, 1)]
    tree, _ = flatten({"model": {n.split("/")[1]: torch.empty(0) for n in tensor_order(writes)}})
    with pytest.raises(ConflictError, match="moved"):
        commit_chunks(repo.plumbing, vid, writes, tree, 2, step=1, message="", metrics=None, base=base)
    assert repo.version("HEAD").step == 0
    vid = new_version_id()
    only_rank0 = [write_rank_chunks(repo.plumbing, vid, 0, _rank_chunks(state, 0))]
    with pytest.raises(LayoutError, match="cover"):
        commit_chunks(repo.plumbing, vid, only_rank0, tree, 2, step=1, message="", metrics=None)


def test_ranks_of_a_framework_save_that_disagree_about_a_dtype_are_refused_without_rules(tmp_path) -> None:
    # a framework's save has no snapshotter rules: the advice names only what the ranks can change
    repo = ckptrepo.init(str(tmp_path / "repo"))
    vid = new_version_id()
    w = torch.ones(4, 2)
    writes = [write_rank_chunks(repo.plumbing, vid, 0, [GlobalChunk("model/w", (8, 2), (0, 0), w)]),
              write_rank_chunks(repo.plumbing, vid, 1, [GlobalChunk("model/w", (8, 2), (4, 0), w.double())])]
    with pytest.raises(LayoutError) as err:
        tensor_order(writes)
    assert str(err.value).endswith("model/w: the ranks disagree about this tensor: rank 0 holds it as float32 "
                                   "[8, 2], rank 1 as float64 [8, 2]; give every rank the same dtype")
