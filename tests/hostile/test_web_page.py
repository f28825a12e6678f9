"""`ckptrepo ui` against clients that misbehave (issue 39): a glob built to be slow, connections that send
nothing or stop half-way, a flood of them, and requests from another site's page. A real server on
127.0.0.1 and real sockets; every wait is bounded by a socket timeout."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest
import torch
from support.helpers import ui_serving

import ckptrepo
from ckptrepo.ui import UIServer, make_server
from ckptrepo.ui._pool import WORKERS
from ckptrepo.ui._server import PATTERN_CHARS

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "the web page"

WAIT = 10.0   # seconds any one answer may take here; the slow glob took far longer, the idle socket forever


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("web") / "repo")
    repo = ckptrepo.init(url)
    for step in (1, 2):
        repo.snapshot({"model": {"w": torch.full((3,), float(step)), "b": torch.zeros(2)}}, step=step)
    return url


@pytest.fixture
def server(repo_url: str) -> Iterator[UIServer]:
    with ui_serving(lambda: make_server(ckptrepo.open(repo_url), 0, "HEAD")) as s:
        yield s


def _get(server: UIServer, path: str, **headers: str) -> tuple[int, dict]:
    req = urllib.request.Request(server.url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` within WAIT seconds (reading what it sends first, if anything)."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(4096):
            pass
    except socket.timeout:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_glob_of_thousands_of_brackets_is_refused_at_once(server: UIServer) -> None:
    status, body = _get(server, "/api/heatmap?pattern=" + "[" * 30_000)
    assert status == 400 and f"at most {PATTERN_CHARS} characters" in body["error"]
    # the longest glob taken is answered (it matches no tensor), and the repository is free again
    status, body = _get(server, "/api/heatmap?pattern=" + "[" * PATTERN_CHARS)
    assert status == 400 and "match" in body["error"]
    status, body = _get(server, "/api/heatmap?pattern=model/*")
    assert status == 200 and body["tensors"] == 2


def test_silent_connections_take_no_thread_and_the_page_is_still_served(server: UIServer) -> None:
    before = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) for _ in range(200)]
    try:
        # accepted in order: once this is answered, the server has accepted every silent one too
        status, body = _get(server, "/api/info")
        assert status == 200 and body["head"]
        assert threading.active_count() <= before + 1, threading.active_count()
        status, _ = _get(server, "/api/heatmap?pattern=model/w")
        assert status == 200
    finally:
        for s in silent:
            s.close()


def test_the_threads_are_a_fixed_pool(server: UIServer) -> None:
    names = [t.name for t in threading.enumerate() if t.name.startswith("ckptrepo-ui")]
    assert len(names) == WORKERS + 1, names   # the workers and the waiting room's thread


def test_a_connection_that_sends_nothing_is_closed(server: UIServer) -> None:
    server.idle_timeout = 0.5
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as s:
        assert _closed_by_server(s)


def test_a_request_that_stops_half_way_frees_its_worker(server: UIServer) -> None:
    server.idle_timeout = 0.5
    stalled = []
    for _ in range(WORKERS + 2):   # more than there are workers: each must give up its worker
        s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        s.sendall(b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # the headers never end
        stalled.append(s)
    try:
        assert all(_closed_by_server(s) for s in stalled)
        assert _get(server, "/api/info")[0] == 200
    finally:
        for s in stalled:
            s.close()


def test_more_silent_connections_than_the_waiting_room_holds_close_the_oldest(server: UIServer) -> None:
    server.max_waiting = 4
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) for _ in range(6)]
    try:
        assert _get(server, "/api/info")[0] == 200
        assert _closed_by_server(silent[0]) and _closed_by_server(silent[1])
    finally:
        for s in silent:
            s.close()


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1"])
def test_a_request_from_another_sites_page_is_refused(server: UIServer, origin: str) -> None:
    status, body = _get(server, "/api/info", Origin=origin)
    assert status == 403 and "its own page" in body["error"]


def test_the_page_itself_may_name_its_origin(server: UIServer) -> None:
    for own in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}"):
        assert _get(server, "/api/info", Origin=own)[0] == 200
