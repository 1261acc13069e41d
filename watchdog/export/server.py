"""The HTTP endpoint: /metrics serves the exposition text it is given, /healthz says whether the loop is
sampling, POST /v1/dump hands its body to the dump service (act/dump.py, wired by the composition root).
Optional TLS and basic auth. Served from its own threads: a slow scraper never delays a tick.

A dump runs py-spy against the ranks, so it is never open to the network unauthenticated: off loopback,
POST /v1/dump needs basic auth (export.basic_auth_user) or the bearer token in dump.token_file, and is
refused (403, saying so) when neither is configured.

Hostile clients cost only themselves: at most MAX_CONNECTIONS are served at once (the rest are closed at
once and counted), each connection has CLIENT_TIMEOUT_SECONDS to send its request (and to finish the TLS
handshake, which runs on the connection's own thread, never in the accept loop), the listen backlog is
real, and every failure is one log line, never a traceback.
"""

from __future__ import annotations

import base64
import errno
import hmac
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from watchdog import logfmt
from watchdog.config import DumpConfig, ExportConfig

MAX_CONNECTIONS = 64
CLIENT_TIMEOUT_SECONDS = 10.0
BACKLOG = 128


class EndpointError(Exception):
    """The endpoint cannot start (address in use, unreadable certificate or password)."""


def _password(cfg: ExportConfig) -> str | None:
    if cfg.basic_auth_password_file:
        try:
            return Path(cfg.basic_auth_password_file).read_text().strip()
        except OSError as exc:
            raise EndpointError(f"export.basic_auth_password_file: cannot read: {exc.strerror or exc}") from None
    if cfg.basic_auth_password_env:
        value = os.environ.get(cfg.basic_auth_password_env)
        if value is None:
            raise EndpointError(f"export.basic_auth_password_env: {cfg.basic_auth_password_env} is not set")
        return value
    return None


def _token(cfg: DumpConfig) -> str | None:
    if cfg.token_file is None:
        return None
    try:
        token = Path(cfg.token_file).read_text().strip()
    except OSError as exc:
        raise EndpointError(f"dump.token_file: cannot read: {exc.strerror or exc}") from None
    if not token:
        raise EndpointError("dump.token_file: the file is empty")
    return token


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


DumpHandler = Callable[[bytes], tuple[int, dict[str, object], "int | None"]]


class QuietHandler(BaseHTTPRequestHandler):
    """The handler both HTTP services build on: every read bounded, replies with a length, no access log
    (scrapes and webhooks are not events)."""

    timeout = CLIENT_TIMEOUT_SECONDS  # a slow client's every read

    def reply(self, status: int, body: bytes, kind: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def reply_json(self, status: int, data: object, headers: dict[str, str] | None = None) -> None:
        self.reply(status, (json.dumps(data, default=str) + "\n").encode(), "application/json", headers)

    def log_message(self, format: str, *args: object) -> None:
        return None


def read_body(handler: BaseHTTPRequestHandler, limit: int, what: str) -> bytes | tuple[int, str]:
    """A request's body, or (status, reason) when it is chunked (411: give its length) or over `limit` (413).
    A request with neither Content-Length nor Transfer-Encoding has an empty body (`curl -X POST URL`)."""
    given = handler.headers.get("Content-Length")
    if given is None:
        if handler.headers.get("Transfer-Encoding"):
            return 411, "Content-Length required"
        return b""
    try:
        length = int(given)
    except ValueError:
        return 400, "Content-Length is not a number"
    if not 0 <= length <= limit:
        return 413, f"body over {what} ({limit} bytes)"
    return handler.rfile.read(length)


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)  # validated by the config model


