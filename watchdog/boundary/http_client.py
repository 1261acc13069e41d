"""The one HTTP client of the package: alert receivers, Alertmanager, Prometheus and the coordinator's
calls to the nodes all go through `request` (one exchange) or `request_each` (many at once), so its rules
hold for every caller:

- redirects are never followed (a 3xx is returned as it is; the callers treat it as a failure), so a
  token never reaches a host it was not meant for;
- one deadline for the whole exchange (connect, TLS, send, headers and body): a server that trickles its
  answer a byte at a time is cut off when the deadline passes, not after every read;
- the answer's body is read up to `max_bytes` and no further;
- errors name the host, never the URL's path or query (a webhook URL may carry a key) nor a header.

Every exchange runs on non-blocking sockets in the caller's thread (http_sockets.py): the coordinator asks
thousands of nodes at once without a thread each.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Sequence

from watchdog.boundary.http_sockets import Fanned, exchange_all
from watchdog.boundary.http_wire import Call, HttpError, Response

__all__ = ["Call", "Fanned", "HttpError", "Response", "request", "request_each", "split", "valid_instance"]

DEFAULT_MAX_BYTES = 1 * 2**20
HELD_BYTES = 64 * 2**20  # answers read but not yet handed over, together, before more are begun


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
    """One exchange: its answer, or HttpError."""
    target = split(url) if isinstance(url, str) else url
    results: list[Response | HttpError] = []
    request_each([Call(method, target, body, headers or {})], lambda _, result: results.append(result), timeout,
                 max_bytes, ca_file)
    if isinstance(results[0], HttpError):
        raise results[0]
    return results[0]


def request_each(calls: Sequence[Call], answered: Callable[[int, Response | HttpError], None],
                 timeout: float = 10.0, max_bytes: int = DEFAULT_MAX_BYTES, ca_file: str | None = None,
                 at_once: int = 1024, held_bytes: int = HELD_BYTES) -> Fanned:
    """Every call at once, up to `at_once` connections open, in this thread; `answered(index, answer or
    HttpError)` for each as it completes, called here (while it runs, the other answers wait in their sockets).
    Each exchange has its own deadline of `timeout` seconds from its start. Returns when every call is
    answered."""
    return exchange_all(calls, answered, timeout, max_bytes, ca_file, at_once, held_bytes)


