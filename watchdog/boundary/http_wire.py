"""The bytes of an HTTP/1.1 exchange (http_sockets.py moves them): a request as sent, one a connection, and
an answer that has arrived whole, parsed by http.client (status line, headers, chunked bodies); the names the
package's HTTP client (http_client.py) hands its callers."""

from __future__ import annotations

import http.client
import io
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # a header's name, a method (RFC 9110 token)


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
    seconds: float = 0.0  # from the start of this exchange to its answer

    @property
    def redirect(self) -> bool:
        return 300 <= self.status < 400


@dataclass(frozen=True)
class Call:
    """One exchange of many (request_each)."""

    method: str
    url: urllib.parse.SplitResult
    body: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def request_bytes(call: Call) -> bytes:
    """The request as sent: HTTP/1.1, one exchange a connection."""
    url = call.url
    host = url.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    if url.port is not None:
        shown += f":{url.port}"
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    given = {name.lower() for name in call.headers}
    lines = [f"{call.method} {path} HTTP/1.1"]
    defaults = {"Host": shown, "Accept-Encoding": "identity", "Connection": "close"}
    if call.body is not None:
        defaults["Content-Length"] = str(len(call.body))
    lines += [f"{name}: {value}" for name, value in defaults.items() if name.lower() not in given]
    for name, value in call.headers.items():
        if not TOKEN.match(name) or any(c in value for c in "\r\n\0"):
            raise ValueError("a header name or value that cannot be sent")
        lines.append(f"{name}: {value}")
    if not TOKEN.match(call.method):
        raise ValueError("not a method")
    try:
        head = "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("the URL or a header is not Latin-1") from None
    return head + b"\r\n\r\n" + (call.body or b"")


class _Canned:
    """A whole answer, as http.client reads a socket."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self.raw)


def parsed(raw: bytes, method: str, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of an answer that has arrived whole, from its final status line (the interim answers
    before it left out by the caller); http.client's errors as they come, IncompleteRead for a body shorter
    than its Content-Length."""
    answer = http.client.HTTPResponse(_Canned(raw), method=method)  # type: ignore[arg-type]
    answer.begin()
    body = answer.read(max_bytes + 1)
    if len(body) <= max_bytes and answer.length:  # read() with a size says nothing of a body cut short
        raise http.client.IncompleteRead(body, answer.length)
    return answer.status, body


MAX_INTERIM = 16  # interim (1xx) answers before the final one


class AnswerError(ValueError):
    """An answer this client refuses, said in its own words (none of the server's bytes)."""


def interim(raw: bytes | bytearray, start: int) -> bool:
    """Whether the status line at `start` is an interim (1xx) answer's."""
    words = bytes(raw[start:raw.find(b"\r\n", start)]).split(None, 2)
    return len(words) >= 2 and len(words[1]) == 3 and words[1].startswith(b"1")


def framing(raw: bytearray, head_start: int, head_end: int) -> tuple[int | None, bool]:
    """(the answer's whole length where its head says it: Content-Length, no transfer coding; whether its body
    is chunked). Neither: it ends when the server closes. http.client's errors for a head it refuses."""
    status_end = raw.find(b"\r\n", head_start, head_end)
    headers = http.client.parse_headers(io.BytesIO(bytes(raw[status_end + 2:head_end])))
    coding, length = headers.get("Transfer-Encoding"), headers.get("Content-Length")
    if coding is not None:
        return None, coding.strip().lower() == "chunked"
    if length is None or not length.strip().isdigit() or not length.strip().isascii():
        return None, False
    return head_end + int(length.strip()), False


MAX_CHUNK_LINE = 1024  # a chunk's size line, its extensions with it


def chunks_whole(raw: bytearray, pos: int) -> tuple[int, bool]:
    """Walk the chunks of a chunked body that have arrived whole, from `pos` (a chunk's size line): (where the
    first chunk not yet whole begins, whether the last chunk and its trailers have arrived). Each byte is
    walked once however the body arrives; AnswerError for a size line that is not one."""
    while True:
        line_end = raw.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
        if line_end < 0:
            if len(raw) - pos > MAX_CHUNK_LINE:
                raise AnswerError(f"a chunk size line over {MAX_CHUNK_LINE} bytes")
            return pos, False
        text = bytes(raw[pos:line_end]).split(b";", 1)[0].strip()
        if not text or not all(c in b"0123456789abcdefABCDEF" for c in text):
            raise AnswerError("a chunk size that is not hexadecimal")
        size = int(text, 16)
        if size == 0:
            return pos, raw.find(b"\r\n\r\n", line_end) >= 0
        after = line_end + 2 + size + 2
        if len(raw) < after:
            return pos, False
        pos = after
