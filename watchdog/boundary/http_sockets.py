"""The sockets under the package's HTTP client (http_client.py, where its rules are said): every exchange of a
`request_each` on non-blocking sockets in the caller's thread, one selector for all. Each answer is handed
over as it arrives whole, in this thread, while the others wait in their sockets; once the bytes read and not
yet handed over pass a budget, no further answer is begun, so a thousand answers arriving at once are not all
held at once. What goes on the wire and how an answer is read are http_wire.py's."""

from __future__ import annotations

import contextlib
import errno
import http.client
import ipaddress
import os
import queue
import selectors
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from watchdog.boundary.http_wire import (
    MAX_INTERIM,
    AnswerError,
    Call,
    HttpError,
    Response,
    chunks_whole,
    framing,
    interim,
    parsed,
    request_bytes,
)

_HEAD_BYTES = 64 * 1024  # an answer's status line and headers
_RESOLVERS = 16  # host names looked up at once (a lookup blocks; addresses need none)
_READ = 64 * 1024
_READS_A_TURN = 16  # reads of one socket before the others (and the deadlines) have their turn
_WHOLE = "whole"  # an exchange's answer has all arrived


@dataclass(frozen=True)
class Fanned:
    """What many exchanges at once held: the most bytes of answers read and not yet handed over (each begun
    answer counted at the length its head gives), and how many answers waited in their sockets meanwhile."""

    peak_held: int
    parked: int


class _Exchange:
    """One call's connection, from its address to its answer."""

    def __init__(self, index: int, call: Call, started: float):
        self.index, self.call, self.started = index, call, started
        self.host = call.url.hostname or ""
        self.port = call.url.port or (443 if call.url.scheme == "https" else 80)
        self.sock: socket.socket | None = None
        self.addresses: list[tuple[int, tuple[object, ...]]] = []
        self.out = memoryview(b"")
        self.state = "resolving"  # resolving, connecting, handshake, sending, reading, done
        self.raw = bytearray()
        self.expected: int | None = None
        self.chunked = False
        self.head_start, self.head_end = 0, -1  # the final answer's head (after any interim 1xx ones)
        self.chunk_at = 0  # in a chunked body, where the first chunk not yet whole begins
        self.reserved = 0  # of the bytes held: its length as its head says, else what has come
        self.last_error = ""


