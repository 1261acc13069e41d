"""The daemon's HTTP endpoint: /metrics serves the exposition text it is given, /healthz says whether the
loop is sampling, POST /v1/dump hands its body to the dump service (act/dump.py, wired by the composition
root). Optional TLS and basic auth. Served by the package's hardened server (watchdog/boundary/http_server.py:
slow and half-open clients never hold a worker, one deadline per request), so a slow scraper never delays
a tick and a hostile one cannot starve the scrapes.

A dump runs py-spy against the ranks and answers with every rank's stacks, so it needs credentials: basic
auth (export.basic_auth_user) or the bearer token in dump.token_file. With neither it is refused (403,
saying so), on loopback too: any local user reaches loopback. `dump.open_on_loopback` opens it on a
loopback endpoint for single-user nodes and demos.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable

from watchdog.boundary import secrets
from watchdog.boundary.http_server import Auth, HardenedServer, QuietHandler, is_loopback, parse_address, read_body
from watchdog.config import DumpConfig, ExportConfig
from watchdog.export.metrics import EXPOSITION_TYPE
from watchdog.plumbing import logfmt


class EndpointError(Exception):
    """The endpoint cannot start (address in use, unreadable certificate or password)."""


def _password(cfg: ExportConfig) -> str | None:
    """The basic-auth password, None without export.basic_auth_user (EndpointError: a user without one)."""
    if not cfg.basic_auth_user:
        return None
    try:
        password = secrets.read(cfg.basic_auth_password_file, cfg.basic_auth_password_env,
                                "export.basic_auth_password")
    except secrets.SecretError as exc:
        raise EndpointError(str(exc)) from None
    if password is None:
        raise EndpointError("export.basic_auth_user is set: give basic_auth_password_file or _env too")
    return password


def _token(cfg: DumpConfig) -> str | None:
    try:
        token = secrets.read(cfg.token_file, None, "dump.token")
        return secrets.one_line_token(token, "dump.token_file") if token else None
    except secrets.SecretError as exc:
        raise EndpointError(str(exc)) from None


def endpoint_secrets(cfg: ExportConfig, dump: DumpConfig) -> Auth:
    """The endpoint's credentials, read as the endpoint reads them."""
    return Auth(cfg.basic_auth_user, _password(cfg), _token(dump))


def listen_host(cfg: ExportConfig) -> tuple[str, int]:
    """export.listen_address as (host, port), its host resolved to an address this machine can listen on
    (EndpointError where it is not: a name no resolver knows is refused before anything starts)."""
    host, port = parse_address(cfg.listen_address)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise EndpointError(f"export.listen_address: {host!r} is no address to listen on ({reason})") from None
    return host, port


def endpoint_problems(cfg: ExportConfig, dump: DumpConfig) -> list[str]:
    """Everything the endpoint would refuse, each part tried on its own (its password, the dump token, its TLS
    pair): check-config lists them all where `run` stops at the first."""
    problems = []
    for part in (lambda: listen_host(cfg), lambda: _password(cfg), lambda: _token(dump), lambda: endpoint_tls(cfg)):
        try:
            part()
        except EndpointError as exc:
            problems.append(str(exc))
    return problems


def endpoint_tls(cfg: ExportConfig) -> ssl.SSLContext | None:
    """The endpoint's TLS context with its certificate and key loaded, or None without export.tls_cert_file."""
    if not cfg.tls_cert_file:
        return None
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for key, path in (("export.tls_cert_file", cfg.tls_cert_file), ("export.tls_key_file", cfg.tls_key_file)):
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise EndpointError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        tls.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        said = exc.reason if isinstance(exc, ssl.SSLError) and exc.reason else (getattr(exc, "strerror", None) or exc)
        raise EndpointError(f"export.tls_cert_file {cfg.tls_cert_file} and export.tls_key_file "
                            f"{cfg.tls_key_file or '(the key in the certificate file)'}: not a certificate and its "
                            f"private key in PEM ({said})") from None
    return tls


