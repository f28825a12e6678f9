"""Loads into a layout read only the bytes each rank needs (counted by TensorStore's own kvstore metrics)."""
from __future__ import annotations

import pytest
import torch
from support.dist_workers import SPLIT_RULES, snapshot_split_state, split_state
from support.megatron_ref import launch

import ckptrepo
from ckptrepo.loading._engine import ReadStats, kvstore_bytes_read
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.storage._arrays import INNER_BYTES

RULES = SPLIT_RULES   # col.weight: Split(0), row.weight: Split(1), norm.weight: Replicated
INDEX_BYTES = 64 << 10   # shard indexes: 16 bytes per inner chunk, read once per shard
PADDING = 1 + 512 / INNER_BYTES   # the direct writer pads each chunk's encoding to a 512-byte block; reads read it


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> ckptrepo.Repository:
    g = torch.Generator().manual_seed(0)
    r = ckptrepo.init(str(tmp_path_factory.mktemp("reads") / "repo"))
    r.snapshot({"model": {"col.weight": torch.randn(2048, 512, generator=g),    # 4 MiB each
                          "row.weight": torch.randn(512, 2048, generator=g),
                          "norm.weight": torch.randn(2048, generator=g)}}, step=1)
    return r


def _load(repo: ckptrepo.Repository, name: str, tp: int, rank: int,
          full: torch.Tensor | None = None) -> tuple[torch.Tensor, ReadStats, int]:
    full = repo.load("HEAD")["model"][name] if full is None else full
    lay = ParallelLayout(tp=tp, rules=RULES)
    spec_dim = {"col.weight": 0, "row.weight": 1}.get(name)
    shape = list(full.shape)
    if spec_dim is not None:
        shape[spec_dim] //= tp
    into = {"model": {name: torch.empty(shape)}}
    stats = ReadStats()
    before = kvstore_bytes_read()
    repo.load("HEAD", parallel_layout=lay, rank=rank, into=into, read_stats=stats)
    read = kvstore_bytes_read() - before
    expected = full if spec_dim is None else full.chunk(tp, dim=spec_dim)[rank]
    assert torch.equal(into["model"][name], expected)
    return into["model"][name], stats, read


@pytest.mark.parametrize("tp", [2, 4])
def test_a_contiguous_slice_reads_its_bytes_and_at_most_the_chunks_at_its_ends(repo, tp: int) -> None:
    for rank in range(tp):
        t, stats, read = _load(repo, "col.weight", tp, rank)
        assert stats.needed_bytes == t.numel() * 4
        assert stats.spans == 1
        assert read <= stats.needed_bytes + 2 * INNER_BYTES + INDEX_BYTES
        assert read <= 1.1 * stats.needed_bytes + INNER_BYTES + INDEX_BYTES


@pytest.mark.parametrize("tp", [2, 4])
def test_a_strided_slice_reads_within_the_issue_bound(repo, tp: int) -> None:
    """Row-parallel slices are short runs in every row: whole verified inner chunks are the unit of a read."""
    for rank in range(tp):
        t, stats, read = _load(repo, "row.weight", tp, rank)
        assert stats.needed_bytes == t.numel() * 4
        assert stats.runs == 512
        assert read <= 1.1 * stats.needed_bytes + stats.runs * INNER_BYTES
        # never more than the tensor itself: its chunks, the one it shares with its neighbour, the padding
        assert read <= 512 * 2048 * 4 * PADDING + INNER_BYTES + INDEX_BYTES


def test_replicated_tensors_and_the_rest_are_not_read(repo) -> None:
    t, stats, read = _load(repo, "norm.weight", 4, 3)
    assert stats.needed_bytes == 2048 * 4
    assert read <= INNER_BYTES + INDEX_BYTES   # the other tensors of the state are never touched


@pytest.fixture(scope="module")
def tp2_repo(tmp_path_factory: pytest.TempPathFactory) -> ckptrepo.Repository:
    """A version saved by 2 tensor-parallel ranks (gloo) of split_state(3)."""
    url = str(tmp_path_factory.mktemp("tp2") / "repo")
    ckptrepo.init(url)
    vids = launch(ParallelLayout(tp=2), snapshot_split_state, url, 3)
    assert len(set(vids)) == 1
    return ckptrepo.open(url)


def test_a_distributed_save_stores_row_parallel_pieces_as_column_blocks(tp2_repo) -> None:
    tensors = {t.name: t for t in tp2_repo.plumbing.manifest(tp2_repo.resolve("HEAD")).tensors}
    boxes = sorted(p.box for p in tensors["model/row.weight"].pieces)
    assert boxes == [((0, 512 * i), (256, 512)) for i in range(16)]    # 8 blocks of each rank's [256, 4096]
    assert len(tensors["model/col.weight"].pieces) == 2           # a leading-dim split is contiguous already
    assert len(tensors["model/norm.weight"].pieces) == 1


