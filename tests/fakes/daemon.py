"""Builders for daemon tests: a config on loopback with bundles in a temporary folder, a source that
fails on demand, and a local HTTP receiver that can answer 500 or hang."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from watchdog.config import Config, parse_config
from watchdog.daemon import Daemon
from watchdog.export.metrics import WatchdogCollector
from watchdog.vocabulary.model import NodeSnapshot


def daemon_config(tmp: Path, **sections: Any) -> Config:
    base: dict[str, Any] = {
        # Ticks of 0.2 s that the scenarios play as 1 s each (the stepping clocks): 25 of them a batch, as the
        # tests were written for.
        "sample": {"interval_seconds": 0.2, "batch_seconds": 5.0},
        "source": {"kind": "sim", "scenario": "spin_hang", "start_offset_seconds": 285},
        "export": {"listen_address": "127.0.0.1:0"},
        "bundles": {"directory": str(tmp / "incidents"), "capture_stacks": False},
        "alerts": {"backoff_seconds": 0.1, "max_attempts": 2},
        "dump": {"open_on_loopback": True},  # the tests' own loopback endpoints
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return parse_config(base)


def scrape(daemon: Daemon, series: str = "standard") -> str:
    """What GET /metrics would serve for the daemon's last tick (the collector the service builds), with
    `export.series` as given (full: every reading)."""
    return WatchdogCollector(lambda: daemon.published, daemon.counters, series).exposition().decode()


def stepping_clock(start: float = 1.9e9, step: float = 1.0) -> Callable[[], float]:
    """A wall clock that moves one sample interval per reading: ticks run faster than real time while
    the detectors see seconds pass."""
    now = [start - step]

    def clock() -> float:
        now[0] += step
        return now[0]

    return clock


class FlakySource:
    """Wraps a source; raises while `failing` is set (a bug or a driver error in the sampling step)."""

    driver_version = "flaky"

    def __init__(self, inner: Any):
        self.inner = inner
        self.failing = False

    @property
    def gpu_count(self) -> int:
        return int(self.inner.gpu_count)

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def sample(self) -> NodeSnapshot:
        if self.failing:
            raise RuntimeError("sampling exploded")
        return self.inner.sample()  # type: ignore[no-any-return]


class Receiver:
    """A real HTTP server on loopback that records requests. `mode`: ok; fail (500); hang (5 s, then ok); hold (no
    answer until the receiver closes); redirect (302 to `location`); trickle (a byte a second for a minute, never a
    whole answer). `holding` counts the requests held or trickling now."""

    def __init__(self, mode: str = "ok", location: str = ""):
        self.mode = mode
        self.requests: list[tuple[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.holding = 0
        self.released = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append((self.path, json.loads(body)))
                outer.headers.append(dict(self.headers))
                if outer.mode == "trickle":
                    self._trickle()
                    return
                if outer.mode == "hang":
                    time.sleep(5)
                if outer.mode == "hold":
                    outer.holding += 1
                    outer.released.wait()
                    outer.holding -= 1
                self.send_response({"fail": 500, "redirect": 302}.get(outer.mode, 200))
                if outer.mode == "redirect":
                    self.send_header("Location", location)
                self.end_headers()

            def _trickle(self) -> None:
                outer.holding += 1  # while it trickles
                try:
                    for _ in range(60):
                        try:
                            self.wfile.write(b"H")
                            self.wfile.flush()
                        except OSError:
                            return
                        time.sleep(1)
                finally:
                    outer.holding -= 1

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
