"""Where a connection is accepted and waits for its request head before any worker is given to it (http_server.py's
rules): all of them in the server's one thread, on a selector beside the listening socket. At most MAX_PENDING wait
(the oldest is dropped for a newer one), each for HEAD_SECONDS at most; the TLS handshake runs here too,
non-blocking; a head over MAX_HEAD_BYTES gets a 431. A head that is in is handed to the server's `dispatch`.
Accepting here, not in a thread of its own that hands each connection over, is one wakeup a request fewer.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import time
from collections import OrderedDict
from typing import Any

MAX_PENDING = 512
HEAD_SECONDS = 10.0
MAX_HEAD_BYTES = 16 * 1024
ACCEPTS_AT_ONCE = 64
_TOO_LARGE = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Waiting:
    __slots__ = ("sock", "address", "since", "head", "handshaken")

    def __init__(self, sock: socket.socket, address: Any, handshaken: bool):
        self.sock, self.address, self.since, self.head, self.handshaken = sock, address, time.monotonic(), b"", \
            handshaken


class Gate:
    """Connections are accepted and wait here, all in the thread that runs `run`, until their request head is in
    (module docstring)."""

    def __init__(self, server: Any):
        self.server = server
        self.selector = selectors.DefaultSelector()
        self.waiting: OrderedDict[int, _Waiting] = OrderedDict()
        self.wake_read, self.wake_write = socket.socketpair()
        self.wake_read.setblocking(False)
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        self.stopped = False
        self.dropped = 0

    def stop(self) -> None:
        """Make `run` return (its thread drops the connections still waiting)."""
        self.stopped = True
        with contextlib.suppress(OSError):
            self.wake_write.send(b"x")

    def close(self) -> None:
        for waiting in list(self.waiting.values()):
            self._drop(waiting)
        self.selector.close()
        self.wake_read.close()
        self.wake_write.close()

    def run(self) -> None:
        """Accept and read heads until stop()."""
        listening = self.server.socket
        listening.setblocking(False)
        self.selector.register(listening, selectors.EVENT_READ)
        try:
            while not self.stopped:
                # Asleep until a connection arrives, speaks, or the oldest waiting one expires.
                oldest = next(iter(self.waiting.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.since + HEAD_SECONDS - time.monotonic())
                for key, _ in self.selector.select(timeout=timeout):
                    if key.fileobj is self.wake_read:
                        with contextlib.suppress(OSError):
                            self.wake_read.recv(4096)
                    elif key.fileobj is listening:
                        self._accept()
                    elif (waiting := self.waiting.get(key.fd)) is not None:
                        self._readable(waiting)
                self._expire()
        finally:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(listening)
            for waiting in list(self.waiting.values()):
                self._drop(waiting)

    def _accept(self) -> None:
        """The connections that have arrived, at most ACCEPTS_AT_ONCE before the waiting ones are read again."""
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                sock, address = self.server.get_request()
            except OSError:  # none left to accept, out of descriptors (get_request backed off), or closed
                return
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        try:
            sock.setblocking(False)
            if self.server.tls is not None:
                sock = self.server.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            waiting = _Waiting(sock, address, self.server.tls is None)
            self.selector.register(sock, selectors.EVENT_READ)
        except (OSError, ValueError):
            self.server.shutdown_request(sock)
            return
        self.waiting[sock.fileno()] = waiting
        while len(self.waiting) > MAX_PENDING:
            self.dropped += 1
            self._drop(next(iter(self.waiting.values())))
        self._readable(waiting)  # TLS may hold bytes already; a plain socket just reads EAGAIN

    def _readable(self, waiting: _Waiting) -> None:
        sock = waiting.sock
        try:
            if not waiting.handshaken:
                assert isinstance(sock, ssl.SSLSocket)
                sock.do_handshake()
                waiting.handshaken = True
            while True:
                chunk = sock.recv(8192)
                if not chunk:
                    self._drop(waiting)
                    return
                waiting.head += chunk
                end = _head_end(waiting.head)
                if end > MAX_HEAD_BYTES or (end < 0 and len(waiting.head) > MAX_HEAD_BYTES):
                    with contextlib.suppress(OSError, ssl.SSLError):  # a word if the socket takes it now
                        sock.send(_TOO_LARGE)
                    self._drop(waiting)
                    return
                if end >= 0:
                    self._forget(waiting)
                    self.server.dispatch(sock, waiting.address, waiting.head)
                    return
        except (ssl.SSLWantReadError, BlockingIOError):
            return
        except ssl.SSLWantWriteError:
            return
        except (OSError, ssl.SSLError, AssertionError) as exc:
            self.server.client_failed(exc)
            self._drop(waiting)

    def _expire(self) -> None:
        limit = time.monotonic() - HEAD_SECONDS
        for waiting in list(self.waiting.values()):
            if waiting.since > limit:
                break  # in arrival order: the rest are younger
            self._drop(waiting)

    def _forget(self, waiting: _Waiting) -> None:
        self.waiting.pop(waiting.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(waiting.sock)

    def _drop(self, waiting: _Waiting) -> None:
        self._forget(waiting)
        self.server.shutdown_request(waiting.sock)


def _head_end(data: bytes) -> int:
    """Where a request head ends (after its blank line), -1 while it has not."""
    ends = [at + len(mark) for mark in (b"\r\n\r\n", b"\n\n") if (at := data.find(mark)) >= 0]
    return min(ends, default=-1)