@pytest.mark.parametrize("shape, dtype, widths", [
    ((256, 4096), torch.float32, [512] * 8),        # 16 KiB rows: the most blocks, 2 KiB rows each
    ((576, 576), torch.float32, [144] * 4),         # 2304-byte rows: four blocks (narrow rows), not 8 of 288 bytes
    ((512, 256), torch.bfloat16, [64] * 4),         # 512-byte rows: four blocks of 128-byte rows
    ((1024, 64), torch.float32, [32] * 2),          # 256-byte rows: two blocks, rows no shorter than 128 bytes
    ((4096, 32), torch.float32, [32]),              # 128-byte rows: one block
    ((16, 4096), torch.float32, [1024] * 4),        # 256 KiB: each block at least 64 KiB
])
def test_column_blocks_keep_rows_of_a_kilobyte_and_blocks_of_64_kib(shape, dtype, widths) -> None:
    """Loads into fewer tensor-parallel ranks copy every block row into wider rows: short rows make that copy
    per-row overhead, so blocks trade tp growth for row length, except that narrow rows still get four blocks
    (down to 128-byte rows): a tp=4 load would otherwise read every chunk of the piece (decision 059)."""
    from ckptrepo.parallel._sharding import Piece, column_blocks
    view = torch.zeros(shape, dtype=dtype)
    blocks = column_blocks([Piece("w", "x", shape, ((0, 0), shape), view, cut_dim=1)])
    assert [b.box[1][1] for b in blocks] == widths
    assert [b.box[0][1] for b in blocks] == [sum(widths[:i]) for i in range(len(widths))]
    assert all(b.view.data_ptr() == view[:, b.box[0][1]:].data_ptr() for b in blocks)


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_more_tensor_parallel_ranks_read_only_the_column_blocks_they_need(tp2_repo, tp: int) -> None:
    """Before column blocks, each of these loads read a whole saved piece (4 MiB): 2x to 4x what it needed."""
    full = split_state(3)["row.weight"]
    for rank in range(tp):
        t, stats, read = _load(tp2_repo, "row.weight", tp, rank, full)
        assert stats.needed_bytes == t.numel() * 4
        assert read <= 1.1 * stats.needed_bytes + 2 * INNER_BYTES + INDEX_BYTES, (rank, read, stats)


@pytest.fixture(scope="module")
def one_process_repo(tmp_path_factory: pytest.TempPathFactory) -> ckptrepo.Repository:
    """split_state(4) saved by one process that names a layout (its rules), as after single-GPU training."""
    r = ckptrepo.init(str(tmp_path_factory.mktemp("one") / "repo"))
    r.snapshot({"model": split_state(4)}, step=1, parallel_layout=ParallelLayout(rules=RULES))
    return r


def test_one_process_with_a_layout_stores_row_parallel_tensors_as_column_blocks(one_process_repo) -> None:
    tensors = {t.name: t for t in one_process_repo.plumbing.manifest(one_process_repo.resolve("HEAD")).tensors}
    boxes = sorted(p.box for p in tensors["model/row.weight"].pieces)
    assert boxes == [((0, 1024 * i), (256, 1024)) for i in range(8)]
    assert len(tensors["model/col.weight"].pieces) == 1
    loaded = one_process_repo.load("HEAD")["model"]   # without a layout: the whole tensors, bit-exact
    for name, t in split_state(4).items():
        assert torch.equal(loaded[name], t)


@pytest.mark.parametrize("tp", [2, 8])
def test_a_one_process_save_with_a_layout_loads_into_tensor_parallel_ranks_reading_what_they_need(
        one_process_repo, tp: int) -> None:
    """Without the layout at save time, each of these loads read the whole 8 MiB tensor (test above: per-run bound)."""
    full = split_state(4)["row.weight"]
    for rank in range(tp):
        t, stats, read = _load(one_process_repo, "row.weight", tp, rank, full)
        assert read <= 1.1 * stats.needed_bytes + 2 * INNER_BYTES + INDEX_BYTES, (rank, read, stats)


