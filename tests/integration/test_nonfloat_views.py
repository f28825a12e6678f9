"""Non-float tensors (an RNG state's uint8 bytes, an int64 step) and optimizer step counters stay out of the
numbers of diff, trajectory, bisect and the page by default, listed as changed or unchanged; the
``include_nonfloat`` keyword counts them."""
from __future__ import annotations

import json
import math
import threading
import urllib.request

import pytest
import torch

import ckptrepo
from ckptrepo.errors import ArgumentError
from ckptrepo.tools._numeric import is_numeric
from ckptrepo.ui import make_server
from ckptrepo.ui._api import heatmap

LEFT_OUT = {"rng/torch", "step", "optim/state/0/step"}


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 4, generator=g) * 0.1, "b": torch.zeros(4) + 0.01 * step},
            "optim": {"state": {"0": {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4) * 0.001 * step}}},
            "rng": {"torch": torch.randint(0, 256, (5056,), dtype=torch.uint8, generator=g)},
            "step": torch.tensor(step)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = ckptrepo.init(str(tmp_path_factory.mktemp("nonfloat") / "repo"))
    for step in (1, 2, 3):
        r.snapshot(_state(step), step=step)
    return r


def test_which_tensors_count():
    assert is_numeric("model/w", "float32", 16) and is_numeric("m/x", "bfloat16", 1)
    assert is_numeric("m/z", "complex64", 4) and is_numeric("m/q", "float8_e4m3fn", 4)
    assert not is_numeric("rng/torch", "uint8", 5056) and not is_numeric("mask", "bool", 4)
    assert not is_numeric("step", "int64", 1) and not is_numeric("optim/state/0/step", "float32", 1)
    assert not is_numeric("optim.state.0.step", "float32", 1)
    assert is_numeric("schedule/step", "float32", 10)   # a tensor of steps is data, not a counter


def test_diff_lists_them_without_numbers(repo):
    d = repo.diff("HEAD~1", "HEAD")
    by_name = {t.name: t for t in d.tensors}
    for name in LEFT_OUT:
        t = by_name[name]
        assert t.status == "changed" and not t.numeric
        assert all(math.isnan(x) for x in (t.l2, t.relative, t.max_abs, t.cosine, t.norm_a, t.norm_b))
        assert t.to_json()["l2"] is None
    w = by_name["model/w"]
    assert w.numeric and 0 < w.l2 < 10 and w.status == "changed"
    groups = {g["prefix"]: g for g in d.by_prefix()}
    assert groups["rng.torch"]["changed"] == 1 and math.isnan(groups["rng.torch"]["l2"])
    # the optimizer's group counts its step counter as a changed tensor, and measures only exp_avg
    assert groups["optim.state"]["tensors"] == 2 and groups["optim.state"]["changed"] == 2
    assert groups["optim.state"]["l2"] == pytest.approx(by_name["optim/state/0/exp_avg"].l2)

    full = {t.name: t for t in repo.diff("HEAD~1", "HEAD", include_nonfloat=True).tensors}
    assert full["rng/torch"].numeric and full["rng/torch"].l2 > 1000
    assert full["step"].l2 == 1.0 and full["optim/state/0/step"].max_abs == 1.0
    assert {g["prefix"]: g for g in repo.diff("HEAD~1", "HEAD", include_nonfloat=True).by_prefix()}[
        "rng.torch"]["l2"] > 1000


def test_diff_judges_a_retyped_tensor_by_the_newer_dtype(tmp_path):
    """Decision 050: the newest dtype decides; a tensor int in A and float in B is a value, one float in A
    and int in B is not."""
    repo = ckptrepo.init(str(tmp_path / "retyped"))
    a = repo.snapshot({"x": torch.arange(4), "y": torch.ones(4)}, step=0).id
    b = repo.snapshot({"x": torch.arange(4.0), "y": torch.ones(4, dtype=torch.int32)}, step=1).id
    rows = {t.name: t for t in repo.diff(a, b).tensors}
    assert rows["x"].status == rows["y"].status == "retyped"
    assert rows["x"].numeric and not rows["y"].numeric


