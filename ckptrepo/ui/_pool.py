"""The web page server's connections: a waiting room and a fixed pool of worker threads (docs/decisions/045).

A thread per connection lets anyone on the machine open connections that send nothing and so make threads
without bound. Here an accepted connection waits in a selector, costing no thread, until its request starts
to arrive; then one of ``workers`` threads answers it. A connection that stays silent for ``idle_timeout``
seconds is closed, and when ``max_waiting`` connections wait, the one silent the longest is closed to make
room. A worker reads with the same timeout, so a client that stops half-way through frees its worker.
"""
from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from typing import Any

WORKERS = 8             # the repository answers one request at a time; the rest serve the page's static files
IDLE_TIMEOUT = 15.0     # seconds a connection may stay silent: far above a browser's gap between its requests
MAX_WAITING = 256       # connections waiting for their first byte; under the usual limit of open files


class PooledServing:
    """Mixed into a ``socketserver.TCPServer`` (before it) in place of ``ThreadingMixIn``: ``process_request``
    hands each accepted connection to the waiting room instead of a new thread."""

    workers = WORKERS
    idle_timeout = IDLE_TIMEOUT
    max_waiting = MAX_WAITING

    def start_pool(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        self._room = _WaitingRoom(self)
        self._threads = [threading.Thread(target=self._work, name=f"ckptrepo-ui-{i}", daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._room.admit(request, client_address)

    def ready(self, request: socket.socket, client_address: Any) -> None:
        """A connection whose request has begun to arrive: the next free worker answers it."""
        self._jobs.put((request, client_address))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            request, client_address = job
            try:
                self.finish_request(request, client_address)   # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - one connection's failure is reported and the worker goes on
                self.handle_error(request, client_address)   # type: ignore[attr-defined]
            finally:
                self.shutdown_request(request)   # type: ignore[attr-defined]

    def close_pool(self) -> None:
        self._room.close()
        for _ in self._threads:
            self._jobs.put(None)


class _WaitingRoom:
    """Accepted connections that have sent nothing yet, watched by one thread."""

    def __init__(self, server: PooledServing) -> None:
        self.server = server
        self.selector = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.arrived: list[tuple[socket.socket, Any]] = []
        self.waiting: dict[socket.socket, tuple[Any, float]] = {}   # in order of arrival, so of deadline
        self.closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._run, name="ckptrepo-ui-waiting", daemon=True)
        self.thread.start()

    def admit(self, request: socket.socket, client_address: Any) -> None:
        with self.lock:
            if self.closed:
                self.server.shutdown_request(request)   # type: ignore[attr-defined]
                return
            self.arrived.append((request, client_address))
        self._wake()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self._wake()
        self.thread.join(timeout=5)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):   # a full wake-up buffer already wakes the thread
            pass

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            for request in list(self.waiting):
                self._drop(request)
            self.selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self) -> bool:
        """One wait for a request or a deadline; False once the server closes."""
        now = time.monotonic()
        first = next(iter(self.waiting.values()), None)
        timeout = None if first is None else max(0.0, first[1] - now)
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self._wake_r:
                self._drain()
            else:
                request: socket.socket = key.fileobj   # type: ignore[assignment]
                client_address, _ = self.waiting.pop(request)
                self.selector.unregister(request)
                self.server.ready(request, client_address)
        with self.lock:
            if self.closed:
                return False
            arrived, self.arrived = self.arrived, []
        now = time.monotonic()
        for request, client_address in arrived:
            if len(self.waiting) >= self.server.max_waiting:
                self._drop(next(iter(self.waiting)))   # the one silent the longest
            self.waiting[request] = (client_address, now + self.server.idle_timeout)
            self.selector.register(request, selectors.EVENT_READ)
        while self.waiting:
            request = next(iter(self.waiting))
            if self.waiting[request][1] > now:
                break
            self._drop(request)
        return True

    def _drain(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _drop(self, request: socket.socket) -> None:
        self.waiting.pop(request, None)
        try:
            self.selector.unregister(request)
        except (KeyError, ValueError):
            pass
        self.server.shutdown_request(request)   # type: ignore[attr-defined]


__all__ = ["IDLE_TIMEOUT", "MAX_WAITING", "WORKERS", "PooledServing"]