def test_a_zero_element_tensor_survives_a_single_process_sharded_snapshot(tmp_path) -> None:
    """It has no pieces, but it is listed under its global name, so a plain load returns it too."""
    r = ckptrepo.init(str(tmp_path / "repo"))
    state = {"model": {"norm.weight": torch.randn(10), "empty": torch.zeros(0, 3)}, "extra": torch.zeros(0)}
    r.snapshot(state, step=1, parallel_layout=ParallelLayout(rules=RULES))
    got = r.load("HEAD")
    assert list(got["model"]) == ["norm.weight", "empty"] and got["model"]["empty"].shape == (0, 3)
    assert got["extra"].shape == (0,)
    assert torch.equal(got["model"]["norm.weight"], state["model"]["norm.weight"])


def test_a_strided_target_part_split_over_several_spans_is_filled_exactly(tmp_path) -> None:
    """Saved as column blocks along dim 1, loaded split along dim 2: each block's part of a rank's tensor is a
    strided view, and its runs in the block are too far apart to be read as one span. Every span then
    scatters into the same strided part (reshard._scatter, under its lock)."""
    from ckptrepo.rules import Rules, Split
    r = ckptrepo.init(str(tmp_path / "repo"))
    full = torch.randn(2, 8, 40_000, generator=torch.Generator().manual_seed(4))
    r.snapshot({"model": {"w": full}}, step=1, parallel_layout=ParallelLayout(rules=Rules([("w", Split(1))])))
    for rank in range(2):
        into = {"model": {"w": torch.full((2, 8, 20_000), float("nan"))}}
        stats = ReadStats()
        r.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=Rules([("w", Split(2))])), rank=rank, into=into,
               read_stats=stats)
        assert stats.spans > stats.runs / 2 >= 8, stats   # the parts' runs went out as separate spans
        assert torch.equal(into["model"]["w"], full[:, :, rank * 20_000:(rank + 1) * 20_000])


@pytest.mark.parametrize("batch", [None, INNER_BYTES, 4096])   # 4096: less than a chunk, so a chunk per batch
def test_strided_targets_are_filled_row_by_row_from_verified_chunks(tmp_path, monkeypatch, batch) -> None:
    """Column blocks loaded into whole rows (and into narrower blocks) go through reshard._RowTarget: each
    reader task copies the rows its chunks hold, cutting rows at chunk and batch edges. With one inner chunk
    per batch, the long rows (100 KB) arrive in several pieces. Every load is bit-exact."""
    from ckptrepo.loading import _reshard as reshard
    from ckptrepo.rules import Rules, Split
    from ckptrepo.storage import _localread as localread
    if batch is not None:
        monkeypatch.setattr(localread, "ROW_SCRATCH_BYTES", batch)
    calls = []
    scatter = reshard._RowTarget.scatter
    monkeypatch.setattr(reshard._RowTarget, "scatter", lambda self, *a: (calls.append(a[1:]), scatter(self, *a)))
    g = torch.Generator().manual_seed(5)
    state = {"short": torch.randn(96, 3000, generator=g),           # blocks of 375 columns: 1.5 KB rows
             "long": torch.randn(3, 8, 200_000, generator=g)}       # blocks of 25,000: rows over a chunk
    rules = Rules([("short", Split(1)), ("long", Split(2))])
    r = ckptrepo.init(str(tmp_path / "repo"))
    r.snapshot({"model": state}, step=1, parallel_layout=ParallelLayout(rules=rules))
    pieces = {t.name: len(t.pieces) for t in r.plumbing.manifest(r.resolve("HEAD")).tensors}
    assert pieces["model/short"] > 1 and pieces["model/long"] > 1, pieces     # saved as column blocks
    into = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    r.load("HEAD", into={"model": into})
    assert all(torch.equal(into[k], state[k]) for k in state)
    assert len(calls) >= pieces["model/short"] + pieces["model/long"]
    if batch is not None:
        assert max(b - a for a, b in calls) <= max(batch, INNER_BYTES) // 4 < 25_000   # every long row in pieces
    for rank in range(5):   # blocks that cut across the saved ones
        part = {"short": torch.empty(96, 600), "long": torch.empty(3, 8, 40_000)}
        r.load("HEAD", parallel_layout=ParallelLayout(tp=5, rules=rules), rank=rank, into={"model": part})
        assert torch.equal(part["short"], state["short"][:, rank * 600:(rank + 1) * 600])
        assert torch.equal(part["long"], state["long"][:, :, rank * 40_000:(rank + 1) * 40_000])


