"""What hostile input costs the daemon, in figures (issue: a rank must not steer a root daemon):

- a Flight Recorder pickle that shares one list through its memo: its size, what is kept, the time;
- py-spy printing without end: the time until it is cut off, and the daemon's peak memory;
- an Alertmanager webhook of 2 MB naming 3,000 jobs: the parse time, and the coordinator's answer;
- 300 half-open clients and 64 slow POST bodies against the endpoint: the latency of a scrape.

    python bench/hostile_costs.py
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import resource
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from watchdog.coordinate.nodes import NodeClient
from watchdog.coordinate.service import Coordinator
from watchdog.stacks import fr_dumps
from watchdog.stacks.capture import StackCapturer, Target
from watchdog.webhook import training_jobs


def memo_bomb(levels: int) -> bytes:
    inner: object = [0] * 10
    for _ in range(levels):
        inner = [inner] * 10
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "profiling_name": "nccl:all_reduce", "state": "scheduled", "input_sizes": inner}
    return pickletools.optimize(pickle.dumps({"version": "2.7", "entries": [entry] * 3, "pg_config": {}}, 2))


def flight_recorder() -> None:
    for levels in (6, 7, 9):
        data = memo_bomb(levels)
        started = time.perf_counter()
        kept = json.dumps(fr_dumps.parse(data, rank=0, source="bomb").to_json())
        print(f"memo-bomb pickle, {levels} levels: {len(data)} bytes in, {len(kept):,} bytes kept as JSON, "
              f"{(time.perf_counter() - started) * 1000:.1f} ms")


def py_spy() -> None:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "py-spy"
        script.write_text("import sys\nchunk = b'x' * 65536\nwhile True:\n    sys.stdout.buffer.write(chunk)\n")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        capture = StackCapturer([sys.executable, str(script)], timeout_seconds=30).capture_one(Target(os.getpid()))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"py-spy printing without end: {capture.result} after {time.perf_counter() - started:.2f} s "
              f"({capture.message}); peak RSS {before / 1024:.0f} -> {after / 1024:.0f} MiB")


def webhook() -> None:
    body = json.dumps({"version": "4", "alerts": [{"labels": {"training_job": f"job-{n:05d}-" + "x" * 490}}
                                                  for n in range(3000)]}).encode()
    started = time.perf_counter()
    jobs = training_jobs(body)
    parsed = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        coordinator = Coordinator("http://127.0.0.1:9", folder, NodeClient(timeout_seconds=1))
        started = time.perf_counter()
        status, _ = coordinator.accept(body)
        answered = time.perf_counter() - started
    print(f"webhook of {len(body) / 2**20:.1f} MiB naming {len(jobs)} jobs: parsed in {parsed * 1000:.0f} ms; "
          f"the coordinator answers {status} in {answered * 1000:.0f} ms and starts "
          f"{len(coordinator._running)} investigations")


def slow_clients() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.export.test_server import serve

    with tempfile.TemporaryDirectory() as folder:
        daemon, endpoint = serve(Path(folder))
        daemon.tick()
        port = endpoint.server.server_address[1]
        held = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
            for _ in range(64):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"POST /v1/dump HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
                held.append(s)
            time.sleep(0.5)
            times = []
            for _ in range(20):
                started = time.perf_counter()
                with urllib.request.urlopen(endpoint.url, timeout=10) as response:
                    response.read()
                times.append(time.perf_counter() - started)
            times.sort()
            print(f"scrape with 300 half-open clients and 64 slow POST bodies held: median "
                  f"{times[10] * 1000:.1f} ms, worst {times[-1] * 1000:.1f} ms of 20")
        finally:
            for s in held:
                s.close()
            endpoint.stop()


if __name__ == "__main__":
    flight_recorder()
    py_spy()
    webhook()
    slow_clients()
