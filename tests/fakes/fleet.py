"""Simulated nodes for fleet-scale tests: each node's /metrics is what the real collector renders for a node of
8 GPUs whose ranks belong to one proven training job, healthy or spinning in a collective (a critical
busy_spin with its alert), served from one loopback server at /metrics?node=NAME. A scraper relabels each
node's address (NAME:9944) to that server and keeps the name as `instance` (fleet_relabels)."""

from __future__ import annotations

import hashlib
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.fakes.loopback import Quiet, serving
from watchdog.export.metrics import AlertRow, EpisodeView, Published, WatchdogCollector, new_counters
from watchdog.sample import sim
from watchdog.sample.rank_labels import RankRow
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import Severity, Signature, Workload

GPUS = 8
PORT = 9944


def node_body(name: str, job: str, slurm_job: str, uid: str, spinning: bool,
              first_rank: int = 0) -> Callable[[], bytes]:
    """The exposition of one node, rendered afresh at each call (its last sample is now)."""
    snapshots = sim.run(sim.Scenario("fleet", "", "h100", GPUS, 600, ((0, None, "train"),), gpm=True))
    snapshot = [next(snapshots) for _ in range(20)][-1]
    workload = Workload(slurm_job_id=slurm_job)
    ranks = tuple(RankRow(g, 1000 + g, first_rank + g, job, workload, "slurm", uid) for g in range(GPUS))
    episodes: tuple[EpisodeView, ...] = ()
    alerts: tuple[AlertRow, ...] = ()
    if spinning:
        episodes = (EpisodeView(Signature.BUSY_SPIN, Severity.CRITICAL, tuple(range(GPUS)), (), time.time() - 60),)
        alerts = (AlertRow(AlertIdentity(Signature.BUSY_SPIN, name, job, workload), Severity.CRITICAL, ""),)
    now = [Published()]  # replaced at each call: the node's state, its last sample now
    collector = WatchdogCollector(lambda: now[0], new_counters())

    def render() -> bytes:
        now[0] = Published(snapshot, episodes, ranks, alerts, {"sample": True}, time.time())
        return collector.exposition()

    return render


@contextmanager
def serving_nodes(bodies: dict[str, Callable[[], bytes]]) -> Iterator[str]:
    """One loopback server for every node (GET /metrics?node=NAME); yields its host:port."""

    class Handler(Quiet):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urllib.parse.urlsplit(self.path)
            body = bodies.get(urllib.parse.parse_qs(url.query).get("node", [""])[0])
            if url.path != "/metrics" or body is None:
                self.send_error(404)
                return
            data = body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # a scrape that timed out, or its scraper stopping
                return

    with serving(Handler) as url:
        yield url.removeprefix("http://")


def fleet_relabels(server: str) -> list[dict[str, Any]]:
    """After a scraper's own relabels: the node's name as `instance`, its address the fleet server's."""
    return [
        {"source_labels": ["__address__"], "target_label": "instance"},
        {"source_labels": ["__address__"], "regex": f"(.+):{PORT}", "target_label": "__param_node"},
        {"target_label": "__address__", "replacement": server},
    ]


def hashmod(address: str, modulus: int) -> int:
    """Prometheus's hashmod relabeling of one value: the low 8 bytes of its MD5, big-endian, modulo."""
    return int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % modulus