@pytest.mark.parametrize("seed", range(3))
def test_direct_reads_equal_the_state_over_random_shapes_dtypes_and_layouts(tmp_path, monkeypatch, seed) -> None:
    """The direct reader mixes, within one task, chunks read straight into a tensor and chunks copied out of
    its buffer (shared by small tensors, cut by a tensor's edge, or bound for strided rows). Random states
    (several dtypes, tensors from a few elements to several chunks, split along random dimensions), saved
    under one tensor-parallel layout and loaded under others, fresh and into given tensors, with the batch
    buffer at its size or smaller than a chunk: every rank gets exactly its slice."""
    import random

    from ckptrepo.rules import Rules, Split
    from ckptrepo.storage import _localread as localread
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    if seed == 2:
        monkeypatch.setattr(localread, "ROW_SCRATCH_BYTES", 4096)   # every chunk a batch of its own
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]
    state, rules = {}, []
    for i in range(12):
        shape = [6 * rng.choice([1, 2, 7, 40, 300]) for _ in range(rng.choice([1, 2, 2, 3]))]
        dtype = rng.choice(dtypes)
        t = torch.randn(shape, generator=g).mul_(100)
        state[f"t{i}"] = t.to(dtype)
        if rng.random() < 0.8:
            rules.append((f"t{i}", Split(rng.randrange(len(shape)))))
    rule_set = Rules(rules)
    split_of = {name: spec.dim for name, spec in rules}
    r = ckptrepo.init(str(tmp_path / "repo"))
    r.snapshot({"model": state}, step=1, parallel_layout=ParallelLayout(tp=1, rules=rule_set))
    for tp in (1, 2, 3, 6):
        layout = ParallelLayout(tp=tp, rules=rule_set)
        for rank in range(tp):
            want = {k: v.chunk(tp, dim=split_of[k])[rank] if k in split_of else v for k, v in state.items()}
            fresh = r.load("HEAD", parallel_layout=layout, rank=rank)["model"]
            into = {k: torch.zeros_like(v) for k, v in want.items()}
            r.load("HEAD", parallel_layout=layout, rank=rank, into={"model": into})
            for k, v in want.items():
                assert torch.equal(fresh[k], v) and torch.equal(into[k], v), (seed, tp, rank, k, v.shape)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_layout_load_through_tensorstore_reads_the_right_elements(repo, rank: int) -> None:
    """Through TensorStore (a store with options has no direct reads), a run is widened to whole inner chunks;
    a tensor the direct writer placed mid-chunk is then a slice of that read, which its copy must start from."""
    full = repo.load("HEAD")["model"]
    via_ts = ckptrepo.open(repo.url, options={"file_io_sync": False})
    assert via_ts.plumbing.store.capabilities.local_root is None
    offsets = {t.name: t.pieces[0].offset for t in via_ts.plumbing.manifest(via_ts.resolve("HEAD")).tensors}
    assert any(o % (INNER_BYTES // 4) for o in offsets.values())   # some tensor starts mid-chunk
    for name in ("col.weight", "row.weight"):
        _load(via_ts, name, 2, rank, full[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lazy_clone_reads_what_row_parallel_ranks_need_of_narrow_rows(tmp_path, dtype) -> None:
    """Rows of 1 KiB (fp32) and 512 bytes (bf16) split along dim 1: at tp=2 and tp=4 each rank reads its own
    column blocks from the remote, not every chunk of the tensor (2x and 4x its part when stored whole). The
    bytes are counted where they are read (TensorStore's kvstore metrics: the remote's file reads)."""
    from ckptrepo.rules import Rules, Split
    g = torch.Generator().manual_seed(6)
    full = {"row.weight": torch.randn(4096, 256, generator=g).to(dtype), "col.weight": torch.randn(4096, 256,
                                                                                                 generator=g)}
    rules = Rules([("row.weight", Split(1)), ("col.weight", Split(0))])
    src = ckptrepo.init(str(tmp_path / "src"))
    src.snapshot({"model": full}, step=1, parallel_layout=ParallelLayout(rules=rules))
    lazy = ckptrepo.clone(str(tmp_path / "src"), str(tmp_path / "lazy"), lazy=True)
    for tp in (2, 4):
        read = needed = 0
        for rank in range(tp):
            want = full["row.weight"].chunk(tp, dim=1)[rank]
            into = {"model": {"row.weight": torch.full_like(want, float("nan"))}}
            before = kvstore_bytes_read()
            lazy.load("HEAD", parallel_layout=ParallelLayout(tp=tp, rules=rules), rank=rank, into=into)
            read += kvstore_bytes_read() - before
            needed += want.numel() * want.element_size()
            assert torch.equal(into["model"]["row.weight"], want), (tp, rank)
        assert read <= 1.2 * needed, (tp, read / needed)
    assert torch.equal(lazy.load("HEAD")["model"]["row.weight"], full["row.weight"])   # whole rows, from blocks
