"""The page of `ckptrepo ui` in a real headless Chromium, over a repository made by examples/train_gpt.py.

Chromium's own ``--headless --dump-dom`` (with a virtual time budget, so the page's scripts and requests run)
prints the DOM after the page has drawn itself; the test reads the ids and data attributes the page puts on
what it drew. Layout is asked of the page itself over the DevTools protocol (``--remote-debugging-pipe``,
no client library). Skipped when no Chromium is installed (Debian: ``apt-get install chromium``). With
CKPTREPO_UI_SCREENSHOT=PATH it also writes the page's screenshot there (docs/img/ui.png is made so), and with
CKPTREPO_UI_LAYOUT_SCREENSHOT=PATH the 1400x1000 one.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from support.helpers import ui_serving

import ckptrepo
from ckptrepo.tools._numeric import is_numeric
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

    # the heatmap: tensors x versions of HEAD, every cell present; the RNG states and step counters left out
    _, heat = dom.by_id["heatmap-canvas"]
    tensors = len(repo.show("HEAD").tensors)
    numeric = sum(is_numeric(t["name"], t["dtype"], math.prod(t["shape"])) for t in repo.show("HEAD").tensors)
    assert int(heat["data-tensors"]) == numeric < tensors and int(heat["data-cols"]) == len(history)
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


class DevTools:
    """A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: it reads
    commands on fd 3 and answers on fd 4, JSON messages ending in NUL), so a test can ask the page's layout."""

    def __init__(self, tmp_path: Path) -> None:
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()
        flags = [f for f in FLAGS if not f.startswith("--virtual-time-budget")]
        # bash moves the pipe ends to the fds Chromium expects (no preexec_fn: the server's thread runs; and
        # dash takes only one-digit fds)
        move = f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome} {to_chrome}<&- {from_chrome}>&-'
        self.proc = subprocess.Popen([shutil.which("bash") or "bash", "-c", move, CHROMIUM, *flags,
                                      "--remote-debugging-pipe", f"--user-data-dir={tmp_path / 'profile-devtools'}",
                                      "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(to_chrome, from_chrome))
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf = b""
        self._id = 0
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send a command (to the page's session, if given) and return its result; events are skipped."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 16)
                assert chunk, "Chromium closed the DevTools pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.send(method, self.session, **params)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        got = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in got, got["exceptionDetails"]
        return got["result"].get("value")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._w)
        os.close(self._r)


# What the page's layout is at the window's size, read in the page: the version panel's top, each heatmap row's
# label (its text and where it sits), and how wide the tensor table is against the box it sits in.
LAYOUT = """(() => {
  const rect = (e) => e.getBoundingClientRect();
  const canvas = document.getElementById("heatmap-canvas"), table = document.getElementById("tensor-table");
  return {width: innerWidth, height: innerHeight, detailTop: rect(document.getElementById("detail-panel")).top,
          rows: Number(canvas.dataset.rows), canvasTop: rect(canvas).top,
          labels: [...document.querySelectorAll("#heatmap-labels .heat-label")].map((l) => ({
            row: Number(l.dataset.row), text: l.textContent, top: rect(l).top, bottom: rect(l).bottom,
            visible: rect(l).width > 20 && getComputedStyle(l).visibility === "visible"})),
          table: {scrollWidth: table.parentElement.scrollWidth, clientWidth: table.parentElement.clientWidth,
                  width: rect(table).width, names: table.querySelectorAll("tbody tr").length}};
})()"""


def test_at_1400_by_1000_the_version_panel_shows_every_row_is_labelled_nothing_scrolls_sideways(page, tmp_path):
    repo, server = page
    chosen = repo.version("main~1")
    chrome = DevTools(tmp_path)
    try:
        chrome.page("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1, mobile=False)
        chrome.page("Page.navigate", url=f"{server.url}#v={chosen.id}")
        ready = "document.body.dataset.state === 'ready' && document.body.dataset.detail === 'ready'"
        deadline = time.monotonic() + 120
        while not chrome.eval(f"document.readyState === 'complete' && {ready}"):
            assert time.monotonic() < deadline, chrome.eval("document.body.outerHTML.slice(0, 3000)")
            time.sleep(0.2)
        got = chrome.eval(LAYOUT)
        shot = base64.b64decode(chrome.page("Page.captureScreenshot", format="png")["data"])
    finally:
        chrome.close()
    Path(os.environ.get("CKPTREPO_UI_LAYOUT_SCREENSHOT") or tmp_path / "ui-1400x1000.png").write_bytes(shot)

    assert (got["width"], got["height"]) == (1400, 1000)
    assert 0 <= got["detailTop"] < got["height"] - 40, got   # the panel's heading is on the first screen
    labels = got["labels"]
    assert got["rows"] > 1 and [lab["row"] for lab in labels] == list(range(got["rows"])), got
    for above, lab in zip([None, *labels], labels):
        assert lab["text"].strip() and lab["visible"] and lab["bottom"] - lab["top"] >= 11, lab
        assert above is None or lab["top"] >= above["bottom"] - 0.5, (above, lab)   # one row each, no overlap
    t = got["table"]
    assert t["names"] == len(repo.show(chosen.id).tensors)
    assert t["scrollWidth"] <= t["clientWidth"] and t["width"] <= t["clientWidth"], t
