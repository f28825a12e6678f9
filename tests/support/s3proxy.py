"""A small HTTP proxy on 127.0.0.1 in front of moto's S3 server, to model S3 servers moto alone is not.

Every request is forwarded as it came (method, path, query, headers, body) and the reply returned whole. The
``mode`` says what the server in front of the repository looks like:

* ``"plain"``: moto itself, whose conditional PUT checks and then writes without a lock, so racing
  conditional writes to one key can both win;
* ``"atomic"``: mutating requests (PUT, POST, DELETE) to one key are forwarded one at a time, which makes
  moto's check-then-write atomic: what AWS S3 promises for ``If-Match`` / ``If-None-Match``;
* ``"strip"``: ``If-Match`` / ``If-None-Match`` are removed from requests, as by a gateway that ignores
  conditions: every conditional write then succeeds;
* ``"strip-writes"``: they are removed from mutating requests only, as by a server that honours them on
  GET and HEAD (HTTP's conditional reads) and ignores them on PUT: a write whose HEAD check passed
  succeeds even if the object changed in between.

``lose_reply``, when set, picks requests whose reply is lost: such a request is forwarded (so it takes
effect), ``on_lost`` runs, and the client's connection is closed without a reply, so the client retries
the request. ``before_forward``, when set, runs before each request is forwarded (to let another writer
act in between a client's requests). ``requests`` records the method and path of every request seen,
``conditional_puts`` counts the conditional PUTs per path.
"""
from __future__ import annotations

import http.client
import socket
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

MODES = ("plain", "atomic", "strip", "strip-writes")
MUTATING = ("PUT", "POST", "DELETE")
CONDITIONS = ("if-match", "if-none-match")
# not forwarded: they describe this hop (the body is forwarded whole, with its length; 100-continue is answered here)
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "expect"))


@dataclass(frozen=True)
class Request:
    """One request as the proxy received it (header names in lower case)."""

    method: str
    path: str           # without the query
    query: str
    headers: dict[str, str]

    @property
    def conditional(self) -> bool:
        return any(h in self.headers for h in CONDITIONS)


class S3Proxy:
    """The proxy: ``start()``, point clients at ``endpoint``, ``stop()``."""

    def __init__(self, upstream: str, mode: str = "plain") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        up = urlsplit(upstream)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.mode = mode
        self.lose_reply: Callable[[Request], bool] | None = None
        self.on_lost: Callable[[Request], None] | None = None
        self.before_forward: Callable[[Request], None] | None = None
        self.lost: list[Request] = []
        self.requests: list[tuple[str, str]] = []
        self.conditional_puts: Counter[str] = Counter()
        self._key_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start the proxy first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "S3Proxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def count(self, method: str | None = None, contains: str = "") -> int:
        """How many requests (of ``method``, with ``contains`` in their path) the proxy has seen."""
        with self._lock:
            return sum((method is None or m == method) and contains in p for m, p in self.requests)

    def key_lock(self, path: str) -> threading.Lock:
        with self._lock:
            return self._key_locks[path]

    def record(self, req: Request) -> bool:
        """Record ``req``; whether its reply is to be lost."""
        with self._lock:
            self.requests.append((req.method, req.path))
            if req.method == "PUT" and req.conditional:
                self.conditional_puts[req.path] += 1
        pick = self.lose_reply
        return pick is not None and pick(req)

    def forward(self, req: Request, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send ``req`` upstream and return its whole reply: status, reason, headers, body."""
        headers = {k: v for k, v in req.headers.items() if k not in HOP_BY_HOP}
        if self.mode == "strip" or (self.mode == "strip-writes" and req.method in MUTATING):
            headers = {k: v for k, v in headers.items() if k not in CONDITIONS}
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no 40 ms wait on each small write
            target = req.path + (f"?{req.query}" if req.query else "")
            conn.putrequest(req.method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if "content-length" not in headers and (body or req.method in ("PUT", "POST")):
                conn.putheader("content-length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    owner: S3Proxy
    protocol_version = "HTTP/1.1"   # keep-alive, as S3 clients expect

    def log_message(self, format: str, *args: object) -> None:   # noqa: A002 - quiet
        pass

    def setup(self) -> None:
        super().setup()
        # replies go out in a few small writes (status, headers, body): without this, Nagle's algorithm against
        # the client's delayed ACKs costs tens of milliseconds per request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        owner = self.owner
        path, _, query = self.path.partition("?")
        req = Request(self.command, path, query, {k.lower(): v for k, v in self.headers.items()})
        body = self._body()
        lose = owner.record(req)
        if owner.before_forward is not None:
            owner.before_forward(req)
        if owner.mode == "atomic" and req.method in MUTATING:
            with owner.key_lock(path):
                status, reason, headers, data = owner.forward(req, body)
        else:
            status, reason, headers, data = owner.forward(req, body)
        if lose:
            owner.lost.append(req)
            if owner.on_lost is not None:
                owner.on_lost(req)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.send_response_only(status, reason)
        for k, v in headers:
            # a HEAD reply's length is the object's, not the (empty) body's
            if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
