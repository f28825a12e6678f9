"""diff and stats: numbers equal a direct computation on loaded tensors, in bounded memory."""
from __future__ import annotations

import json
import math

import pytest
import torch

import ckptrepo
import ckptrepo.errors
from ckptrepo.tools import _inspect as inspect


def two_versions(repo):
    g = torch.Generator().manual_seed(0)
    a = {"layers.0.w": torch.randn(300, 70, generator=g), "layers.1.w": torch.randn(50, generator=g),
         "frozen": torch.randn(40, generator=g), "half": torch.randn(64, generator=g).to(torch.bfloat16),
         "lr": 0.1, "name": "run", "gone": torch.ones(3)}
    repo.snapshot(a, step=1)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items() if k != "gone"}
    b["layers.0.w"] += 0.01 * torch.randn(300, 70, generator=g)
    b["layers.1.w"][7] = float("nan") if False else b["layers.1.w"][7] * 3
    b["half"] += 1
    b["lr"] = 0.05
    b["new"] = torch.zeros(2)
    repo.snapshot(b, step=2)
    return a, b


def test_diff_matches_direct_computation(repo, monkeypatch):
    monkeypatch.setattr(inspect, "CHUNK_BYTES", 4096)   # many chunks per tensor: the streaming path
    a, b = two_versions(repo)
    d = {t.name: t for t in repo.diff("@1", "@2").tensors}
    for name in ("layers.0.w", "layers.1.w", "half"):
        x, y = a[name].double(), b[name].double()
        t = d[name]
        assert t.status == "changed"
        assert t.l2 == pytest.approx(float((y - x).norm()), rel=1e-12)
        assert t.relative == pytest.approx(float((y - x).norm() / x.norm()), rel=1e-12)
        assert t.max_abs == pytest.approx(float((y - x).abs().max()), rel=1e-12)
        assert t.cosine == pytest.approx(float(torch.dot(x.flatten(), y.flatten()) / (x.norm() * y.norm())), rel=1e-12)
    assert d["frozen"].status == "unchanged" and d["frozen"].l2 == 0.0
    assert d["gone"].status == "removed" and d["new"].status == "added"
    objs = {o.path: o for o in repo.diff("@1", "@2").objects}
    assert objs["lr"].status == "changed" and objs["lr"].a == "0.1" and objs["lr"].b == "0.05"
    assert "name" not in objs


def test_stat_groups_by_prefix(repo):
    two_versions(repo)
    groups = {g["prefix"]: g for g in repo.diff("@1", "@2").by_prefix(depth=2)}
    assert groups["layers.0"]["changed"] == 1 and groups["layers.1"]["changed"] == 1
    assert groups["frozen"]["changed"] == 0 and groups["frozen"]["l2"] == 0.0


def test_stats_match_direct_computation(repo, monkeypatch):
    monkeypatch.setattr(inspect, "CHUNK_BYTES", 1024)
    w = torch.randn(1000, 3, dtype=torch.float64)
    w[5, 1] = float("nan")
    w[9, 2] = float("inf")
    repo.snapshot({"w": w, "i": torch.arange(10, dtype=torch.int32)}, step=0)
    s = {t.name: t for t in repo.stats("HEAD")}
    finite = w[torch.isfinite(w)]
    assert s["w"].nan == 1 and s["w"].inf == 1 and s["w"].numel == 3000
    assert s["w"].mean == pytest.approx(float(finite.mean()), rel=1e-12)
    assert s["w"].std == pytest.approx(float(finite.std(unbiased=False)), rel=1e-9)
    assert s["w"].norm == pytest.approx(float(finite.norm()), rel=1e-12)
    assert (s["w"].min, s["w"].max) == (float(finite.min()), float(finite.max()))
    assert s["i"].mean == 4.5 and s["i"].min == 0 and s["i"].max == 9 and not math.isnan(s["i"].std)


