"""Per-tensor statistics recorded at capture time, and the questions they answer without tensor data."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo.cli.data import TENSOR_METRICS
from ckptrepo.core.schema import STAT_COLUMNS
from ckptrepo.errors import ArgumentError
from ckptrepo.saving._tensor_stats import DeviceStats, HostStats
from ckptrepo.tools._trajectory import METRICS


def _reference(t: torch.Tensor) -> dict[str, float]:
    x = (t.abs() if t.is_complex() else t).double().reshape(-1)
    finite = x[torch.isfinite(x)]
    out = {"nan": float(torch.isnan(x).sum()), "inf": float(torch.isinf(x).sum())}
    if finite.numel():
        top = float(finite.abs().max()) or 1.0   # scaled: 1e200 squared overflows float64
        out.update(norm=top * float((finite / top).norm()), mean=float(finite.mean()),
                   std=top * float((finite / top).std(correction=0)),
                   min=float(finite.min()), max=float(finite.max()), absmax=float(finite.abs().max()))
    return out


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 1000, generator=g)
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), float("inf"), -float("inf")
    return {"fp32": torch.randn(700, 300, generator=g) * 1e-3 + 1.0,   # a spread far below its offset
            "bf16": torch.randn(513, generator=g).bfloat16(), "fp16": torch.randn(77, 9, generator=g).half(),
            "int": torch.arange(-5, 100), "bool": torch.tensor([True, False, True]),
            "c64": torch.randn(40, dtype=torch.complex64, generator=g), "nonfinite": w,
            "big": torch.tensor([1e200, -2e200], dtype=torch.float64),
            "tiny": torch.full((64,), 1e-200, dtype=torch.float64), "allnan": torch.full((3,), float("nan")),
            "strided": torch.randn(64, 64, generator=g).t()}


def test_recorded_statistics_match_float64_of_the_values(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    state = _state()
    v = repo.snapshot(state, step=1)
    record = repo.plumbing.manifest(v.id).tensor_stats
    assert record is not None and record.columns == STAT_COLUMNS
    rows = record.rows()
    assert set(rows) == set(state)
    for name, t in state.items():
        ref = _reference(t)
        for col in ("norm", "mean", "std", "min", "max", "absmax"):
            if col in ref:
                assert rows[name][col] == pytest.approx(ref[col], rel=1e-6, abs=1e-6 * (ref["absmax"] or 1)), \
                    (name, col)
            else:
                assert math.isnan(rows[name][col]), (name, col)
        assert (rows[name]["nan"], rows[name]["inf"]) == (ref["nan"], ref["inf"]), name
        assert math.isnan(rows[name]["delta"])   # no parent: nothing measured


def test_stats_and_trajectory_answer_without_tensor_data(tmp_path):
    """With every data array deleted, stats and trajectory still answer from the records (and agree with
    what reading the data gave before)."""
    repo = ckptrepo.init(tmp_path / "r")
    w = torch.randn(50, 20)
    for step in range(6):
        w = w * 1.1
        repo.snapshot({"layer.w": w, "layer.b": torch.full((4,), float(step))}, step=step)
    from ckptrepo.tools._inspect import tensor_stats
    read = {s.name: s for s in tensor_stats(repo.plumbing, "HEAD")}
    before = repo.trajectory("layer.*", "absmax")
    shutil.rmtree(Path(tmp_path / "r" / "data"))
    for s in repo.stats():
        assert s.norm == pytest.approx(read[s.name].norm, rel=1e-6) and s.absmax == read[s.name].absmax
    after = repo.trajectory("layer.*", "absmax")
    assert [(p.version, p.name, p.value) for p in after] == [(p.version, p.name, p.value) for p in before]
    assert [p.value for p in after if p.name == "layer.b"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    m = repo.stat_matrix("layer.w", "norm")
    assert m.recorded == 6 and m.read == []
    assert m.values[0].tolist() == pytest.approx([float(w.norm()) / 1.1 ** (5 - k) for k in range(6)], rel=1e-5)
    r = run("trajectory", "layer.w", "--metric", "max", repo=str(tmp_path / "r"))
    assert r.returncode == 0 and "layer.w" in r.stdout, r.stderr


def test_unchanged_tensors_record_no_change_and_changed_ones_fall_back_to_data(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    frozen = torch.randn(1000)
    trained = torch.ones(100)
    with repo.snapshotter(dedup=True) as snap:
        for step in range(3):
            trained = trained * 2
            snap.snapshot({"frozen": frozen, "trained": trained}, step=step)
            snap.wait()
    m = repo.stat_matrix("frozen", "delta")
    assert m.read == [] and m.present[0].tolist() == [False, True, True] and m.values[0, 1:].tolist() == [0.0, 0.0]
    rel = repo.stat_matrix("trained", "relative-change")
    assert rel.values[0, 1:].tolist() == pytest.approx([1.0, 1.0])
    assert len(rel.read) == 2    # a change capture did not measure is read from the data


def test_sampling_reads_only_the_sampled_versions_and_keeps_the_newest(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    for step in range(20):
        repo.snapshot({"w": torch.full((3,), float(step))}, step=step)
    m = repo.stat_matrix("w", "max", max_versions=5)
    assert len(m.versions) == 5 and m.steps[-1] == 19 and m.steps[0] == 0
    assert m.values[0].tolist() == [float(s) for s in m.steps]
    assert m.to_json()["values"] == [[float(s) for s in m.steps]]


def test_versions_without_records_are_read_and_give_the_same_answers(tmp_path):
    """A version written before the records existed (the format-1 fixture) still answers, from its data."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "format1_repo"
    shutil.copytree(fixture, tmp_path / "old")
    repo = ckptrepo.open(tmp_path / "old")
    m = repo.stat_matrix(None, "norm")
    assert m.recorded == 0 and len(m.read) == len(m.versions) > 0
    stats = {s.name: s for s in repo.stats()}
    assert m.values[[m.names.index(n) for n in stats], -1].tolist() == pytest.approx([s.norm for s in stats.values()])


