"""The HTTP endpoint: /metrics renders the collector's registry, /healthz says whether the loop is
sampling. Optional TLS and basic auth. Served from its own threads: a slow scraper never delays a tick.

Hostile clients cost only themselves: at most MAX_CONNECTIONS are served at once (the rest are closed at
once and counted), each connection has CLIENT_TIMEOUT_SECONDS to send its request (and to finish the TLS
handshake, which runs on the connection's own thread, never in the accept loop), the listen backlog is
real, and every failure is one log line, never a traceback.
"""

from __future__ import annotations

import base64
import errno
import hmac
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from watchdog import logfmt
from watchdog.config import ExportConfig

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


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)  # validated by the config model


class _Server(ThreadingHTTPServer):
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
    def __init__(self, cfg: ExportConfig, registry: CollectorRegistry, healthy: Callable[[], tuple[bool, str]]):
        self.cfg = cfg
        expected = None
        if cfg.basic_auth_user:
            password = _password(cfg)
            if password is None:
                raise EndpointError("export.basic_auth_user is set: give basic_auth_password_file or _env too")
            expected = "Basic " + base64.b64encode(f"{cfg.basic_auth_user}:{password}".encode()).decode()
        host, port = parse_address(cfg.listen_address)

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT_SECONDS  # a slow client's every read

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                given = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if expected is not None and not hmac.compare_digest(given, expected.encode()):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="stall-watchdog"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    ok, why = healthy()
                    body, status, kind = (why + "\n").encode(), 200 if ok else 503, "text/plain; charset=utf-8"
                else:
                    body, status, kind = b"stall-watchdog: /metrics, /healthz\n", 404, "text/plain; charset=utf-8"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None  # scrapes are not events

        tls = None
        if cfg.tls_cert_file:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                tls.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise EndpointError(f"export.tls_cert_file: cannot load: {exc}") from None
        try:
            self.server = _Server((host, port), Handler, tls)
        except OSError as exc:
            raise EndpointError(f"export.listen_address: cannot listen on {cfg.listen_address}: "
                                f"{exc.strerror or exc}") from None
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = str(self.server.server_address[0]), self.server.server_address[1]
        scheme = "https" if self.cfg.tls_cert_file else "http"
        return f"{scheme}://{host}:{port}/metrics"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
