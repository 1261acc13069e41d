"""A test's own HTTP server on loopback: a handler class served from a thread, closed at the end; and a server
process started and waited for until it answers."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Quiet(BaseHTTPRequestHandler):
    """A handler that logs nothing (pytest keeps the output for failures) and answers JSON."""

    def log_message(self, format: str, *args: object) -> None:
        return None

    def answer_json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


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


class Served:
    """A test server's state and its handler class (set `handler` in __init__): `running()` serves it on
    loopback and sets `url` while the block runs."""

    handler: type[BaseHTTPRequestHandler]
    url = ""

    @contextmanager
    def running(self) -> Iterator[Served]:
        with serving(self.handler) as self.url:
            yield self


def still_open(sock: socket.socket) -> bool:
    """Whether the server still holds this client's connection as the client left it: nothing sent back and not
    closed (a read would block). An answer or a close means the server let go of it."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def free_port() -> int:
    """A TCP port free on loopback now, for a server a test starts (the test's own or a real one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 10.0) -> Any:
    """GET a URL on loopback and parse its JSON answer."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def started(name: str, argv: list[str], folder: Path, ready: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (with `env`, else this one's environment; in `cwd`, else this one's), its output in
    FOLDER/NAME.log, once `ready` answers; stopped cleanly on the way out."""
    log = (folder / f"{name}.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(ready, timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start: see {folder / name}.log") from None
                time.sleep(0.5)
        yield process
    finally:
        process.terminate()  # SIGTERM: each stops cleanly
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