def test_trajectory_and_stat_matrix_leave_them_out(repo):
    names = {p.name for p in repo.trajectory("*")}
    assert names == {"model/w", "model/b", "optim/state/0/exp_avg"}
    assert {p.name for p in repo.trajectory("*", include_nonfloat=True)} == names | LEFT_OUT
    assert {p.name for p in repo.trajectory("*", metric="delta")} == names   # read from data too
    m = repo.stat_matrix(stat="absmax")
    assert float(m.values.max()) < 1 and m.values.shape == (3, 3)
    assert float(repo.stat_matrix(stat="absmax", include_nonfloat=True).values.max()) == 255
    with pytest.raises(ArgumentError, match="only non-float.*include_nonfloat=True"):
        repo.trajectory("rng/*")
    assert [p.value for p in repo.trajectory("step", include_nonfloat=True)] == [1.0, 2.0, 3.0]
    with pytest.raises(ArgumentError, match="include_nonfloat must be True or False"):
        repo.trajectory("*", include_nonfloat=1)


def test_bisect_predicates_skip_them(repo):
    assert repo.bisect(tensor="*", stat="absmax", when="> 100") is None
    hit = repo.bisect(tensor="*", stat="absmax", when="> 100", include_nonfloat=True)
    assert hit is not None and hit.step == 1
    assert repo.bisect(tensor="*", stat="max", when="rises above 1.5") is None
    hit = repo.bisect(tensor="*", stat="max", when="rises above 1.5", include_nonfloat=True)
    assert hit is not None and hit.step == 2   # the step counters pass 1.5 at step 2


def test_the_page_leaves_them_out_of_the_heatmap_and_diff(repo):
    h = heatmap(repo, "HEAD", "absmax", "*", 300, 200)
    assert {r["name"] for r in h["rows"]} == {"model/w", "model/b", "optim/state/0/exp_avg"}
    assert max(v for row in h["values"] for v in row) < 1     # the scale is the model's, not 255
    h = heatmap(repo, "HEAD", "absmax", "*", 300, 200, include_nonfloat=True)
    assert LEFT_OUT <= {r["name"] for r in h["rows"]}
    server = make_server(repo, 0, "HEAD")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        def get(path: str) -> dict:
            with urllib.request.urlopen(server.url + path, timeout=60) as r:
                return json.loads(r.read())
        rows = {t["name"]: t for t in get("api/diff/HEAD")["tensors"]}
        assert rows["rng/torch"]["status"] == "changed" and rows["rng/torch"]["l2"] is None
        rows = {t["name"]: t for t in get("api/diff/HEAD?nonfloat=1")["tensors"]}
        assert rows["rng/torch"]["l2"] > 1000
        assert {r["name"] for r in get("api/heatmap?stat=absmax&nonfloat=1")["rows"]} >= LEFT_OUT
        assert not LEFT_OUT & {r["name"] for r in get("api/heatmap?stat=absmax")["rows"]}
    finally:
        server.shutdown()
        server.server_close()


def test_cli_flag_puts_numbers_back(repo):
    from click.testing import CliRunner

    from ckptrepo.cli.main import cli
    root = repo.url

    def rows(*extra: str) -> dict:
        res = CliRunner().invoke(cli, ["--repo", root, "diff", "HEAD~1", "HEAD", "--json", *extra])
        assert res.exit_code == 0, res.output
        return {t["name"]: t for t in json.loads(res.output)["tensors"]}
    assert rows()["rng/torch"]["l2"] is None
    assert rows("--include-nonfloat")["rng/torch"]["l2"] > 0
    res = CliRunner().invoke(cli, ["--repo", root, "trajectory", "rng/*", "--json"])
    assert res.exit_code != 0 and "--include-nonfloat" in str(res.exception)
    res = CliRunner().invoke(cli, ["--repo", root, "trajectory", "rng/*", "--json", "--include-nonfloat"])
    assert res.exit_code == 0 and len(json.loads(res.output)) == 3
    res = CliRunner().invoke(cli, ["--repo", root, "bisect", "--tensor", "step", "--stat", "max",
                                   "--when", "rises above 1.5", "--include-nonfloat", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["step"] == 2, res.output
