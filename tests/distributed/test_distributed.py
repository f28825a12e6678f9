"""Distributed snapshots and resharding loads, with the reference Megatron-style GPT on gloo.

Every layout of the matrix trains a few steps in real worker processes and
snapshots asynchronously while training goes on; each version is then loaded
into every other layout, rank by rank, and the reassembled global parameters
and optimizer states (reassembled by the reference model's own code, not by
ckptrepo's) must equal the saved ones bit for bit.
"""
from __future__ import annotations

import math
import queue
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.ckpt_workers import mp_context
from support.dist_workers import resume, snapshot_and_die, snapshot_disagreeing, train_and_snapshot, with_rules
from support.helpers import assert_bit_exact
from support.megatron_ref import GPTConfig, _worker, assemble, launch

import ckptrepo
from ckptrepo.loading._engine import ReadStats, kvstore_bytes_read
from ckptrepo.parallel.layout import ParallelLayout

CFG = GPTConfig()
BEFORE, AFTER = 2, 2
MATRIX = [ParallelLayout(2, 2, 2), ParallelLayout(1, 1, 4), ParallelLayout(4, 1, 1),
          ParallelLayout(2, 1, 2, zero=1), ParallelLayout(1, 2, 2), ParallelLayout(1, 2, 2, zero=3)]


def _id(lay: ParallelLayout) -> str:
    return f"tp{lay.tp}pp{lay.pp}dp{lay.dp}z{lay.zero}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One version per layout of the matrix, with the state each rank had at its snapshot."""
    url = str(tmp_path_factory.mktemp("dist") / "repo")
    ckptrepo.init(url)
    out = {}
    for lay in MATRIX:
        results = launch(lay, train_and_snapshot, url, CFG, BEFORE, AFTER)
        vids = {r["vid"] for r in results}
        assert len(vids) == 1, f"{lay}: ranks disagree on the version id: {vids}"
        out[_id(lay)] = {"layout": lay, "vid": vids.pop(), "losses": results[0]["losses"],
                         "full": assemble(CFG, lay, {r: res["saved"] for r, res in enumerate(results)})}
    return {"url": url, "versions": out}


def test_each_layout_commits_one_version_with_every_replica_written_once(saved: dict) -> None:
    repo = ckptrepo.open(saved["url"])
    assert len(repo.log()) == len(MATRIX)
    for v in saved["versions"].values():
        m = repo.plumbing.manifest(v["vid"])
        lay = v["layout"]
        assert (m.layout.tp, m.layout.pp, m.layout.dp, m.layout.zero) == (lay.tp, lay.pp, lay.dp, lay.zero)
        assert len(m.layout.ranks) == lay.world_size
        # the version stores the global model and optimizer state once, plus each rank's own RNG state
        full = v["full"]
        logical = sum(t.numel() * 4 for sec in (full["model"], full["optimizer"]["exp_avg"],
                                                full["optimizer"]["exp_avg_sq"]) for t in sec.values())
        rng = sum(t.shape[0] for t in m.tensors if t.name.startswith("rng/torch@rank"))
        itemsize = {t.name: torch.empty(0, dtype=getattr(torch, t.dtype)).element_size() for t in m.tensors}
        stored = [(p.array, math.prod(p.box[1]) * itemsize[t.name]) for t in m.tensors for p in t.pieces]
        assert sum(n for _, n in stored) == logical + rng
        # the layouts share a branch: a piece whose bytes the version before stored already (dedup) is not
        # written again, and size counts what this version wrote
        assert m.size == sum(n for a, n in stored if a.startswith(f"data/{m.id}/"))
        names = {t.name for t in m.tensors}
        assert "model/layers.3.attn.qkv.weight" in names and "optimizer/exp_avg/head.weight" in names
        assert {t.shape[0] for t in m.tensors if t.name.endswith("word_embeddings.weight")} == {CFG.vocab_size}
        assert all(a.digest is not None for a in m.arrays.values())   # every rank's arrays are content-bound
    report = repo.fsck()
    assert report.ok and not any("content-bound" in w for w in report.warnings)


