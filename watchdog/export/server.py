"""The HTTP endpoint: /metrics renders the collector's registry, /healthz says whether the loop is
sampling. Optional TLS and basic auth. Served from its own threads: a slow scraper never delays a tick."""

from __future__ import annotations

import base64
import hmac
import os
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from watchdog.config import ExportConfig


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
    if not port.isdigit():
        raise EndpointError(f"export.listen_address: expected host:port, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


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
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if expected is not None and not hmac.compare_digest(self.headers.get("Authorization", ""), expected):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="stall-watchdog"')
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

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise EndpointError(f"export.listen_address: cannot listen on {cfg.listen_address}: "
                                f"{exc.strerror or exc}") from None
        self.server.daemon_threads = True
        if cfg.tls_cert_file:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                self.server.server_close()
                raise EndpointError(f"export.tls_cert_file: cannot load: {exc}") from None
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
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
