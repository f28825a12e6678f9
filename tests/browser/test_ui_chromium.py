"""The page of `ckptrepo ui` in a real headless Chromium, over a repository made by examples/train_gpt.py.

Chromium's own ``--headless --dump-dom`` (with a virtual time budget, so the page's scripts and requests run)
prints the DOM after the page has drawn itself; the test reads the ids and data attributes the page puts on
what it drew. Skipped when no Chromium is installed (Debian: ``apt-get install chromium``). With
CKPTREPO_UI_SCREENSHOT=PATH it also writes the page's screenshot there (docs/img/ui.png is made so).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from support.helpers import ui_serving

import ckptrepo
from ckptrepo.ui import make_server

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in (os.environ.get("CKPTREPO_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars", "--virtual-time-budget=30000"]


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order, and the one with each id."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.all: list[tuple[str, dict[str, str]]] = []
        self.feed(html)
        self.by_id = {a["id"]: (t, a) for t, a in self.all if "id" in a}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.all.append((tag, {k: v or "" for k, v in attrs}))

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.all if name in a.get("class", "").split()]


def _train(url: str, *args: str) -> None:
    """examples/train_gpt.py's main, in this process (a new interpreter would spend seconds importing torch)."""
    spec = importlib.util.spec_from_file_location("train_gpt_for_ui", ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--repo", url, "--n-embd", "8", "--block-size", "8", "--batch-size", "4", *args]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A trained repository (main: steps 1..8, tag ``best``; branch resume-4 from step 4 up to step 10) and a
    server on it."""
    url = str(tmp_path_factory.mktemp("gpt") / "repo")
    _train(url, "--steps", "8")
    ckptrepo.open(url).tag("best", "main~2")
    _train(url, "--steps", "10", "--resume", "@4")
    repo = ckptrepo.open(url)
    with ui_serving(lambda: make_server(repo, 0, "HEAD")) as server:
        yield repo, server


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"   # a fresh profile per run
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, url], capture_output=True,
                          text=True, timeout=180)


def test_the_page_draws_graph_metrics_heatmap_and_a_version(page, tmp_path):
    repo, server = page
    chosen = repo.version("main~1")
    p = _chromium(tmp_path, f"{server.url}#v={chosen.id}", "--window-size=1400,1000", "--dump-dom")
    assert p.returncode == 0, p.stderr[-2000:]
    dom = Elements(p.stdout)
    body = next(a for t, a in dom.all if t == "body")
    assert body.get("data-state") == "ready" and body.get("data-detail") == "ready", p.stdout[-3000:]

    # the graph: every version of `log --all`, with branch heads and the tag
    everything = repo.log(all=True)
    _, graph = dom.by_id["graph"]
    assert int(graph["data-versions"]) == len(everything) == 14
    rows = dom.with_class("graph-row")
    assert {a["data-version"] for a in rows if "data-version" in a} == {v.id for v in everything}
    assert {a["data-ref"] for a in dom.with_class("ref")} == {"HEAD -> resume-4", "main", "tag: best"}

    # a metric curve: the loss at each version of HEAD's first-parent history, drawn by uPlot
    history = repo.metrics("HEAD")
    charts = {a["data-metric"]: a for a in dom.with_class("metric-chart")}
    assert set(charts) == {"loss", "lr"}
    assert int(charts["loss"]["data-points"]) == len(history) == 10
    assert dom.with_class("uplot") and any(t == "canvas" for t, _ in dom.all)

    # the heatmap: tensors x versions of HEAD, every cell present
    _, heat = dom.by_id["heatmap-canvas"]
    tensors = len(repo.show("HEAD").tensors)
    assert int(heat["data-tensors"]) == tensors and int(heat["data-cols"]) == len(history)
    assert int(heat["data-cells"]) == int(heat["data-rows"]) * len(history) > 0

    # the version chosen by the URL's hash: its header, its tensors with statistics, its diff
    _, detail = dom.by_id["detail"]
    assert detail["data-version"] == chosen.id
    assert int(dom.by_id["tensor-table"][1]["data-rows"]) == tensors
    assert int(dom.by_id["diff"][1]["data-tensors"]) == tensors and int(dom.by_id["diff"][1]["data-changed"]) > 0
    assert "copy-checkout" in dom.by_id and "copy-link" in dom.by_id

    shot = Path(os.environ.get("CKPTREPO_UI_SCREENSHOT") or tmp_path / "ui.png")
    p = _chromium(tmp_path, f"{server.url}#v={chosen.id}", "--window-size=1400,1700", f"--screenshot={shot}")
    assert p.returncode == 0 and shot.stat().st_size > 20_000, p.stderr[-2000:]