def test_every_layout_records_the_statistics_of_the_global_tensors(saved: dict) -> None:
    """Each rank summarises the pieces it writes; rank 0 merges them per tensor (each element once, however
    the tensor was split or replicated), so the record equals the statistics of the reassembled tensor."""
    repo = ckptrepo.open(saved["url"])
    for key, v in saved["versions"].items():
        record = repo.plumbing.manifest(v["vid"]).tensor_stats
        assert record is not None, key
        rows = record.rows()
        full = {**{f"model/{n}": t for n, t in v["full"]["model"].items()},
                **{f"optimizer/exp_avg_sq/{n}": t for n, t in v["full"]["optimizer"]["exp_avg_sq"].items()}}
        for name, t in full.items():
            x, row = t.double(), rows[name]
            assert (row["min"], row["max"]) == (float(x.min()), float(x.max())), (key, name)
            assert row["norm"] == pytest.approx(float(x.norm()), rel=1e-6), (key, name)
            assert row["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-5, abs=1e-12), (key, name)
        assert repo.stats(v["vid"], "model/*")[0].norm == rows[repo.stats(v["vid"], "model/*")[0].name]["norm"]


def test_the_unsharded_load_equals_the_saved_state(saved: dict) -> None:
    repo = ckptrepo.open(saved["url"])
    for v in saved["versions"].values():
        state = repo.load(v["vid"])
        assert_bit_exact(state["model"], v["full"]["model"])
        assert_bit_exact({k: state["optimizer"][k] for k in ("step", "exp_avg", "exp_avg_sq")}, v["full"]["optimizer"])


@pytest.mark.parametrize("target", MATRIX, ids=_id)
def test_every_version_loads_into_this_layout_bit_exact(saved: dict, target: ParallelLayout) -> None:
    repo = ckptrepo.open(saved["url"])
    lay = with_rules(CFG, target)
    for key, v in saved["versions"].items():
        if key == _id(target):
            continue
        states, needed, read = {}, 0, 0
        for r in range(target.world_size):
            stats = ReadStats()
            before = kvstore_bytes_read()
            with pytest.warns(UserWarning, match="per-rank state rng/seed, rng/torch"):   # a plain int too
                states[r] = repo.load(v["vid"], parallel_layout=lay, rank=r, read_stats=stats)
            read += kvstore_bytes_read() - before
            needed += stats.needed_bytes
            own = sum(t.numel() * t.element_size() for t in _tensors(states[r]))
            assert stats.needed_bytes <= own, f"rank {r} was sent more than it holds"
        assert_bit_exact(assemble(CFG, target, states), v["full"], f"{key}->{_id(target)}")
        assert read >= needed


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


@pytest.mark.parametrize("source,target,use_into", [
    (ParallelLayout(2, 1, 2, zero=1), ParallelLayout(1, 2, 2), True),
    (ParallelLayout(2, 2, 2), ParallelLayout(4, 1, 1), False),
    (ParallelLayout(2, 1, 2, zero=1), ParallelLayout(2, 1, 2, zero=3), True),
    (ParallelLayout(1, 2, 2, zero=3), ParallelLayout(2, 2, 1, zero=1), False),
], ids=["zero1-tp2dp2_to_pp2dp2_into", "tp2pp2dp2_to_tp4_built", "zero1_to_zero3-tp2dp2_into",
        "zero3-pp2dp2_to_zero1-tp2pp2_built"])
def test_training_continues_after_a_reshard_like_the_unchanged_layout(saved: dict, source: ParallelLayout,
                                                                      target: ParallelLayout, use_into: bool) -> None:
    v = saved["versions"][_id(source)]
    losses = launch(target, resume, saved["url"], CFG, v["vid"], AFTER, use_into)
    assert all(run == losses[0] for run in losses), "ranks report different losses"
    assert losses[0] == pytest.approx(v["losses"], rel=1e-5, abs=1e-6)


def _kill_during_snapshot(url: str, victim: int, point: str) -> tuple[list[Any], dict[int, tuple[str, str]]]:
    """Four ranks snapshot twice; ``victim`` dies at ``point`` in the second. The processes and what the
    survivors reported: (first version id, outcome of the second)."""
    ckptrepo.init(url)
    lay = ParallelLayout(2, 1, 2)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp_context()
    results, reports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, lay, store.port, results, snapshot_and_die,
                                               (url, CFG, victim, reports, point)), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 120
    try:
        while len(got) < 3 and time.monotonic() < deadline:
            try:
                rank, first, outcome = reports.get(timeout=1.0)
            except queue.Empty:
                continue
            got[rank] = (first, outcome)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return procs, got