def endpoint_credentials(cfg: ExportConfig, dump: DumpConfig) -> tuple[Auth, ssl.SSLContext | None]:
    """Everything the endpoint loads before it listens: its credentials and its TLS context (EndpointError for the
    first that cannot be had). check-config runs this where a part built before the endpoint failed first."""
    return endpoint_secrets(cfg, dump), endpoint_tls(cfg)


DumpHandler = Callable[[bytes], tuple[int, dict[str, object], "int | None"]]


class Endpoint:
    def __init__(self, cfg: ExportConfig, metrics: Callable[[], bytes], healthy: Callable[[], tuple[bool, str]],
                 dump: DumpHandler | None = None, dump_cfg: DumpConfig | None = None):
        self.cfg = cfg
        limits = dump_cfg or DumpConfig()
        host, port = listen_host(cfg)
        auth, tls = endpoint_credentials(cfg, limits)
        open_dumps = not auth.configured and is_loopback(host) and limits.open_on_loopback
        if dump is not None and not auth.configured and not open_dumps:
            # Off loopback that is a door left shut by mistake (a warning); on loopback, the safe default.
            logfmt.event("dump_refused", level=logfmt.INFO if is_loopback(host) else logfmt.WARNING,
                         listen_address=cfg.listen_address,
                         reason="POST /v1/dump needs dump.token_file or export.basic_auth_user "
                                "(or dump.open_on_loopback on a loopback endpoint of a single-user node)")

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if auth.basic is not None and not auth.allows(self.headers.get("Authorization"), bearer=False):
                    self.reply(401, b"", headers={"WWW-Authenticate": 'Basic realm="stall-watchdog"'})
                    return
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self.reply(200, metrics(), EXPOSITION_TYPE)
                elif path == "/healthz":
                    ok, why = healthy()
                    self.reply(200 if ok else 503, (why + "\n").encode())
                else:
                    self.reply(404, b"stall-watchdog: GET /metrics, GET /healthz, POST /v1/dump\n")

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/v1/dump" or dump is None:
                    self.reply(404, b"stall-watchdog: POST /v1/dump (dump.enabled)\n")
                    return
                if not (open_dumps or auth.allows(self.headers.get("Authorization"))):
                    if not auth.configured:
                        self.reply_json(403, {"error": "dumps need dump.token_file or export.basic_auth_user "
                                                  "(or dump.open_on_loopback on a loopback endpoint); none is "
                                                  "configured"})
                    else:
                        self.reply_json(401, {"error": "POST /v1/dump needs the bearer token or basic auth"},
                                   {"WWW-Authenticate": 'Bearer realm="stall-watchdog"'})
                    return
                body = read_body(self, limits.max_body_bytes, "dump.max_body_bytes")
                if isinstance(body, tuple):
                    self.reply_json(body[0], {"error": body[1]})
                    return
                status, answer, retry = dump(body)
                self.renew_deadline()  # the dump took its time; the client gets the usual deadline to take the reply
                try:
                    self.reply_json(status, answer, {"Retry-After": str(retry)} if retry is not None else None)
                except OSError as exc:  # TimeoutError included: the client left or did not read
                    logfmt.event("dump_reply_lost", level=logfmt.WARNING, status=status,
                                 error=f"{type(exc).__name__}: {exc}")

        self._handler, self._tls, self._address = Handler, tls, (host, port)
        self.server: HardenedServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def listening(self) -> bool:
        return self.server is not None

    @property
    def base_url(self) -> str:
        assert self.server is not None, "the endpoint is not listening: start() it"
        host, port = str(self.server.server_address[0]), self.server.server_address[1]
        scheme = "https" if self.cfg.tls_cert_file else "http"
        return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"

    @property
    def url(self) -> str:
        return self.base_url + "/metrics"

    def start(self) -> None:
        """Listen and serve on a thread of its own (EndpointError if the address cannot be had)."""
        try:
            self.server = HardenedServer(self._address, self._handler, self._tls)
        except OSError as exc:
            raise EndpointError(f"export.listen_address: cannot listen on {self.cfg.listen_address}: "
                                f"{exc.strerror or exc}") from None
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