class HardenedServer(ThreadingHTTPServer):
    """A threaded HTTP server that bounds what hostile clients can cost (see the module docstring)."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 tls: ssl.SSLContext | None):
        self.family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)  # out of descriptors: back off instead of spinning on a readable socket
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                logfmt.event("http_connection_refused", level=logfmt.WARNING, reason="too many connections",
                             limit=MAX_CONNECTIONS, refused=self.refused)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(CLIENT_TIMEOUT_SECONDS)
            if self.tls is not None:
                request = self.tls.wrap_socket(request, server_side=True)  # the handshake, on this thread
            super().process_request_thread(request, client_address)
        except (OSError, ssl.SSLError) as exc:
            logfmt.event("http_client_failed", level=logfmt.INFO, error=type(exc).__name__)
            self.shutdown_request(request)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # One line, never a traceback: a client that hangs up mid-response is the client's business.
        import sys

        logfmt.event("http_client_failed", level=logfmt.INFO, error=type(sys.exc_info()[1]).__name__)


class Endpoint:
    def __init__(self, cfg: ExportConfig, metrics: Callable[[], bytes], healthy: Callable[[], tuple[bool, str]],
                 dump: DumpHandler | None = None, dump_cfg: DumpConfig | None = None):
        self.cfg = cfg
        limits = dump_cfg or DumpConfig()
        expected = None
        if cfg.basic_auth_user:
            password = _password(cfg)
            if password is None:
                raise EndpointError("export.basic_auth_user is set: give basic_auth_password_file or _env too")
            expected = "Basic " + base64.b64encode(f"{cfg.basic_auth_user}:{password}".encode()).decode()
        bearer = _token(limits)
        host, port = parse_address(cfg.listen_address)
        open_dumps = expected is None and bearer is None and is_loopback(host)
        if dump is not None and expected is None and bearer is None and not is_loopback(host):
            logfmt.event("dump_refused", level=logfmt.WARNING, listen_address=cfg.listen_address,
                         reason="POST /v1/dump off loopback needs dump.token_file or export.basic_auth_user")

        def matches(given: bytes, secret: str | None) -> bool:
            return secret is not None and hmac.compare_digest(given, secret.encode())

        class Handler(QuietHandler):
            def _given(self) -> bytes:
                return self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if expected is not None and not matches(self._given(), expected):
                    self.reply(401, b"", headers={"WWW-Authenticate": 'Basic realm="stall-watchdog"'})
                    return
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self.reply(200, metrics(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok, why = healthy()
                    self.reply(200 if ok else 503, (why + "\n").encode())
                else:
                    self.reply(404, b"stall-watchdog: GET /metrics, GET /healthz, POST /v1/dump\n")

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/v1/dump" or dump is None:
                    self.reply(404, b"stall-watchdog: POST /v1/dump (dump.enabled)\n")
                    return
                given = self._given()
                if not (open_dumps or matches(given, expected) or matches(given, f"Bearer {bearer}" if bearer
                                                                          else None)):
                    if expected is None and bearer is None:
                        self.reply_json(403, {"error": "dumps off loopback need dump.token_file or "
                                                  "export.basic_auth_user; none is configured"})
                    else:
                        self.reply_json(401, {"error": "POST /v1/dump needs the bearer token or basic auth"},
                                   {"WWW-Authenticate": 'Bearer realm="stall-watchdog"'})
                    return
                body = read_body(self, limits.max_body_bytes, "dump.max_body_bytes")
                if isinstance(body, tuple):
                    self.reply_json(body[0], {"error": body[1]})
                    return
                status, answer, retry = dump(body)
                self.reply_json(status, answer, {"Retry-After": str(retry)} if retry is not None else None)

        tls = None
        if cfg.tls_cert_file:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                tls.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise EndpointError(f"export.tls_cert_file: cannot load: {exc}") from None
        try:
            self.server = HardenedServer((host, port), Handler, tls)
        except OSError as exc:
            raise EndpointError(f"export.listen_address: cannot listen on {cfg.listen_address}: "
                                f"{exc.strerror or exc}") from None
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = str(self.server.server_address[0]), self.server.server_address[1]
        scheme = "https" if self.cfg.tls_cert_file else "http"
        return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"

    @property
    def url(self) -> str:
        return self.base_url + "/metrics"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