def test_a_rank_killed_during_a_distributed_snapshot_leaves_no_version(tmp_path) -> None:
    url = str(tmp_path / "repo")
    procs, got = _kill_during_snapshot(url, 1, "after_shard_write")
    assert procs[1].exitcode == 17, "the victim did not die where planned"
    assert sorted(got) == [0, 2, 3]
    first = got[0][0]
    for rank, (_, outcome) in got.items():
        assert "not committed" in outcome and "rank" in outcome, f"rank {rank}: {outcome}"
    repo = ckptrepo.open(url)
    assert [v.id for v in repo.log()] == [first]
    state = repo.load(first)
    assert state["optimizer"]["step"] == 0
    assert repo.fsck().ok


def test_snapshots_the_ranks_disagree_about_fail_on_every_rank_and_leave_no_version(tmp_path) -> None:
    """A rank whose own checks fail still joins the metadata collective (the others waited there until the
    process group's timeout); ranks holding one tensor in different dtypes or shapes commit nothing (the
    version used to commit, pass fsck and load other bytes as its dtype)."""
    url = str(tmp_path / "repo")
    ckptrepo.init(url).snapshot({"model": {"w": torch.ones(8, 4)}}, step=0)
    results = launch(ParallelLayout(dp=2), snapshot_disagreeing, url, timeout=60)
    for rank, out in enumerate(results):
        assert out["one rank refuses"].startswith("UnsupportedValueError" if rank == 1 else
                                                  "SnapshotFailedError: rank 1 refused this snapshot"), out
        assert "builtins.set" in out["one rank refuses"]
        assert "w: the ranks disagree about this tensor: rank 0 holds it as float32 [8, 4], rank 1 as " \
               "bfloat16 [8, 4]" in out["dtypes differ"], out
        assert "rank 0 holds it as float32 [8, 4], rank 1 as float32 [16, 2]" in out["shapes differ"], out
        assert "the ranks disagree about the step: rank 0 snapshots step 1, rank 1 step 2" in out["steps differ"], out
        assert all(out[c] == "2" for c in out if c.endswith("all_reduce")), out
        assert out["tp=4 in a group of 2"] == "LayoutError: the layout (tp=4 pp=1 dp=1 zero=0) has 4 ranks but " \
                                              "torch.distributed has 2; pass rank= to load one rank of another layout"
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [0] and repo.fsck().ok


@pytest.mark.parametrize("zero", [0, 3])
def test_a_tensor_parallel_shard_the_rules_take_for_a_replica_is_refused_not_half_lost(tmp_path, zero) -> None:
    """A weight no rule matches is replicated by default; when the tensor-parallel ranks hold different shards
    of it, only one copy was written and the version loaded half a weight, silently. The ranks' fingerprints
    of their copies now disagree at the commit: no version, and every rank is told which tensor and why.
    Under ZeRO-3 the weight sits in each rank's flat partition: fingerprinted there too (it was not)."""
    from support.dist_workers import snapshot_without_the_split_rule
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    results = launch(ParallelLayout(tp=2), snapshot_without_the_split_rule, url, zero)
    for out in results:
        assert "model/col.weight: ranks 0 and 1 hold different values of it, but the layout's rules replicate it " \
               "over tensor-parallel ranks" in out and "Split(0)" in out, results
    repo = ckptrepo.open(url)
    assert repo.log() == [] and repo.fsck().ok