def test_norms_of_extreme_values_neither_overflow_nor_pretend(repo, monkeypatch):
    """float64 values past 1e154 overflow when squared; a tensor with no finite value has no norm, not 0."""
    monkeypatch.setattr(inspect, "CHUNK_BYTES", 1024)     # several chunks: the combining step too
    big = torch.full((400,), 1e200, dtype=torch.float64)
    tiny = torch.full((400,), 1e-200, dtype=torch.float64)
    repo.snapshot({"big": big, "tiny": tiny, "inf": torch.full((4,), float("inf"))}, step=1)
    repo.snapshot({"big": big * 2, "tiny": tiny, "inf": torch.full((4,), float("inf"))}, step=2)
    s = {t.name: t for t in repo.stats("@1")}
    assert s["big"].norm == pytest.approx(20 * 1e200, rel=1e-12)
    assert s["tiny"].norm == pytest.approx(20 * 1e-200, rel=1e-12)
    assert s["big"].std < 1e186 and s["big"].mean == pytest.approx(1e200, rel=1e-12)
    assert math.isnan(s["inf"].norm) and s["inf"].inf == 4
    d = {t.name: t for t in repo.diff("@1", "@2").tensors}
    assert d["big"].l2 == pytest.approx(20 * 1e200, rel=1e-12) and d["big"].relative == pytest.approx(1.0)
    assert d["big"].cosine == pytest.approx(1.0, rel=1e-12)
    assert d["tiny"].status == "unchanged" and d["tiny"].norm_a == pytest.approx(20 * 1e-200, rel=1e-12)
    groups = {g["prefix"]: g for g in repo.diff("@1", "@2").by_prefix()}
    assert groups["big"]["relative"] == pytest.approx(1.0)


