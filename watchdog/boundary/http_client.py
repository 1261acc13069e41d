"""The one HTTP client of the package: alert receivers, Alertmanager, Prometheus and the coordinator's
calls to the nodes all go through `request`, so its rules hold for every caller:

- redirects are never followed (a 3xx is returned as it is; the callers treat it as a failure), so a
  token never reaches a host it was not meant for;
- one deadline for the whole exchange (connect, TLS, send, headers and body): a server that trickles its
  answer a byte at a time is cut off when the deadline passes, not after every read;
- the answer's body is read up to `max_bytes` and no further;
- errors name the host, never the URL's path or query (a webhook URL may carry a key) nor a header.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass

DEFAULT_MAX_BYTES = 1 * 2**20


class HttpError(Exception):
    """No answer (unreachable, too slow, too long, not HTTP); the message holds no secret. `reason` is the
    message without the host."""

    def __init__(self, host: str, reason: str, timed_out: bool = False):
        super().__init__(f"{host}: {reason}")
        self.reason = reason
        self.timed_out = timed_out


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    @property
    def redirect(self) -> bool:
        return 300 <= self.status < 400


_INSTANCE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]):\d{1,5}$")


def valid_instance(text: str) -> bool:
    """An `instance` label we put into a URL: host:port (a name, an IPv4 address or [IPv6]) and nothing
    else: no path, no user info, no scheme."""
    return bool(_INSTANCE.match(text)) and 0 < int(text.rsplit(":", 1)[1]) <= 65535


def split(url: str) -> urllib.parse.SplitResult:
    """An http(s) URL with a host, or ValueError (the message does not repeat the URL)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError("not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("the URL holds spaces or control characters")
    return parts


def request(method: str, url: str | urllib.parse.SplitResult, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 10.0, max_bytes: int = DEFAULT_MAX_BYTES,
            ca_file: str | None = None) -> Response:
    target = split(url) if isinstance(url, str) else url
    host = target.hostname or ""
    if target.scheme == "https":
        context = ssl.create_default_context(cafile=ca_file)
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(host, target.port, timeout=timeout,
                                                                             context=context)
    else:
        connection = http.client.HTTPConnection(host, target.port, timeout=timeout)
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    # The socket to cut at the deadline: the connection's while it connects, then kept, because http.client
    # hands a closing connection's socket to the response and forgets it before the body is read.
    held = _Held()
    deadline = threading.Timer(timeout, _cut, (connection, held))
    deadline.daemon = True
    deadline.start()
    try:
        connection.connect()
        held.sock = connection.sock
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        data = answer.read(max_bytes + 1)
        status = answer.status
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reason = (f"no answer within {timeout:g} s" if held.fired
                  else getattr(exc, "strerror", None) or type(exc).__name__)
        raise HttpError(host, reason, held.fired) from None
    finally:
        deadline.cancel()
        connection.close()
    if held.fired:  # cut mid-body: what arrived is not the answer
        raise HttpError(host, f"no answer within {timeout:g} s", timed_out=True)
    if len(data) > max_bytes:
        raise HttpError(host, f"the answer is over {max_bytes} bytes")
    return Response(status, data)


class _Held:
    sock: socket.socket | None = None
    fired = False


def _cut(connection: http.client.HTTPConnection, held: _Held) -> None:
    held.fired = True
    sock = held.sock or connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