def test_replica_fingerprints_sample_any_size_and_dtype() -> None:
    """Equal copies agree; a change at the start, the middle or the end of a big tensor, a different size, or
    any change in a small one is told apart; bfloat16, bool and 0-d tensors are fingerprinted."""
    from ckptrepo.errors import LayoutError
    from ckptrepo.parallel._replicas import WINDOW_ELEMS, check_replicas, fingerprint
    g = torch.Generator().manual_seed(0)
    big = torch.randn(10 * WINDOW_ELEMS + 7, generator=g)
    assert fingerprint(big) == fingerprint(big.clone())
    n = big.numel()
    for i in (0, (n - WINDOW_ELEMS) // 2 + 5, n - 1):
        other = big.clone()
        other[i] += 1
        assert fingerprint(other) != fingerprint(big), i
    assert fingerprint(big[:-1]) != fingerprint(big)
    small = torch.randn(3, 5, generator=g).bfloat16()
    changed = small.clone()
    changed[1, 2] = 0
    assert fingerprint(small) != fingerprint(changed)
    assert fingerprint(small.t()) != fingerprint(small)        # the same bytes in another row-major order
    for t in (torch.tensor(True), torch.zeros(0, 4), torch.tensor(2.5, dtype=torch.float64)):
        assert isinstance(fingerprint(t), int)
    from ckptrepo.core.schema import RankPart

    def part(rank: int, *fingerprints: list) -> RankPart:
        return RankPart(rank, None, None, (), (), None, (), {}, fingerprints)

    box, other = [[0], [8]], [[0], [4]]
    check_replicas([part(0, ["w", box, 1]), part(1, ["w", box, 1]), part(2, ["w", other, 5]),
                    part(3)])   # another box: not compared
    with pytest.raises(LayoutError, match=r"^w: ranks 0 and 2 hold different values"):
        check_replicas([part(0, ["w", box, 1]), part(1, ["v", box, 2]), part(2, ["w", box, 3])])


def test_per_rank_state_only_a_dropped_saved_rank_holds_is_warned_about_not_misnamed(tmp_path) -> None:
    """A loss scaler on the last of two pipeline stages, loaded into one process: no rank of that load takes
    saved rank 1's per-rank state, so the scaler is not loaded. The warning said it "comes from saved rank 0"
    (which has none), and an unsharded load said nothing."""
    from support.dist_workers import snapshot_with_a_last_stage_scaler
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    launch(ParallelLayout(pp=2), snapshot_with_a_last_stage_scaler, url)
    repo = ckptrepo.open(url)
    dropped = "saved rank 1 of tp=1 pp=2 dp=1 zero=0 holds per-rank state scaler/growth, scaler/scale that no rank"
    for kwargs in ({}, {"parallel_layout": ParallelLayout(pp=1)}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = repo.load("HEAD", **kwargs)
        texts = [str(w.message) for w in caught]
        assert "scaler" not in out and out["seed"] == 100
        assert any(dropped in t for t in texts), texts
        assert not any("scaler" in t and "comes from saved rank 0" in t for t in texts), texts
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the saved layout: every rank its own state, nothing to warn about
        last = repo.load("HEAD", parallel_layout=ParallelLayout(pp=2), rank=1)
    assert last["scaler"]["scale"] == 65536.0 and torch.equal(last["scaler"]["growth"], torch.tensor([7]))
    assert last["seed"] == 101
    with pytest.raises(ckptrepo.LayoutError, match=r"^rank 2 is outside this layout of 2 ranks .* between 0 and 1$"):
        repo.load("HEAD", parallel_layout=ParallelLayout(pp=2), rank=2)   # was an IndexError from the saved trees


def test_an_unsharded_load_on_a_rank_past_0_warns_that_it_gets_rank_0s_per_rank_state(tmp_path) -> None:
    """Every rank of a process group loading without a layout gets the full tensors and saved rank 0's
    per-rank state (documented); rank 1 got rank 0's seed without a word, so a resumed job ran every rank
    on one random stream. Rank 0 loads its own: no warning there."""
    from support.dist_workers import unsharded_load_on_every_rank
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    got = launch(ParallelLayout(tp=2), unsharded_load_on_every_rank, url)
    assert got[0] == [], got
    assert any("this process is rank 1 of 2, but a load without a layout gives every process saved rank 0's "
               "per-rank state (seed); pass parallel_layout=" in w for w in got[1]), got


def test_the_coverage_check_refuses_pieces_outside_the_tensor() -> None:
    """Equal total volume is not coverage: a stray piece must not make up for a missing one."""
    from ckptrepo.core._boxes import check_coverage
    from ckptrepo.errors import LayoutError
    check_coverage({"w": ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))])})
    with pytest.raises(LayoutError, match=r"w: a saved piece \[8:16, 0:2\] lies outside the tensor's shape \[8, 4\]"):
        check_coverage({"w": ((8, 4), [((0, 0), (4, 4)), ((8, 0), (8, 2))])})


