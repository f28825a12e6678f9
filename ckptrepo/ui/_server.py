"""The web page's HTTP server: the page's static files and its JSON endpoints, on 127.0.0.1 only.

The standard library's HTTPServer serves it (docs/decisions/031-trajectory-web-page.md): the page makes a
handful of requests, so it needs no framework and no dependency. A fixed pool of threads answers them, and a
connection that stays silent is closed (``_pool``, docs/decisions/045-web-page-bounds.md). It binds 127.0.0.1
and nothing else, answers only requests whose Host is this address (a web page elsewhere that re-points its
own name at 127.0.0.1, DNS rebinding, cannot read the repository through the browser) and whose Origin, when
the browser names one, is this page (another site's page cannot make the browser ask), and serves GET alone:
it never changes the repository. One Repository serves every request, one request at a time (a lock), as its caches
are not made for concurrent use; static files are served beside it without waiting.
"""
from __future__ import annotations

import errno
import json
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from ckptrepo.errors import ArgumentError, CkptRepoError, RevisionError, first_line
from ckptrepo.ui import _api
from ckptrepo.ui._pool import PooledServing

HOST = "127.0.0.1"

# every file the page is made of: nothing else under static/ is served, so no path can climb out of it
STATIC = {"/": "index.html", "/index.html": "index.html", "/app.js": "app.js", "/app.css": "app.css",
          "/vendor/uPlot.iife.min.js": "vendor/uPlot.iife.min.js", "/vendor/uPlot.min.css": "vendor/uPlot.min.css",
          "/vendor/LICENSE": "vendor/LICENSE"}
TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
# the page loads only its own files and asks only its own server: nothing from the internet
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

LIMITS = {"limit": (1, 100_000, 2000), "max_points": (2, 100_000, 2000), "max_versions": (1, 5000, 300),
          "max_rows": (1, 2000, 200)}
# a glob longer than any tensor name needs: fnmatch's translation of ``[`` without its ``]`` takes time growing
# with the square of the length, under the repository's lock
PATTERN_CHARS = 1000


class BadRequest(CkptRepoError):
    """A query the endpoints cannot answer as asked (unknown path, malformed or out-of-range parameter)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _status(e: CkptRepoError) -> int:
    """The HTTP status of a library error: a revision that names nothing, or a version gc pruned (its data is
    gone), is 404, a wrong argument 400, and any other error (a damaged object) 409, the repository's state
    not allowing the answer."""
    if isinstance(e, BadRequest):
        return e.status
    if isinstance(e, RevisionError):
        return 404
    if isinstance(e, ArgumentError):
        return 400
    return 409


class Query:
    """The parameters of one request, checked: each error names the parameter and what it takes."""

    def __init__(self, query: str) -> None:
        self.params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}

    def text(self, name: str, default: str) -> str:
        value = self.params.get(name, default)
        if not value.strip():
            raise BadRequest(f"parameter {name!r} is empty; give a value or leave it out")
        return value

    def glob(self, name: str, default: str) -> str:
        value = self.text(name, default)
        if len(value) > PATTERN_CHARS:
            raise BadRequest(f"parameter {name!r} is a glob of at most {PATTERN_CHARS} characters, not "
                             f"{len(value)}; shorten it (* matches any run of characters)")
        return value

    def optional(self, name: str) -> str | None:
        return self.params.get(name) or None

    def number(self, name: str) -> int:
        lo, hi, default = LIMITS[name]
        return self._whole(name, lo, hi, default)

    def step(self, name: str) -> int | None:
        return None if not self.params.get(name) else self._whole(name, -2**63, 2**63 - 1, 0)

    def flag(self, name: str, default: bool) -> bool:
        value = self.params.get(name)
        if value is None:
            return default
        if value not in ("0", "1", "true", "false"):
            raise BadRequest(f"parameter {name!r} is 0 or 1, not {value[:40]!r}")
        return value in ("1", "true")

    def _whole(self, name: str, lo: int, hi: int, default: int) -> int:
        value = self.params.get(name)
        if value is None:
            return default
        try:
            n = int(value)
        except ValueError:
            raise BadRequest(f"parameter {name!r} is a whole number, not {value[:40]!r}") from None
        if not lo <= n <= hi:
            raise BadRequest(f"parameter {name!r} is between {lo} and {hi}, not {n}")
        return n


class UIServer(PooledServing, HTTPServer):
    """The server of one repository: ``url`` is where the page is, ``rev`` the revision whose first-parent
    history the metrics and the heatmap follow unless a request names another. Its threads are daemons: a
    browser's open connection does not keep the command from exiting on Ctrl-C."""

    request_queue_size = 128   # connections the kernel holds until accepted: the waiting room takes them quickly

    def __init__(self, repo: Any, port: int, rev: str) -> None:
        self.repo = repo
        self.rev = rev
        self.lock = threading.Lock()
        self.quiet = True
        self.start_pool()   # first: a port that cannot be bound closes the server, and with it the pool
        super().__init__((HOST, port), Handler)

    def server_close(self) -> None:
        super().server_close()
        self.close_pool()

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks DNS for the host's full name (socket.getfqdn), which can stall for
        # seconds on a machine without a resolver; the name is known: it is HOST
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = HOST, self.server_address[1]

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser that went away mid-answer, or stopped reading it, is no error worth a traceback on the
        console."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"


