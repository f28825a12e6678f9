"""`ckptrepo ui`'s JSON endpoints, against a real server on 127.0.0.1 (an ephemeral port), over a repository
with two branches, a tag and metrics; bad input; a port in use; the command itself."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from support.helpers import run, ui_serving

import ckptrepo
from ckptrepo.tools._graph import graph as graph_rows
from ckptrepo.ui import make_server
from ckptrepo.ui._api import aggregate, group_rows, sample_indices

ROOT = Path(__file__).resolve().parents[2]
BLOWUP_STEP = 4
NAN_STEP = 5


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    scale = 1000.0 if step == BLOWUP_STEP else 1.0   # layers.1 blows up at one step
    return {"model": {"layers.0.w": torch.randn(4, 4, generator=g),
                      "layers.1.w": torch.randn(4, 4, generator=g) * scale, "head.b": torch.zeros(3)},
            "opt": {"lr": 0.1, "buf": torch.ones(2) * step}, "step": step,
            "probe": torch.full((2,), float("nan")) if step == NAN_STEP else torch.ones(2)}   # no finite value once


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory):
    """main: steps 1..6 (tag ``best`` at 3); branch ``fix`` from step 3 with steps 4 and 5; HEAD on main."""
    url = str(tmp_path_factory.mktemp("ui") / "repo")
    repo = ckptrepo.init(url)
    for step in range(1, 7):
        repo.snapshot(_state(step), step=step, message=f"step {step}",
                      metrics={"loss": 10.0 / step, "lr": 0.1, "phase": "warm"}, tag="best" if step == 3 else None)
    repo.checkout("best", branch="fix")
    for step in (4, 5):
        repo.snapshot(_state(step + 10), step=step, message=f"fix {step}", metrics={"loss": 1.0 / step})
    repo.checkout("main")
    return url


@pytest.fixture(scope="module")
def server(repo_url):
    with ui_serving(lambda: make_server(ckptrepo.open(repo_url), 0, "HEAD")) as s:
        yield s


def _get(server, path: str, **headers: str) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _json(server, path: str, **headers: str) -> tuple[int, dict]:
    status, h, body = _get(server, path, **headers)
    assert h["Content-Type"] == "application/json", (path, h)
    return status, json.loads(body)


def _ok(server, path: str) -> dict:
    status, data = _json(server, path)
    assert status == 200, (path, data)
    return data


def test_the_server_binds_only_the_loopback_address(server):
    assert server.socket.getsockname()[0] == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.port}/"


def test_the_page_and_its_vendored_plotting_library_are_served(server):
    status, headers, body = _get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'src="app.js"' in body and b'src="vendor/uPlot.iife.min.js"' in body
    assert "default-src 'none'" in headers["Content-Security-Policy"]   # nothing from elsewhere
    for path, marker in (("/app.js", b"renderHeatmap"), ("/app.css", b".graph-row"),
                         ("/vendor/uPlot.iife.min.js", b"uPlot"), ("/vendor/uPlot.min.css", b".uplot"),
                         ("/vendor/LICENSE", b"MIT License")):
        status, _, body = _get(server, path)
        assert status == 200 and marker in body, path
    for path in ("/../pyproject.toml", "/static/app.js", "/_server.py", "/vendor/../_api.py"):
        status, data = _json(server, path)
        assert status == 404 and "error" in data, path


def test_graph_is_log_graph_all_with_refs(server, repo_url):
    data = _ok(server, "/api/graph")
    versions = ckptrepo.open(repo_url).log(all=True)
    expected = graph_rows(versions)
    assert [r["prefix"] for r in data["rows"]] == [r.prefix for r in expected]
    assert [r["version"]["id"] if r["version"] else None for r in data["rows"]] == \
        [r.version.id if r.version else None for r in expected]
    assert data["versions"] == 8 and not data["truncated"]
    refs = {ref for r in data["rows"] if r["version"] for ref in r["version"]["refs"]}
    assert refs == {"HEAD -> main", "fix", "tag: best"}
    assert any(r["version"] is None and "/" in r["prefix"] for r in data["rows"])   # the fork joins
    first = _ok(server, "/api/graph?limit=3")
    assert first["versions"] == 3 and first["truncated"]
    only_fix = _ok(server, "/api/graph?all=0&rev=fix")
    assert [r["version"]["step"] for r in only_fix["rows"]] == [5, 4, 3, 2, 1]


def test_metrics_follow_the_first_parents_of_the_revision(server):
    data = _ok(server, "/api/metrics")
    assert data["x"] == data["steps"] == [1, 2, 3, 4, 5, 6] and data["x_label"] == "step"
    assert data["series"]["loss"] == pytest.approx([10.0 / s for s in range(1, 7)])
    assert "phase" not in data["series"]   # text has no axis
    fix = _ok(server, "/api/metrics?rev=fix")
    assert fix["steps"] == [1, 2, 3, 4, 5]
    assert fix["series"]["lr"] == [0.1, 0.1, 0.1, None, None]   # not recorded on fix: a gap, not a zero
    sampled = _ok(server, "/api/metrics?max_points=3")
    assert sampled["sampled"] and sampled["total"] == 6 and sampled["x"][-1] == 6


def test_sampling_keeps_the_spike_and_the_newest():
    values = [1.0] * 10_000
    values[4321] = 1e6
    keep = sample_indices([values], len(values), 300)
    assert len(keep) <= 301 and 4321 in keep and keep[-1] == 9999
    assert sample_indices([[1.0, 2.0]], 2, 300) == [0, 1]


def test_heatmap_shows_the_layer_that_blew_up(server):
    data = _ok(server, "/api/heatmap?stat=absmax&pattern=model/layers.*")
    assert [r["name"] for r in data["rows"]] == ["model/layers.0.w", "model/layers.1.w"]
    assert data["steps"] == [1, 2, 3, 4, 5, 6] and data["aggregated"] is None and data["tensors"] == 2
    row = data["values"][1]
    assert max(range(6), key=lambda i: row[i]) == BLOWUP_STEP - 1 and row[BLOWUP_STEP - 1] > 100 * row[0]
    sampled = _ok(server, "/api/heatmap?stat=norm&max_versions=3")
    assert len(sampled["versions"]) == 3 and sampled["steps"][-1] == 6   # the newest is always kept
    assert all(len(r) == 3 for r in sampled["values"])
    nan = _ok(server, "/api/heatmap?stat=nan&rev=fix&pattern=model/*")
    assert nan["steps"] == [1, 2, 3, 4, 5] and all(v == 0 for r in nan["values"] for v in r)


def test_heatmap_marks_a_tensor_with_no_finite_value(server):
    data = _ok(server, "/api/heatmap?stat=absmax")
    probe = data["values"][[r["name"] for r in data["rows"]].index("probe")]
    assert probe == [1.0] * (NAN_STEP - 1) + ["nan"] + [1.0]   # not null: it is there, and blew up
    counts = _ok(server, "/api/heatmap?stat=nan&pattern=probe")["values"][0]
    assert counts == [0, 0, 0, 0, 2, 0]
    folded = _ok(server, "/api/heatmap?stat=absmax&max_rows=1")   # one row for everything: still marked
    assert folded["rows"] == [{"name": "model/layers.0.w … (5 tensors)", "tensors": 5}]
    assert folded["values"][0][NAN_STEP - 1] == "nan" and isinstance(folded["values"][0][0], float)


def test_heatmap_folds_rows_into_module_prefixes(server):
    data = _ok(server, "/api/heatmap?stat=absmax&max_rows=3")
    assert [r["name"] for r in data["rows"]] == ["model/*", "opt/buf", "probe"]
    assert data["aggregated"] == "max" and data["tensors"] == 5
    model = next(r for r in data["rows"] if r["name"] == "model/*")
    assert model["tensors"] == 3
    i = data["rows"].index(model)
    assert max(range(6), key=lambda c: data["values"][i][c]) == BLOWUP_STEP - 1   # the blow-up still shows


def test_grouping_and_aggregation_rules():
    names = [f"model/layers.{i}.{p}" for i in range(150) for p in ("attn.q", "attn.k", "w")] + ["opt/lr"]
    groups = group_rows(names, 200)   # one row per layer: every layer alike
    assert [label for label, _ in groups] == [f"model/layers.{i}.*" for i in range(150)] + ["opt/lr"]
    assert groups[7][1] == [21, 22, 23]
    assert [label for label, _ in group_rows(names, 100)] == ["model/layers.*", "opt/lr"]
    assert group_rows(["a", "b"], 5) == [("a", [0]), ("b", [1])]
    values = np.array([[3.0, np.nan], [4.0, np.nan]])
    assert aggregate(values, [("g", [0, 1])], "norm")[0, 0] == pytest.approx(5.0)   # norm of the concatenation
    assert np.isnan(aggregate(values, [("g", [0, 1])], "norm")[0, 1])              # absent from that version
    assert aggregate(values, [("g", [0, 1])], "nan")[0, 0] == 7.0
    assert aggregate(values, [("g", [0, 1])], "absmax")[0, 0] == 4.0


def test_version_detail_has_header_tensors_with_statistics(server, repo_url):
    data = _ok(server, "/api/version/best")
    v = data["version"]
    assert v["step"] == 3 and "tag: best" in v["refs"] and v["id"] == ckptrepo.open(repo_url).resolve("best")
    by_name = {t["name"]: t for t in data["tensors"]}
    assert set(by_name) == {"model/layers.0.w", "model/layers.1.w", "model/head.b", "opt/buf", "probe"}
    assert by_name["opt/buf"]["norm"] == pytest.approx(3 * 2 ** 0.5) and by_name["opt/buf"]["nan"] == 0
    assert by_name["model/head.b"]["shape"] == [3] and by_name["model/head.b"]["dtype"] == "float32"
    assert {"path": "opt/lr", "value": "0.1"} in data["objects"]
    # the snapshot's cost to the loop, as log --stats shows it (no optimizer stepped: the blocking time)
    assert data["capture"]["lost_s"] == data["capture"]["blocking_s"] > 0
    by_branch = _ok(server, "/api/version/fix~1")   # any revision syntax, URL-quoted or not
    assert by_branch["version"]["step"] == 4 and by_branch["version"]["message"] == "fix 4"


def test_diff_is_against_the_first_parent(server, repo_url):
    repo = ckptrepo.open(repo_url)
    data = _ok(server, "/api/diff/@4")
    assert data["a"] == repo.resolve("@3") and data["b"] == repo.resolve("@4") and not data["root"]
    worst = max(data["tensors"], key=lambda t: t["relative"] or 0)
    assert worst["name"] == "model/layers.1.w" and worst["status"] == "changed"
    # per prefix as diff --stat
    assert {p["prefix"] for p in data["prefixes"]} == {"model.layers", "model.head", "opt.buf", "probe"}
    root = _ok(server, "/api/diff/@1")
    assert root["root"] and root["a"] is None and root["tensors"] == []
    against = _ok(server, "/api/diff/fix?against=main")
    assert against["a"] == repo.resolve("main") and against["b"] == repo.resolve("fix")


@pytest.mark.parametrize("path,status,words", [
    ("/api/heatmap?stat=bogus", 400, "unknown stat"),
    ("/api/heatmap?pattern=nothing.*", 400, "nothing.*"),
    ("/api/heatmap?max_versions=0", 400, "between"),
    ("/api/heatmap?max_rows=x", 400, "whole number"),
    ("/api/graph?all=maybe", 400, "0 or 1"),
    ("/api/metrics?rev=", 400, "empty"),
    ("/api/version/no-such-rev", 404, "no-such-rev"),
    ("/api/diff/no-such-rev", 404, "no-such-rev"),
    ("/api/metrics?rev=nope", 404, "nope"),
    ("/api/nothing", 404, "no endpoint"),
    ("/api/version/", 404, "no endpoint"),
])
def test_bad_input_is_a_json_error_with_a_4xx(server, path, status, words):
    got, data = _json(server, path)
    assert got == status, data
    assert set(data) == {"error"} and words in data["error"] and "\n" not in data["error"]


def test_only_get_is_served_and_only_to_this_host(server):
    req = urllib.request.Request(server.url + "api/info", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405 and "only reads" in json.loads(e.value.read())["error"]
    status, data = _json(server, "/api/info", Host="evil.example:80")   # DNS rebinding
    assert status == 403 and "127.0.0.1" in data["error"]
    assert _json(server, "/api/info", Host=f"localhost:{server.port}")[0] == 200


def test_serving_changes_nothing_in_the_repository(server, repo_url):
    def listing() -> dict:
        return {p: (s.st_size, s.st_mtime_ns) for p in Path(repo_url).rglob("*") if p.is_file()
                for s in [p.stat()]}
    before = listing()
    for path in ("/api/info", "/api/graph", "/api/metrics", "/api/heatmap?stat=std", "/api/version/HEAD",
                 "/api/diff/HEAD", "/api/version/nope"):
        _get(server, path)
    assert listing() == before


def test_an_empty_repository_shows_an_empty_page(tmp_path):
    s = make_server(ckptrepo.init(str(tmp_path / "empty")), 0, "HEAD")
    threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        assert _ok(s, "/api/graph")["rows"] == []
        assert _ok(s, "/api/metrics")["x"] == []
        assert _ok(s, "/api/heatmap")["rows"] == []
    finally:
        s.shutdown()
        s.server_close()


def test_a_port_in_use_is_a_one_line_error(repo_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("ui", "--port", str(port), repo=repo_url)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and f"port {port}" in r.stderr and "in use" in r.stderr


def test_an_unknown_revision_fails_before_serving(repo_url):
    r = run("ui", "--rev", "nope", "--port", "0", repo=repo_url)
    assert r.returncode != 0 and "nope" in r.stderr and r.stderr.strip().count("\n") == 0


def test_the_command_serves_until_interrupted(repo_url):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CKPTREPO_REPO=repo_url)
    p = subprocess.Popen([sys.executable, "-m", "ckptrepo.cli", "ui", "--port", "0", "--rev", "fix"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "serving" in line and "http://127.0.0.1:" in line, (line, p.stderr.read() if p.poll() else "")
        url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "api/info", timeout=30) as r:
            assert json.loads(r.read())["rev"] == "fix"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        p.stderr.close()


def test_a_browser_that_goes_away_leaves_no_traceback(tmp_path, capsys):
    """A reset connection printed two tracebacks on the console (the answer, then the error page, both
    written to the dead socket); other failures are still reported."""
    repo = ckptrepo.init(tmp_path / "r")
    server = make_server(repo, 0, "HEAD")
    try:
        for err, shown in ((ConnectionResetError(104, "reset"), False), (BrokenPipeError(32, "pipe"), False),
                           (ValueError("a real bug"), True)):
            try:
                raise err
            except Exception:   # noqa: BLE001 - what socketserver does around a handler
                server.handle_error(None, ("127.0.0.1", 1))
            assert bool(capsys.readouterr().err) == shown, err
    finally:
        server.server_close()
