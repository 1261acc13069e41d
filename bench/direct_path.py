"""From a node's verdict to the dumps of its whole job, without Prometheus: how long until every node of a
64-node job has been asked for its dump (POST /v1/dump begun), Prometheus down throughout.

The paging node is the daemon's own alert lane (watchdog/act/alerts.py: the `coordinator` receiver, its
queue and worker, its HTTP client): an Alert is submitted at the moment of the node's critical verdict. The
coordinator is `stall-watchdog coordinate`, run as its own process with --slurm-instance and a --prometheus
that refuses every connection. Its Slurm is a stand-in: two small programs named squeue and scontrol, first
on its PATH, that answer as Slurm does for a running job of `--nodes` nodes (`42|RUNNING|node[1-64]` and the
expanded names; the node names are the addresses 127.0.0.1 to 127.0.0.64). The real Slurm path (Debian's
slurm-wlm, one node) is proven by tests/coordinate/test_direct_path.py; a 64-node Slurm needs slurmd built
for several nodes a host, which Debian's is not. Each node is a fake daemon on its own loopback address that
notes when its POST /v1/dump began and answers after `--dump-seconds`, as a dump does.

    python bench/direct_path.py [--nodes 64] [--trials 30] [--dump-seconds 3]

Goal: the last node of the job asked within 15 s of the node's verdict, p95 over the trials.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fakes.loopback import Quiet, free_port, started  # noqa: E402
from watchdog.act.alerts import Alert, AlertDispatcher, CoordinatorReceiver  # noqa: E402
from watchdog.config import AlertsConfig, ReceiverConfig  # noqa: E402
from watchdog.export.metrics import new_counters  # noqa: E402
from watchdog.vocabulary.alert_identity import AlertIdentity  # noqa: E402
from watchdog.vocabulary.model import Severity, Signature, Workload  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL_SECONDS = 15.0
TOKEN, CALLERS = "bench-node-token-0123456789", "bench-caller-token-0123456789"


class Nodes:
    """`count` fake daemons, one per loopback address, on one port: when each was first asked per job."""

    def __init__(self, count: int, port: int, dump_seconds: float):
        self.asked: dict[str, dict[str, float]] = {}  # job -> address -> monotonic time its dump began
        self.lock = threading.Lock()
        self.servers: list[ThreadingHTTPServer] = []
        nodes = self

        class Handler(Quiet):
            def do_POST(self) -> None:  # noqa: N802
                began = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                job = json.loads(body).get("training_job", "")
                address = self.server.server_address[0]
                with nodes.lock:
                    nodes.asked.setdefault(job, {}).setdefault(address, began)  # type: ignore[arg-type]
                time.sleep(dump_seconds)
                if self.headers.get("Authorization") == f"Bearer {TOKEN}":
                    self.answer_json(200, {"node": f"node{address}", "jobs": []})
                else:
                    self.answer_json(401, {"error": "credentials required"})

        for n in range(1, count + 1):
            server = ThreadingHTTPServer((f"127.0.0.{n}", port), Handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def stand_in_slurm(folder: Path, count: int) -> None:
    """squeue and scontrol that answer as Slurm does for a running job on `count` nodes."""
    squeue = folder / "squeue"
    squeue.write_text("#!/bin/sh\n# squeue --noheader --states=all --jobs ID --format %A|%T|%N\n"
                      "while [ $# -gt 0 ]; do [ \"$1\" = --jobs ] && id=$2; shift; done\n"
                      f"echo \"$id|RUNNING|127.0.0.[1-{count}]\"\n")
    scontrol = folder / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n# scontrol show hostnames LIST\nseq -f '127.0.0.%g' 1 {count}\n")
    for program in (squeue, scontrol):
        program.chmod(0o755)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--dump-seconds", type=float, default=3.0, help="how long each node takes to answer")
    args = parser.parse_args()
    if not 1 <= args.nodes <= 254:
        parser.error("--nodes: 1 to 254 (one loopback address each)")
    port = free_port()
    nodes = Nodes(args.nodes, port, args.dump_seconds)
    with tempfile.TemporaryDirectory() as tmp, contextlib.closing(nodes):
        folder = Path(tmp)
        (folder / "bin").mkdir()
        stand_in_slurm(folder / "bin", args.nodes)
        for name, secret in (("node-token", TOKEN), ("callers", CALLERS)):
            (folder / name).write_text(secret + "\n")
            (folder / name).chmod(0o600)
        listen = free_port()
        argv = [sys.executable, "-m", "watchdog", "coordinate", "--slurm-instance", f"{{node}}:{port}",
                "--prometheus", f"http://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{listen}",
                "--token-file", str(folder / "callers"), "--node-token-file", str(folder / "node-token"),
                "--out", str(folder / "jobs"), "--cooldown-seconds", "0", "--max-per-minute", "10000"]
        env = {**os.environ, "PATH": f"{folder / 'bin'}:{os.environ.get('PATH', '')}",
               "PYTHONPATH": str(REPO)}
        with started("coordinator", argv, folder, f"http://127.0.0.1:{listen}/healthz", env):
            (folder / "url").write_text(f"http://127.0.0.1:{listen}")
            cfg = AlertsConfig(receivers=[ReceiverConfig(type="coordinator", name="coordinator",
                                                         url_file=str(folder / "url"),
                                                         token_file=str(folder / "callers"))])
            dispatcher = AlertDispatcher(cfg, new_counters(), [CoordinatorReceiver(cfg.receivers[0])])
            seconds = []
            for trial in range(args.trials):
                job = f"slurm:{1000 + trial}"
                identity = AlertIdentity(Signature.BUSY_SPIN, "node-1", job, Workload(slurm_job_id=str(1000 + trial)))
                verdict_at = time.monotonic()
                dispatcher.submit(Alert(f"busy_spin:{trial}", "firing", identity, Severity.CRITICAL, (0,), (), "bench",
                                        time.time(), time.time()))
                deadline = verdict_at + 120
                while len(nodes.asked.get(job, {})) < args.nodes:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"trial {trial}: {len(nodes.asked.get(job, {}))} of {args.nodes} nodes "
                                         "asked within 120 s")
                    time.sleep(0.005)
                last = max(nodes.asked[job].values()) - verdict_at
                first = min(nodes.asked[job].values()) - verdict_at
                seconds.append(last)
                print(f"trial {trial + 1:>2}: first node asked after {first:6.3f} s, all {args.nodes} after "
                      f"{last:6.3f} s", flush=True)
                time.sleep(args.dump_seconds + 0.5)  # that investigation's answers in, before the next
            dispatcher.close()
    seconds.sort()
    p95 = seconds[min(len(seconds) - 1, int(round(0.95 * (len(seconds) - 1))))]
    print(f"\nnode verdict -> dumps begun on all {args.nodes} nodes, Prometheus down ({args.trials} trials): "
          f"p50 {seconds[len(seconds) // 2]:.3f} s, p95 {p95:.3f} s, max {seconds[-1]:.3f} s "
          f"(goal p95 <= {GOAL_SECONDS:g} s: {'met' if p95 <= GOAL_SECONDS else 'NOT met'})")
    return 0 if p95 <= GOAL_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