def make_server(repo: Any, port: int = 0, rev: str = "HEAD") -> UIServer:
    """A server for ``repo`` bound to 127.0.0.1:``port`` (0: a free port), not serving yet
    (``serve_forever``); a port in use, or one this user may not bind, is a one-line CkptRepoError."""
    try:
        return UIServer(repo, port, rev)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise CkptRepoError(f"port {port} on {HOST} is in use; pick another with --port, or --port 0 "
                                f"for a free one") from None
        raise CkptRepoError(f"cannot listen on {HOST}:{port}: {first_line(e)}; pick another port with "
                            f"--port") from None


class Handler(BaseHTTPRequestHandler):
    server: UIServer
    server_version = "ckptrepo-ui"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)   # each read and write: a silent client frees its worker

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        if not self.server.quiet:
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        parts = urlsplit(self.path)
        try:
            self._check_host()
            self._check_origin()
            if parts.path in STATIC:
                self._send_static(STATIC[parts.path])
                return
            if not parts.path.startswith("/api/"):
                raise BadRequest(f"no page at {parts.path[:80]!r}; the page is at /", 404)
            answer = self._route(unquote(parts.path), Query(parts.query))
            with self.server.lock:
                data = answer()
            self._send_json(200, data)
        except (BrokenPipeError, ConnectionResetError):
            return   # the browser went away (a reload, a closed tab): no one to answer
        except CkptRepoError as e:
            self._send_json(_status(e), {"error": first_line(e)})
        except Exception as e:  # noqa: BLE001 - the page shows one line; the server goes on serving
            self._send_json(500, {"error": f"{type(e).__name__}: {first_line(e)}"})

    def _refuse(self) -> None:
        self._send_json(405, {"error": f"{self.command} is not served: this page only reads the repository"},
                        allow="GET")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815 - the base class's names

    def _check_host(self) -> None:
        host = self.headers.get("Host")
        if host is not None and host.lower() not in (f"{HOST}:{self.server.port}", f"localhost:{self.server.port}"):
            raise BadRequest(f"this server answers only requests to {HOST}:{self.server.port}", 403)

    def _check_origin(self) -> None:
        origin = self.headers.get("Origin")
        own = (f"http://{HOST}:{self.server.port}", f"http://localhost:{self.server.port}")
        if origin is not None and origin.lower() not in own:
            raise BadRequest(f"this server answers only its own page at {own[0]}/, not a page from "
                             f"{origin[:80]!r}", 403)

    def _route(self, path: str, q: Query) -> Callable[[], Any]:
        repo, rev = self.server.repo, self.server.rev
        if path == "/api/info":
            return lambda: _api.info(repo, rev)
        if path == "/api/graph":
            all_refs, limit, r = q.flag("all", True), q.number("limit"), q.text("rev", rev)
            return lambda: _api.graph(repo, r, all_refs, limit)
        if path == "/api/metrics":
            r, max_points = q.text("rev", rev), q.number("max_points")
            return lambda: _api.metrics(repo, r, max_points)
        if path == "/api/heatmap":
            r, stat, pattern = q.text("rev", rev), q.text("stat", "norm"), q.glob("pattern", "*")
            mv, mr, since, until = q.number("max_versions"), q.number("max_rows"), q.step("since"), q.step("until")
            nonfloat = q.flag("nonfloat", False)
            return lambda: _api.heatmap(repo, r, stat, pattern, mv, mr, since, until, nonfloat)
        for prefix, call in (("/api/version/", lambda v: _api.version(repo, v)),
                             ("/api/diff/", lambda v: _api.diff(repo, v, q.optional("against"),
                                                                q.flag("nonfloat", False)))):
            if path.startswith(prefix) and path[len(prefix):]:
                target = path[len(prefix):]
                return lambda: call(target)
        raise BadRequest(f"no endpoint {path[:80]!r}; see docs/ui.md for the endpoints", 404)

    def _send_static(self, name: str) -> None:
        body = resources.files("ckptrepo.ui").joinpath("static", *name.split("/")).read_bytes()
        self._send(200, body, TYPES.get(name.rsplit(".", 1)[-1], "text/plain; charset=utf-8"))

    def _send_json(self, status: int, data: Any, **headers: str) -> None:
        body = json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
        self._send(status, body, "application/json", **headers)

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        for k, v in headers.items():
            self.send_header(k.title(), v)
        self.end_headers()
        self.wfile.write(body)


def serve(repo: Any, port: int, rev: str, ready: Callable[[UIServer], None] | None = None) -> None:
    """Serve ``repo`` on 127.0.0.1:``port`` until interrupted (Ctrl-C); ``ready`` is called once listening."""
    server = make_server(repo, port, rev)
    try:
        if ready is not None:
            ready(server)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


__all__ = ["HOST", "UIServer", "make_server", "serve"]