def test_stats_read_from_the_data_keep_extreme_norms(repo, monkeypatch):
    """The data path (versions without capture-time statistics) scales float64 norms: 1e200s do not overflow."""
    monkeypatch.setattr(inspect, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(inspect, "BLOCK_ELEMS", 64)
    repo.snapshot({"big": torch.full((400,), 1e200, dtype=torch.float64),
                   "tiny": torch.full((400,), 1e-200, dtype=torch.float64), "inf": torch.full((4,), float("inf"))},
                  step=1)
    s = {t.name: t for t in inspect.tensor_stats(repo.plumbing, "@1")}
    assert s["big"].norm == pytest.approx(20 * 1e200, rel=1e-12) and s["big"].std < 1e186
    assert s["tiny"].norm == pytest.approx(20 * 1e-200, rel=1e-12)
    assert math.isnan(s["inf"].norm) and s["inf"].inf == 4


def test_diff_streams_in_bounded_memory(tmp_path):
    """A ~400 MB version pair is diffed with a small, fixed peak of extra memory (measured in a fresh process)."""
    import json
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import json, resource, torch, ckptrepo
        repo = ckptrepo.init({str(tmp_path / 'r')!r})
        state = {{f"t{{i}}": torch.randn(25 << 20 >> 2) for i in range(8)}}   # 200 MB
        repo.snapshot(state, step=1)
        for t in state.values():
            t.add_(0.5)
        repo.snapshot(state, step=2)
        del state
        import gc; gc.collect()
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        base = rss()
        peak = [base]
        import threading, time
        stop = threading.Event()
        def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], rss()); time.sleep(0.002)
        th = threading.Thread(target=watch); th.start()
        d = repo.diff("@1", "@2")
        stop.set(); th.join()
        print(json.dumps({{"growth": peak[0] - base, "changed": sum(t.status == "changed" for t in d.tensors)}}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["changed"] == 8
    assert r["growth"] < 100 << 20, r   # one version is 200 MB, the pair 400 MB


def test_trajectory_and_metric_history(repo, tmp_path):
    g = torch.Generator().manual_seed(4)
    state = {"enc.w": torch.randn(100, generator=g), "dec.w": torch.randn(10, generator=g)}
    history = []
    for step in range(4):
        state["enc.w"] = state["enc.w"] * 1.5
        history.append({k: v.clone() for k, v in state.items()})
        repo.snapshot(state, step=step, metrics={"loss": 4.0 - step})
    norms = repo.trajectory("enc.*", "norm")
    assert [p.step for p in norms] == [0, 1, 2, 3] and {p.name for p in norms} == {"enc.w"}
    for p, h in zip(norms, history):
        # recorded at capture: float32 sums per chunk, merged in float64 (saving/_tensor_stats.py)
        assert p.value == pytest.approx(float(h["enc.w"].double().norm()), rel=1e-6)
    rel = repo.trajectory("*", "relative-change", since=1)
    assert [(p.step, p.name) for p in rel] == [(2, "enc.w"), (2, "dec.w"), (3, "enc.w"), (3, "dec.w")]
    assert all(p.value == pytest.approx(0.5, rel=1e-6) for p in rel if p.name == "enc.w")
    assert all(p.value == 0.0 for p in rel if p.name == "dec.w")
    assert [r["loss"] for r in repo.metrics()] == [4.0, 3.0, 2.0, 1.0]


def test_diff_compares_bits_so_nan_is_unchanged_where_the_bytes_are(repo):
    """A tensor holding NaN saved twice with the same bytes is unchanged (it was "changed": NaN != NaN);
    0.0 against -0.0 is a change of bytes."""
    nan = torch.tensor([float("nan"), 1.0])
    cnan = torch.tensor([complex(float("nan"), 1.0)])
    repo.snapshot({"w": nan, "c": cnan, "z": torch.tensor([0.0])}, step=1)
    repo.snapshot({"w": nan.clone(), "c": cnan.clone(), "z": torch.tensor([-0.0])}, step=2)
    assert {d.name: d.status for d in repo.diff("@1", "@2").tensors} == {"w": "unchanged", "c": "unchanged",
                                                                          "z": "changed"}


def test_diff_sees_changes_of_type_and_sign_and_leaves_uncomputed_norms_empty(repo):
    """True -> 1, 1 -> 1.0 and 0.0 -> -0.0 compare equal in Python, so diff printed no object line for them;
    added and removed tensors had norms of 0.0 in --json, and a dtype change was called "reshaped"."""
    repo.snapshot({"flag": True, "n": 1, "z": 0.0, "same": float("nan"), "old": torch.ones(4),
                   "d": torch.ones(2)}, step=1)
    repo.snapshot({"flag": 1, "n": 1.0, "z": -0.0, "same": float("nan"), "new": torch.ones(4),
                   "d": torch.ones(2, dtype=torch.float64)}, step=2)
    d = repo.diff("@1", "@2")
    assert {o.path: (o.status, o.a, o.b) for o in d.objects} == {
        "flag": ("changed", "True", "1"), "n": ("changed", "1", "1.0"), "z": ("changed", "0.0", "-0.0")}
    tensors = {t.name: t for t in d.tensors}
    assert tensors["d"].status == "retyped"
    for name in ("old", "new", "d"):
        assert math.isnan(tensors[name].norm_a) and math.isnan(tensors[name].norm_b), name


def test_diff_and_show_see_numpy_scalars_dtypes_sizes_and_generators(repo):
    """They were summarised by type ('numpy scalar', 'dtype'), so diff called every change of them unchanged."""
    import numpy as np
    repo.snapshot({"best": np.float32(0.5), "dt": torch.float32, "sz": torch.Size([2, 3]),
                   "g": np.random.default_rng(1), "same": np.int64(7)}, step=1)
    repo.snapshot({"best": np.float32(0.25), "dt": torch.bfloat16, "sz": torch.Size([4]),
                   "g": np.random.default_rng(2), "same": np.int64(7)}, step=2)
    objs = {o.path: o for o in repo.diff("@1", "@2").objects}
    assert (objs["best"].a, objs["best"].b) == (repr(np.float32(0.5)), repr(np.float32(0.25)))
    assert (objs["dt"].a, objs["dt"].b) == ("torch.float32", "torch.bfloat16")
    assert (objs["sz"].a, objs["sz"].b) == ("torch.Size([2, 3])", "torch.Size([4])")
    assert objs["g/state/state"].status == "changed" and "same" not in objs
    shown = dict(repo.show("@2").objects)
    assert shown["dt"] == "torch.bfloat16" and shown["best"] == repr(np.float32(0.25))


def _varied_state(seed: int, n: int = 5000) -> dict[str, torch.Tensor]:
    """Tensors of every kind the fast and the wide paths take, with NaN and Inf where a block has them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 3 + 0.5
    w[17], w[4000] = float("nan"), float("inf")
    offset = torch.randn(n, generator=g) * 1e-3 + 1e4          # a mean that dwarfs the spread: centered sums
    return {"f32": torch.randn(n, generator=g), "f32_nonfinite": w, "f32_offset": offset,
            "bf16": (torch.randn(n, generator=g) * 5).to(torch.bfloat16),
            "f16": torch.randn(n, generator=g).to(torch.float16),
            "f64": torch.randn(n, generator=g, dtype=torch.float64) * 1e100,
            "i32": torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32),
            "u8": torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8),
            "c64": torch.randn(n, generator=g, dtype=torch.complex64),
            "e4m3": torch.randn(n, generator=g).to(torch.float8_e4m3fn)}


def _reference_stats(x: torch.Tensor) -> dict[str, float]:
    v = x.to(torch.complex128).abs() if x.is_complex() else x.to(torch.float64)   # |x| of complex: in float64
    v = v.flatten()
    f = v[torch.isfinite(v)]
    return {"norm": float(f.norm()), "mean": float(f.mean()), "std": float(f.std(unbiased=False)),
            "min": float(f.min()), "max": float(f.max()), "absmax": float(f.abs().max()),
            "nan": int(torch.isnan(v).sum()), "inf": int(torch.isinf(v).sum())}


@pytest.mark.parametrize("chunk,block", [(8 << 20, 1 << 16), (1000, 100)])
def test_stats_of_every_dtype_match_a_float64_reference(repo, monkeypatch, chunk, block):
    """Whole-tensor float64 numbers, whether a tensor is one job and block or split over many (merged pairwise)."""
    monkeypatch.setattr(inspect, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(inspect, "BLOCK_ELEMS", block)
    state = _varied_state(0)
    repo.snapshot(state, step=1)
    got = {s.name: s for s in inspect.tensor_stats(repo.plumbing, "@1")}   # from the data, not the records
    for name, x in state.items():
        ref, s = _reference_stats(x), got[name]
        assert (s.nan, s.inf, s.numel) == (ref["nan"], ref["inf"], x.numel()), name
        for key in ("norm", "mean", "min", "max", "absmax"):
            assert getattr(s, key) == pytest.approx(ref[key], rel=1e-12, abs=1e-300), (name, key)
        assert s.std == pytest.approx(ref["std"], rel=1e-10), name


def _reference_diff(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    wide = torch.complex128 if x.is_complex() else torch.float64
    a, b = x.to(wide).flatten(), y.to(wide).flatten()
    d = b - a
    return {"l2": float(torch.linalg.vector_norm(d)), "max_abs": float(d.abs().max()),
            "norm_a": float(torch.linalg.vector_norm(a)), "norm_b": float(torch.linalg.vector_norm(b)),
            "cosine": float(torch.vdot(a, b).real / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)))}


@pytest.mark.parametrize("chunk,block", [(8 << 20, 1 << 16), (1000, 100)])
def test_diff_of_every_dtype_matches_a_float64_reference(repo, monkeypatch, chunk, block):
    monkeypatch.setattr(inspect, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(inspect, "BLOCK_ELEMS", block)
    a, b = _varied_state(0), _varied_state(1)
    b["f32_nonfinite"] = a["f32_nonfinite"] + 0.25     # NaN and Inf at the same places: NaN and Inf differences
    repo.snapshot(a, step=1)
    repo.snapshot(b, step=2)
    got = {t.name: t for t in repo.diff("@1", "@2", include_nonfloat=True).tensors}   # i32 and u8 measured too
    for name in a:
        ref, t = _reference_diff(a[name], b[name]), got[name]
        assert t.status == "changed", name
        for key in ("l2", "max_abs", "norm_a", "norm_b", "cosine"):
            want = ref[key]
            if math.isnan(want):
                assert math.isnan(getattr(t, key)), (name, key)
            else:
                assert getattr(t, key) == pytest.approx(want, rel=1e-11, abs=1e-12), (name, key)


def test_diff_and_stats_through_tensorstore_equal_the_direct_reads(repo, monkeypatch):
    """The fallback path hands the jobs numpy bytes as the direct reader does: the very same numbers."""
    from ckptrepo.loading import _engine
    repo.snapshot(_varied_state(0), step=1)
    repo.snapshot(_varied_state(1), step=2)

    def numbers():
        return ([t.to_json() for t in repo.diff("@1", "@2", include_nonfloat=True).tensors],
                [s.to_json() for s in inspect.tensor_stats(repo.plumbing, "@2")])
    direct = numbers()
    monkeypatch.setattr(_engine, "DIRECT_READS", False)
    assert numbers() == direct and len(direct[1]) == 10


def _commit_as_two_ranks(repo, w: torch.Tensor, step: int) -> None:
    """``model/w`` as two pieces, rows [0, 170) from "rank" 0 and the rest from "rank" 1 (saving/_pieces.py)."""
    from ckptrepo.core._manifest import new_version_id
    from ckptrepo.saving._pieces import GlobalChunk, commit_chunks, read_branch_base, tensor_order, write_rank_chunks
    from ckptrepo.state._providers import flatten
    base, vid = read_branch_base(repo.plumbing), new_version_id()
    chunks = {0: [GlobalChunk("model/w", tuple(w.shape), (0, 0), w[:170])],
              1: [GlobalChunk("model/w", tuple(w.shape), (170, 0), w[170:])]}
    writes = [write_rank_chunks(repo.plumbing, vid, r, chunks[r], None) for r in (1, 0)]
    tree, _ = flatten({"model": {n.split("/")[1]: torch.empty(0) for n in tensor_order(writes)}})
    commit_chunks(repo.plumbing, vid, writes, tree, 2, step=step, message="", metrics={}, base=base)


@pytest.mark.parametrize("chunk", [8 << 20, 10_000])   # one job, or jobs that cut across the pieces' boundary
def test_diff_and_stats_of_a_tensor_saved_as_pieces_match_a_float64_reference(repo, monkeypatch, chunk):
    """Such a tensor is read through the resharding reader (the path that builds a tensor view)."""
    monkeypatch.setattr(inspect, "CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(600, 64, generator=g)
    b = a + 0.01 * torch.randn(600, 64, generator=g)
    _commit_as_two_ranks(repo, a, 1)
    _commit_as_two_ranks(repo, b, 2)
    assert len(repo.plumbing.manifest(repo.resolve("@2")).tensors[0].pieces) == 2
    stats = inspect.tensor_stats(repo.plumbing, "@2")[0]
    ref = _reference_stats(b)
    for key in ("norm", "mean", "std", "min", "max", "absmax"):
        assert getattr(stats, key) == pytest.approx(ref[key], rel=1e-11, abs=1e-12), key
    t = repo.diff("@1", "@2").tensors[0]
    ref = _reference_diff(a, b)
    assert t.status == "changed"
    for key in ("l2", "max_abs", "norm_a", "norm_b", "cosine"):
        assert getattr(t, key) == pytest.approx(ref[key], rel=1e-11, abs=1e-12), key


def test_a_pattern_reads_only_the_tensors_it_matches_and_shared_bytes_once(repo):
    """on_bytes counts what is read: the matched tensors' bytes of both versions, and a tensor that both
    versions hold as the same stored bytes (dedup) once."""
    g = torch.Generator().manual_seed(3)
    a = {"enc.w": torch.randn(3000, generator=g), "enc.h": torch.randn(700, generator=g).to(torch.bfloat16),
         "dec.w": torch.randn(9000, generator=g), "frozen.w": torch.randn(2000, generator=g)}
    with repo.snapshotter() as snap:     # dedup: the unchanged tensor is not written again
        snap.snapshot(a, step=1)
        snap.wait()
        snap.snapshot({k: (v + 1 if k != "frozen.w" else v) for k, v in a.items()}, step=2)
    read: list[int] = []
    d = repo.diff("@1", "@2", pattern="enc.*", on_bytes=read.append)
    assert [t.name for t in d.tensors] == ["enc.w", "enc.h"]
    assert sum(read) == 2 * (3000 * 4 + 700 * 2)
    read.clear()
    d = repo.diff("@1", "@2", pattern="frozen.*", on_bytes=read.append)
    assert d.tensors[0].status == "unchanged" and sum(read) == 2000 * 4
    assert d.tensors[0].norm_a == pytest.approx(float(a["frozen.w"].double().norm()), rel=1e-12)
    read.clear()
    s = inspect.tensor_stats(repo.plumbing, "@2", pattern="dec.*", on_bytes=read.append)
    assert [x.name for x in s] == ["dec.w"] and sum(read) == 9000 * 4


def test_diff_without_b_is_against_the_first_parent(repo, tmp_path):
    from support.helpers import run
    g = torch.Generator().manual_seed(5)
    repo.snapshot({"w": torch.randn(100, generator=g)}, step=1)
    repo.snapshot({"w": torch.randn(100, generator=g)}, step=2)
    one, two = repo.diff("@2"), repo.diff("@1", "@2")
    assert (one.a, one.b) == (two.a, two.b) and one.tensors == two.tensors
    with pytest.raises(ckptrepo.errors.RevisionError, match="root version.*diff A B"):
        repo.diff("@1")
    url = repo.url if hasattr(repo, "url") else str(tmp_path / "repo")
    explicit = json.loads(run("diff", "@2", "--against-parent", "--json", repo=url).stdout)
    implicit = json.loads(run("diff", "@2", "--json", repo=url).stdout)
    assert explicit == implicit and explicit["b"] == two.b
    for args, needle in ((["diff", "@1", "@2", "--against-parent"], "not both"),
                         (["diff", "@1", "--against-parent"], "root version"),
                         (["diff", "@2", "--pattern", "nothing*"], "matches 'nothing*'")):
        p = run(*args, repo=url)
        line = p.stderr.strip()
        assert p.returncode == 2 and p.stdout == "" and "\n" not in line and needle in line, (args, p.stderr)


def test_tensors_saved_as_several_pieces_are_read_range_by_range(repo, monkeypatch):
    """A layout stores a row-parallel weight as column blocks: jobs cut across the blocks read the right bytes."""
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules, Split
    monkeypatch.setattr(inspect, "CHUNK_BYTES", 3_000_000)   # ranges that start and end inside rows and blocks
    g = torch.Generator().manual_seed(7)
    a = {"model": {"row.weight": torch.randn(256, 8192, generator=g)}}   # as tests/support/dist_workers.split_state
    b = {"model": {"row.weight": a["model"]["row.weight"] * 1.5}}
    layout = ParallelLayout(rules=Rules([("row.weight", Split(1))]))
    repo.snapshot(a, step=1, parallel_layout=layout)
    repo.snapshot(b, step=2, parallel_layout=layout)
    pieces = repo.plumbing.manifest(repo.resolve("@1")).tensors[0].pieces
    assert len(pieces) > 1
    s = inspect.tensor_stats(repo.plumbing, "@1")[0]
    ref = _reference_stats(a["model"]["row.weight"])
    assert s.norm == pytest.approx(ref["norm"], rel=1e-12) and s.mean == pytest.approx(ref["mean"], rel=1e-9)
    assert (s.min, s.max) == (ref["min"], ref["max"])
    t, want = repo.diff("@1", "@2").tensors[0], _reference_diff(a["model"]["row.weight"], b["model"]["row.weight"])
    assert t.l2 == pytest.approx(want["l2"], rel=1e-12) and t.cosine == pytest.approx(want["cosine"], rel=1e-12)