def test_bad_input_gets_one_line_errors(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    repo.snapshot({"w": torch.ones(3)}, step=1)
    with pytest.raises(ArgumentError, match="no tensor matches 'nothing.*'"):
        repo.trajectory("nothing.*")
    with pytest.raises(ArgumentError, match="unknown metric"):
        repo.stat_matrix("w", "entropy")
    with pytest.raises(ArgumentError, match="max_versions"):
        repo.stat_matrix("w", "norm", max_versions=0)
    r = run("trajectory", "nothing.*", repo=str(tmp_path / "r"))
    assert r.returncode != 0 and "no tensor matches" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_cli_offers_every_statistic():
    assert TENSOR_METRICS == METRICS == STAT_COLUMNS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64,
                                   torch.bool])
def test_device_statistics_agree_with_host_ones(dtype):
    """The CUDA path's arithmetic, run on CPU tensors (the same torch ops), against the host path: every
    dtype (float8 has no reductions of its own), and a low-precision mean does not inflate the spread."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(100_000, generator=g) * 0.01 + 1.0137).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 2 if dtype == torch.bool else 1000, (100_000,), generator=g).to(dtype)
    name = str(dtype).removeprefix("torch.")
    host, dev = HostStats(name), DeviceStats(name)
    for part in x.split(30_000):
        host.update(part.view(torch.uint8).numpy())
        dev.update_device(part)
    assert dev.moments().row(x.numel()) == pytest.approx(host.moments().row(x.numel()), rel=1e-5)
    bad = DeviceStats("float32")
    bad.update_device(torch.tensor([1.0, float("nan"), float("inf")]))
    row = bad.moments().row(3)
    assert row[6:] == (1.0, 1.0) and all(math.isnan(v) for v in row[:6])


@pytest.mark.parametrize("scale", [0.02, 1e30, 1e-30])
def test_float32_statistics_keep_every_digit_of_float64_arithmetic(scale):
    """A float32 tensor fed in pieces, as capture feeds it: its norm, mean and spread are those float64 arithmetic
    gives, to 1e-12, including a mean near zero beside a wide spread (Adam's first moments), and magnitudes whose
    float32 squares would overflow or underflow."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(300_000, generator=g) + 5e-4) * scale
    host = HostStats("float32")
    raw = x.view(torch.uint8).numpy()
    for s in range(0, raw.nbytes, 1 << 18):
        host.update(raw[s:s + (1 << 18)])
    norm, mean, std, lo, hi, absmax, nan, inf = host.moments().row(x.numel())
    ref = x.double()
    assert mean == pytest.approx(float(ref.mean()), rel=1e-12)
    assert std == pytest.approx(float(ref.std(correction=0)), rel=1e-12)
    assert norm == pytest.approx(float(ref.norm()), rel=1e-12)
    assert (lo, hi, absmax, nan, inf) == (float(x.min()), float(x.max()), float(x.abs().max()), 0.0, 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshots_record_statistics_taken_on_the_device(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    t = torch.randn(1000, 100, device="cuda")
    v = repo.snapshot({"w": t}, step=1)
    rows = repo.plumbing.manifest(v.id).tensor_stats.rows()
    ref = _reference(t.cpu())
    assert rows["w"]["norm"] == pytest.approx(ref["norm"], rel=1e-6)
    assert rows["w"]["absmax"] == pytest.approx(ref["absmax"], rel=1e-6)


def test_a_snapshotter_can_leave_the_statistics_out(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    with repo.snapshotter(tensor_stats=False) as snap:
        v = snap.snapshot({"w": torch.ones(4)}, step=1).result()
    assert repo.plumbing.manifest(v.id).tensor_stats is None
    m = repo.stat_matrix("w", "norm")
    assert m.read == [v.id] and m.values.tolist() == [[2.0]]    # read from the data instead
    with pytest.raises(ArgumentError, match="tensor_stats must be True or False"):
        repo.snapshotter(tensor_stats="yes")


def test_a_change_over_one_version_is_empty_not_a_glob_that_matches_nothing(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    repo.snapshot({"w": torch.ones(3)}, step=1)
    assert repo.trajectory("w", "delta") == []
    m = repo.stat_matrix("w", "relative-change", max_versions=10)
    assert m.names == [] and len(m.versions) == 1
    r = run("trajectory", "w", "--metric", "delta", repo=str(tmp_path / "r"))
    assert r.returncode != 0 and "need two versions" in r.stderr
    r = run("trajectory", "w", "--metric", "mean", "--since", "5", repo=str(tmp_path / "r"))
    assert r.returncode != 0 and "need two versions" not in r.stderr