def test_a_version_of_uneven_pipeline_stages_loads_unsharded_and_under_another_stage_count(tmp_path) -> None:
    """Saved rules carry the saving layout's stage sizes; an unsharded load (one stage) and a load under
    another stage count without rules fall back to the even split instead of refusing the saved sizes."""
    from support.dist_workers import snapshot_uneven_stages, uneven_stage_state
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    launch(ParallelLayout(pp=2), snapshot_uneven_stages, url, [1, 3])
    repo = ckptrepo.open(url)
    full = uneven_stage_state()
    got = repo.load("HEAD")["model"]
    assert set(got) == set(full) and all(torch.equal(got[k], v) for k, v in full.items())
    last = repo.load("HEAD", parallel_layout=ParallelLayout(pp=4), rank=3)["model"]
    assert set(last) == {"layers.0.w", "head.weight"}
    assert torch.equal(last["layers.0.w"], full["layers.3.w"])
    same = repo.load("HEAD", parallel_layout=ParallelLayout(pp=2), rank=1)["model"]   # the saved sizes: 3 layers
    assert torch.equal(same["layers.2.w"], full["layers.3.w"])


def test_one_name_held_by_two_pipeline_stages_is_refused_not_kept_once(tmp_path) -> None:
    """Layers named without the rules' layer prefix map every stage's layer i to one global name; the merge
    took them for replicas and kept one copy: half the model was gone, and the version loaded and passed fsck."""
    from support.dist_workers import snapshot_unprefixed_layers
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    results = launch(ParallelLayout(pp=2), snapshot_unprefixed_layers, url)
    assert all("model/decoder.layers.0.w: pipeline stages 0 and 1 both hold a tensor of this name" in r
               for r in results), results
    assert ckptrepo.open(url).log() == []


def test_rank_0_killed_after_moving_the_ref_leaves_the_others_told_it_committed(tmp_path) -> None:
    """Rank 0 died between moving the branch and publishing its verdict: the version was committed, yet the
    other ranks waited out the timeout and were told it "may not exist". They now look at the branch."""
    url = str(tmp_path / "repo")
    procs, got = _kill_during_snapshot(url, 0, "after_ref")
    assert procs[0].exitcode == 17, "rank 0 did not die where planned"
    assert sorted(got) == [1, 2, 3] and all(outcome == "committed" for _, outcome in got.values()), got
    assert [v.step for v in ckptrepo.open(url).log()] == [2, 1]
