"""The rules every HTTP service of the package follows (the daemon's endpoint, the coordinator).

Hostile clients cost only themselves:
- a connection is accepted and waits for its request head in the server's one thread (a selector, http_gate.py),
  not in a thread of its own: at most MAX_PENDING wait (the oldest is dropped for a newer one), each for
  HEAD_SECONDS at most, and the TLS handshake runs there too, non-blocking. Half-open and slow clients never hold a
  worker, so hundreds of them cannot make a scrape fail;
- a request whose head is in gets a worker (a thread kept from an earlier request where one is idle, at most
  KEPT_WORKERS, so a scrape every few seconds starts no thread): GETs and POSTs have separate slots (GET_SLOTS,
  POST_SLOTS), so slow POST bodies cannot take the slots scrapes use, and one client address holds at most half of
  each (a client that never reads its answers cannot take every slot from the scraper); when no slot is free the
  client gets a 503 at once;
- every request has one deadline (REQUEST_SECONDS) for its head, its body and its reply, not a limit per
  read or write; a head over MAX_HEAD_BYTES gets a 431;
- a body needs one well-formed Content-Length (digits only, one value), and is refused over its limit;
- `Auth` compares basic and bearer credentials in constant time, the scheme case-insensitively;
- a failure is one log line, never a traceback (a flood of them: the 1st, 10th, 100th and every 1000th,
  counted), and replies carry a length and no access log.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hmac
import io
import ipaddress
import json
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from watchdog.boundary.http_gate import Gate
from watchdog.plumbing import logfmt

REQUEST_SECONDS = 15.0
GET_SLOTS = 48
POST_SLOTS = 16
CLIENT_SHARE = 2  # one client address holds at most 1/CLIENT_SHARE of a kind's slots
BACKLOG = 128
CLIENT_TIMEOUT_SECONDS = 10.0  # one read of a worker, within REQUEST_SECONDS
KEPT_WORKERS = 2  # idle worker threads kept for the next requests


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)  # validated by the config model


class Auth:
    """Who may call: basic auth (a user and password) and/or a bearer token; neither means nobody."""

    def __init__(self, user: str | None = None, password: str | None = None, token: str | None = None):
        self.basic = base64.b64encode(f"{user}:{password}".encode()).decode() if user and password else None
        self.bearer = token or None

    @property
    def configured(self) -> bool:
        return self.basic is not None or self.bearer is not None

    def allows(self, header: str | None, basic: bool = True, bearer: bool = True) -> bool:
        scheme, _, value = (header or "").strip().partition(" ")
        value = value.strip()
        scheme = scheme.lower()
        if basic and scheme == "basic" and self.basic is not None:
            return hmac.compare_digest(value.encode("utf-8", "surrogateescape"), self.basic.encode())
        if bearer and scheme == "bearer" and self.bearer is not None:
            return hmac.compare_digest(value.encode("utf-8", "surrogateescape"), self.bearer.encode())
        return False


class QuietHandler(BaseHTTPRequestHandler):
    """The handler both HTTP services build on: the head already read by the gate, one deadline per
    request, replies with a length, no access log (scrapes and webhooks are not events)."""

    timeout = CLIENT_TIMEOUT_SECONDS
    server: HardenedServer

    def version_string(self) -> str:
        return "stall-watchdog"  # the Server header: not the Python it runs on

    def setup(self) -> None:
        self.connection = self.request
        self.deadline = time.monotonic() + REQUEST_SECONDS
        self.connection.settimeout(CLIENT_TIMEOUT_SECONDS)
        head = self.server.take_head(self.connection)
        self.rfile = io.BufferedReader(_Prefixed(head, self.connection))
        self.wfile = _Writer(self.connection, self.deadline)  # type: ignore[assignment]

    def renew_deadline(self) -> None:
        """A fresh REQUEST_SECONDS for the reply, after work the server itself took long over (a dump may take a
        minute): the deadline bounds what a client makes the server wait for, not the server's own work."""
        self.deadline = time.monotonic() + REQUEST_SECONDS
        self.wfile.deadline = self.deadline  # type: ignore[attr-defined]

    def reply(self, status: int, body: bytes, kind: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        # The head and the body in one write: one send and one segment for a small answer (HTTP/0.9 has no head).
        head = getattr(self, "_headers_buffer", [])
        self._headers_buffer: list[bytes] = []
        self.wfile.write(b"".join(head) + b"\r\n" + body if head else body)

    def reply_json(self, status: int, data: object, headers: dict[str, str] | None = None) -> None:
        self.reply(status, (json.dumps(data, default=str) + "\n").encode(), "application/json", headers)

    def log_message(self, format: str, *args: object) -> None:
        return None


class _Prefixed(io.RawIOBase):
    """The bytes the gate already read, then the socket."""

    def __init__(self, head: bytes, sock: socket.socket):
        self.head, self.sock = head, sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.head:
            size = min(len(buffer), len(self.head))
            buffer[:size] = self.head[:size]
            self.head = self.head[size:]
            return size
        return self.sock.recv_into(buffer)


class _Writer:
    """Sends the reply within the request's deadline: a client that does not read holds its worker no
    longer than that."""

    closed = False

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def write(self, data: bytes) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply was not taken within the request's deadline")
        self.sock.settimeout(left)  # sendall's timeout bounds the whole send
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def read_body(handler: QuietHandler, limit: int, what: str) -> bytes | tuple[int, str]:
    """A request's body, or (status, reason): 411 when chunked, 400 for a malformed or repeated
    Content-Length, 413 over `limit`, 408 when it does not arrive within the request's deadline. A request
    with neither Content-Length nor Transfer-Encoding has an empty body (`curl -X POST URL`)."""
    given = handler.headers.get_all("Content-Length") or []
    if not given:
        if handler.headers.get("Transfer-Encoding"):
            return 411, "Content-Length required"
        return b""
    if len(given) > 1 or not given[0].strip().isascii() or not given[0].strip().isdigit():
        return 400, "Content-Length must be one number"
    if handler.headers.get("Transfer-Encoding"):
        return 400, "both Content-Length and Transfer-Encoding"
    length = int(given[0].strip())
    if length > limit:
        return 413, f"body over {what} ({limit} bytes)"
    chunks, size = [], 0
    while size < length:
        left = handler.deadline - time.monotonic()
        if left <= 0:
            return 408, f"the body did not arrive within {REQUEST_SECONDS:g} s"
        handler.connection.settimeout(min(left, CLIENT_TIMEOUT_SECONDS))
        try:
            chunk = handler.rfile.read1(min(65536, length - size))
        except TimeoutError:
            return 408, f"the body did not arrive within {REQUEST_SECONDS:g} s"
        if not chunk:
            return 400, "the body ended before its Content-Length"
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class HardenedServer(ThreadingHTTPServer):
    """A threaded HTTP server that bounds what hostile clients can cost (see the module docstring)."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 tls: ssl.SSLContext | None):
        self.family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.slots = {"GET": threading.BoundedSemaphore(GET_SLOTS), "POST": threading.BoundedSemaphore(POST_SLOTS)}
        self.refused = 0
        self.client_failures = 0
        self._clients: dict[tuple[str, str], int] = {}  # (kind, client address) -> requests being served
        self._heads: dict[int, bytes] = {}
        self._heads_lock = threading.Lock()
        self._stopped = threading.Event()
        self._stopped.set()  # not serving yet: shutdown() has nothing to wait for
        self.workers = Workers(KEPT_WORKERS)
        super().__init__(address, handler)
        self.gate = Gate(self)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept connections and read their heads until shutdown() (http_gate.py), woken by a connection or by
        shutdown's byte, never by a timer (socketserver's own loop looks for a shutdown every `poll_interval`: two
        wakeups a second on every node for nothing)."""
        self._stopped.clear()
        try:
            self.gate.run()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait until it has returned (at once when it is not running)."""
        self.gate.stop()
        self._stopped.wait()

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)  # out of descriptors: back off instead of spinning on a readable socket
            raise

    def dispatch(self, sock: socket.socket, address: Any, head: bytes) -> None:
        """A connection whose request head is in: a worker thread if its kind has a free slot, else 503."""
        method = head.split(b" ", 1)[0].upper()
        kind = "POST" if method not in (b"GET", b"HEAD") else "GET"
        client = (kind, str(address[0]) if isinstance(address, tuple) and address else "")
        slots = self.slots[kind]
        with self._heads_lock:
            mine = self._clients.get(client, 0)
            if mine >= (GET_SLOTS if kind == "GET" else POST_SLOTS) // CLIENT_SHARE:
                reason = "this client's share of the workers busy"
            elif not slots.acquire(blocking=False):
                reason = "every worker busy"
            else:
                reason = ""
                self._clients[client] = mine + 1
                self._heads[id(sock)] = head
        if reason:
            self._refuse(sock, reason)
            return
        try:
            self.workers.run(lambda: self._work(sock, address, slots, client))
        except BaseException:
            self._done(sock, slots, client)

    def _refuse(self, sock: socket.socket, reason: str) -> None:
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            logfmt.event("http_connection_refused", level=logfmt.WARNING, reason=reason, refused=self.refused)
        with contextlib.suppress(OSError):
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n")
        self.shutdown_request(sock)

    def _done(self, sock: socket.socket, slots: threading.BoundedSemaphore, client: tuple[str, str]) -> None:
        with self._heads_lock:
            self._heads.pop(id(sock), None)
            left = self._clients.pop(client, 1) - 1
            if left:
                self._clients[client] = left
        self.shutdown_request(sock)
        slots.release()

    def client_failed(self, exc: BaseException | None) -> None:
        """A client's connection failed (it hung up, a TLS handshake broke): its business, said in one
        line, and only now and then in a flood."""
        self.client_failures += 1
        if self.client_failures in (1, 10, 100) or self.client_failures % 1000 == 0:
            logfmt.event("http_client_failed", level=logfmt.INFO, error=type(exc).__name__,
                         failures=self.client_failures)

    def take_head(self, sock: socket.socket) -> bytes:
        with self._heads_lock:
            return self._heads.pop(id(sock), b"")

    def _work(self, sock: socket.socket, address: Any, slots: threading.BoundedSemaphore,
              client: tuple[str, str]) -> None:
        try:
            sock.setblocking(True)
            self.finish_request(sock, address)
        except (OSError, ssl.SSLError) as exc:
            self.client_failed(exc)
        except Exception:
            self.handle_error(sock, address)
        finally:
            self._done(sock, slots, client)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # One line, never a traceback: a client that hangs up mid-response is the client's business.
        import sys

        self.client_failed(sys.exc_info()[1])

    def server_close(self) -> None:
        gate = getattr(self, "gate", None)  # absent when listening failed
        if gate is not None:
            gate.close()
        self.workers.stop()
        super().server_close()


class Workers:
    """The threads that serve requests, each kept when its request is done while fewer than `keep` are idle (waiting
    in a queue's get: no wakeup until a request comes), so that a scrape every few seconds starts no thread."""

    def __init__(self, keep: int):
        self._keep = keep
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._stopped = False

    def run(self, job: Callable[[], None]) -> None:
        """`job` on an idle worker, or on a new thread when none is idle (RuntimeError if none can be started)."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._serve, args=(job,), name="http-worker", daemon=True).start()

    def stop(self) -> None:
        """The idle workers end; the busy ones end with their request."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    def _serve(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()
            with self._lock:
                if self._stopped or self._idle >= self._keep:
                    return
                self._idle += 1
            job = self._jobs.get()