class _Fanout:
    def __init__(self, calls: Sequence[Call], answered: Callable[[int, Response | HttpError], None],
                 timeout: float, max_bytes: int, ca_file: str | None, at_once: int, held_bytes: int):
        self.calls, self.answered, self.timeout, self.max_bytes = calls, answered, timeout, max_bytes
        self.ca_file, self.at_once, self.held_budget = ca_file, at_once, held_bytes
        # a body of max_bytes, its head, and the framing of a chunked body
        self.raw_cap = max_bytes + _HEAD_BYTES + max_bytes // 16 + 1
        self.selector = selectors.DefaultSelector()
        self.pending = deque(range(len(calls)))
        self.running: deque[_Exchange] = deque()  # in order of start: their deadlines come in the same order
        self.open = 0
        self.held = 0  # bytes of answers being read: each counts as long as its head says it is
        self.peak_held = 0
        self.parked_total = 0  # answers that waited in their sockets for the bytes held to fall
        self.again: list[_Exchange] = []  # TLS sockets left with bytes already decrypted: read next turn
        self.parked: deque[_Exchange] = deque()  # answers ready to be read, waiting for held bytes to fall
        self.resolved: queue.SimpleQueue[tuple[_Exchange, list[tuple[int, tuple[object, ...]]] | str]] = \
            queue.SimpleQueue()
        self.resolver: ThreadPoolExecutor | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.tls: ssl.SSLContext | None = None

    def run(self) -> Fanned:
        try:
            while self.pending or self.open:
                while self.pending and self.open < self.at_once:
                    index = self.pending.popleft()
                    self._start(_Exchange(index, self.calls[index], time.monotonic()))
                if self.open:  # (a call refused before it began is answered already)
                    self._turn()
        finally:
            for exchange in self.running:
                self._close(exchange)
            self.selector.close()
            self.wake_r.close()
            self.wake_w.close()
            if self.resolver is not None:
                self.resolver.shutdown(wait=False, cancel_futures=True)
        return Fanned(self.peak_held, self.parked_total)

    # -- one turn of the loop: wait for sockets, a lookup or a deadline -------------------------------------
    def _turn(self) -> None:
        while self.running and self.running[0].state == "done":
            self.running.popleft()
        wait = max(0.0, self.running[0].started + self.timeout - time.monotonic()) if self.running else None
        again, self.again = self.again, []
        ready = [key.data for key, _ in self.selector.select(0 if again else wait)]
        for exchange in again + [e for e in ready if e not in again]:
            if exchange is None:
                self._lookups()
            elif exchange.state != "done":
                self._step(exchange)
        now = time.monotonic()
        while self.running and (self.running[0].state == "done" or self.running[0].started + self.timeout <= now):
            late = self.running.popleft()
            if late.state != "done":
                self._fail(late, f"no answer within {self.timeout:g} s", timed_out=True)
        while self.parked and self.held < self.held_budget:
            exchange = self.parked.popleft()
            if exchange.state == "reading" and exchange.sock is not None:
                self.selector.register(exchange.sock, selectors.EVENT_READ, exchange)

    def _start(self, exchange: _Exchange) -> None:
        self.open += 1
        self.running.append(exchange)
        try:
            exchange.out = memoryview(request_bytes(exchange.call))
        except ValueError as exc:
            self._fail(exchange, str(exc))
            return
        try:
            numeric = ipaddress.ip_address(exchange.host)
        except ValueError:
            numeric = None
        if numeric is not None:
            family = socket.AF_INET6 if numeric.version == 6 else socket.AF_INET
            exchange.addresses = [(family, (exchange.host, exchange.port))]
            self._connect(exchange)
            return
        if self.resolver is None:
            self.resolver = ThreadPoolExecutor(_RESOLVERS, thread_name_prefix="resolve")
        self.resolver.submit(self._lookup, exchange)

    def _lookup(self, exchange: _Exchange) -> None:
        """On a resolver thread: the host's addresses, handed back to the loop."""
        try:
            found = socket.getaddrinfo(exchange.host, exchange.port, type=socket.SOCK_STREAM)
            result: list[tuple[int, tuple[object, ...]]] | str = [(f, tuple(a)) for f, _, _, _, a in found]
        except OSError as exc:
            result = exc.strerror or type(exc).__name__
        self.resolved.put((exchange, result))
        with contextlib.suppress(OSError):  # the loop is full of wake-ups already, or gone
            self.wake_w.send(b"\0")

    def _lookups(self) -> None:
        with contextlib.suppress(OSError):
            while self.wake_r.recv(4096):
                pass
        while True:
            try:
                exchange, result = self.resolved.get_nowait()
            except queue.Empty:
                return
            if exchange.state == "done":
                continue  # its deadline passed while it was looked up
            if isinstance(result, str):
                self._fail(exchange, result)
            else:
                exchange.addresses = result
                self._connect(exchange)

    # -- the exchange, step by step -----------------------------------------------------------------------
    def _connect(self, exchange: _Exchange) -> None:
        """To the next of its addresses; a refusal tries the one after."""
        while exchange.addresses:
            family, address = exchange.addresses.pop(0)
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                exchange.sock, exchange.state = sock, "connecting"
                self.selector.register(sock, selectors.EVENT_WRITE, exchange)
                return
            sock.close()
            exchange.last_error = os.strerror(code)
        self._fail(exchange, exchange.last_error or "no address")

    def _step(self, exchange: _Exchange) -> None:
        """What its socket is ready for, done; the answer handed over (outside the socket's errors) once whole."""
        sock = exchange.sock
        assert sock is not None
        try:
            outcome = self._advance(exchange, sock)
        except ssl.SSLWantReadError:
            self.selector.modify(exchange.sock or sock, selectors.EVENT_READ, exchange)
            return
        except (ssl.SSLWantWriteError, BlockingIOError):
            self.selector.modify(exchange.sock or sock, selectors.EVENT_WRITE, exchange)
            return
        except (OSError, ValueError, http.client.HTTPException) as exc:  # a head http.client refuses too
            outcome = _reason(exc)
        if outcome == _WHOLE:
            self._finish(exchange)
        elif outcome:
            self._fail(exchange, outcome)

    def _advance(self, exchange: _Exchange, sock: socket.socket) -> str | None:
        """One step of the exchange: None (more to come), _WHOLE, or why it failed."""
        if exchange.state == "connecting":
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self.selector.unregister(sock)
                sock.close()
                exchange.sock, exchange.last_error = None, os.strerror(code)
                self._connect(exchange)
                return None
            if exchange.call.url.scheme == "https":
                if self.tls is None:
                    self.tls = ssl.create_default_context(cafile=self.ca_file)
                self.selector.unregister(sock)
                exchange.sock = sock = self.tls.wrap_socket(sock, server_hostname=exchange.host,
                                                            do_handshake_on_connect=False)
                self.selector.register(sock, selectors.EVENT_WRITE, exchange)
                exchange.state = "handshake"
            else:
                exchange.state = "sending"
        if exchange.state == "handshake":
            assert isinstance(sock, ssl.SSLSocket)
            sock.do_handshake()
            exchange.state = "sending"
        if exchange.state == "sending":
            while exchange.out:
                exchange.out = exchange.out[sock.send(exchange.out):]
            exchange.state = "reading"
            self.selector.modify(sock, selectors.EVENT_READ, exchange)
            return None
        if exchange.state != "reading":
            return None
        if not exchange.raw and self.held >= self.held_budget:
            self.selector.unregister(sock)  # its answer waits in its socket until bytes held are handed over
            self.parked.append(exchange)
            self.parked_total += 1
            return None
        reads = 0
        while True:
            try:
                chunk = sock.recv(_READ)
            except (BlockingIOError, ssl.SSLWantReadError):
                return None
            if not chunk:
                return _WHOLE
            exchange.raw += chunk
            if len(exchange.raw) > self.raw_cap:
                return f"the answer is over {self.max_bytes} bytes"
            if exchange.head_end < 0:
                outcome = self._head(exchange)
                if outcome:
                    return outcome
            self._reserve(exchange)
            if exchange.expected is not None and len(exchange.raw) >= exchange.expected:
                return _WHOLE
            if exchange.chunked:  # the last chunk, though the server keeps the connection open all the same
                exchange.chunk_at, last = chunks_whole(exchange.raw, exchange.chunk_at)
                if last:
                    return _WHOLE
            reads += 1
            if reads == _READS_A_TURN:  # the other sockets, and the deadlines, get their turn
                if isinstance(sock, ssl.SSLSocket) and sock.pending():
                    self.again.append(exchange)  # bytes TLS holds already: the selector would not say so
                return None

    def _head(self, exchange: _Exchange) -> str | None:
        """Find the final answer's head (after interim 1xx ones) and how its body ends; why not, if it fails."""
        raw = exchange.raw
        for _ in range(MAX_INTERIM + 1):
            end = raw.find(b"\r\n\r\n", exchange.head_start)
            if end < 0:
                return "the answer's head is over 64 KiB" if len(raw) - exchange.head_start > _HEAD_BYTES else None
            if not interim(raw, exchange.head_start):
                exchange.head_end = end + 4
                exchange.expected, exchange.chunked = framing(raw, exchange.head_start, exchange.head_end)
                exchange.chunk_at = exchange.head_end
                if exchange.expected is not None and exchange.expected - exchange.head_end > self.max_bytes:
                    return f"the answer is over {self.max_bytes} bytes"
                return None
            exchange.head_start = end + 4
        return f"over {MAX_INTERIM} interim answers"

    def _reserve(self, exchange: _Exchange) -> None:
        reserved = max(len(exchange.raw), exchange.expected or 0)
        self.held += reserved - exchange.reserved
        exchange.reserved = reserved
        self.peak_held = max(self.peak_held, self.held)

    def _finish(self, exchange: _Exchange) -> None:
        """The whole answer is here: parsed, and handed to the caller."""
        raw = bytes(exchange.raw[exchange.head_start:])  # the final answer, its interim ones left out
        self._close(exchange)
        try:
            status, body = parsed(raw, exchange.call.method, self.max_bytes)
        except (http.client.HTTPException, ValueError, OSError) as exc:
            self._done(exchange, HttpError(exchange.host, _reason(exc)))
            return
        if len(body) > self.max_bytes:
            self._done(exchange, HttpError(exchange.host, f"the answer is over {self.max_bytes} bytes"))
            return
        self._done(exchange, Response(status, body, time.monotonic() - exchange.started))

    def _fail(self, exchange: _Exchange, reason: str, timed_out: bool = False) -> None:
        self._close(exchange)
        self._done(exchange, HttpError(exchange.host, reason, timed_out))

    def _done(self, exchange: _Exchange, result: Response | HttpError) -> None:
        if exchange.state == "done":
            return  # answered already (the caller's own error, raised while it was handed over)
        exchange.state = "done"
        self.open -= 1
        self.answered(exchange.index, result)

    def _close(self, exchange: _Exchange) -> None:
        self.held -= exchange.reserved
        exchange.raw, exchange.reserved = bytearray(), 0
        if exchange.sock is not None:
            with contextlib.suppress(KeyError, ValueError):  # parked, or never registered
                self.selector.unregister(exchange.sock)
            exchange.sock.close()
            exchange.sock = None


def _reason(exc: OSError | ValueError | http.client.HTTPException) -> str:
    """Why an exchange failed, in words a server did not choose: the system's, ours, http.client's own where its
    message holds none of the answer's bytes, else the error's name."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, AnswerError) or type(exc) in (http.client.HTTPException, http.client.LineTooLong):
        return str(exc)
    return type(exc).__name__


def exchange_all(calls: Sequence[Call], answered: Callable[[int, Response | HttpError], None], timeout: float,
                 max_bytes: int, ca_file: str | None, at_once: int, held_bytes: int) -> Fanned:
    """http_client.request_each's work."""
    return _Fanout(calls, answered, timeout, max_bytes, ca_file, max(1, at_once), held_bytes).run()
