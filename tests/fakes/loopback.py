"""A test's own HTTP server on loopback: a handler class served from a thread, closed at the end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Quiet(BaseHTTPRequestHandler):
    """A handler that logs nothing (pytest keeps the output for failures)."""

    def log_message(self, format: str, *args: object) -> None:
        return None


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The server's base URL while the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
