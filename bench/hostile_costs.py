"""What hostile input costs the daemon, in figures (issue: a rank must not steer a root daemon):

- a Flight Recorder pickle that shares one list through its memo: its size, what is kept, the time;
- py-spy printing without end: the time until it is cut off, and the daemon's peak memory;
- an Alertmanager webhook of 2 MB naming 3,000 jobs: the parse time, and the coordinator's answer;
- 300 half-open clients and 64 slow POST bodies against the endpoint: the latency of a scrape;
- the stack sampler (issue 54): a rank of 300 threads 500 frames deep beside a plain one, and 32 small ranks
  of one job beside one rank of another: each round's length and the daemon's CPU (py-spy's included), and
  how many rounds each job's ranks were sampled in;
- the readers (issue 40): each hostile input read in a fresh Python, its peak memory past its imports and its
  time, by this checkout and, with `--before`, by an older one beside it (`git worktree add /tmp/old HEAD~N`);
  among them the traces `replay` reads (tests/hostile/test_traces.py), replayed in one process within 4 GiB.

    python bench/hostile_costs.py [--readers | --sampler] [--before /tmp/old] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import pickletools
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.hostile import test_readers as hostile  # noqa: E402  the hostile inputs, and how a reading is measured
from tests.hostile import test_traces as traces  # noqa: E402  the hostile traces
from watchdog.boundary.webhook import job_requests
from watchdog.config import StacksConfig
from watchdog.coordinate.nodes import NodeClient
from watchdog.coordinate.service import Coordinator
from watchdog.stacks import fr_dumps
from watchdog.stacks.capture import StackCapturer, Target
from watchdog.stacks.sampling import RankSampler, SampleTarget


def memo_bomb(levels: int) -> bytes:
    inner: object = [0] * 10
    for _ in range(levels):
        inner = [inner] * 10
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "profiling_name": "nccl:all_reduce", "state": "scheduled", "input_sizes": inner}
    return pickletools.optimize(pickle.dumps({"version": "2.7", "entries": [entry] * 3, "pg_config": {}}, 2))


def shared_string() -> bytes:
    """4,096 entries whose every kept field is a list of 64 references to one 300-character string: cheap to
    unpickle (references), dear to copy (each copy cut to 256 characters is a new string)."""
    text = "x" * 300
    entry = {name: [text] * 64 for name in fr_dumps._KEPT}
    return pickle.dumps({"version": "2.7", "entries": [entry] * 4096, "pg_config": {}}, 2)


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


_DEEP = """import sys, threading, time
sys.setrecursionlimit(10000)
def down(n):
    return down(n - 1) if n else time.sleep(3600)
for _ in range({threads}):
    threading.Thread(target=down, args=({depth},), daemon=True).start()
open(sys.argv[1], "w").write("ready")
down({depth})
"""


def _ranks(folder: Path, shapes: list[tuple[str, int, int]]) -> list[tuple[subprocess.Popen[bytes], str]]:
    """(process, job) for each (job, threads, depth) of `shapes`, started and ready."""
    started = []
    for n, (job, threads, depth) in enumerate(shapes):
        ready = folder / f"ready-{n}"
        code = _DEEP.format(threads=threads, depth=depth)
        started.append((subprocess.Popen([sys.executable, "-c", code, str(ready)]), job))
    deadline = time.monotonic() + 120
    while not all((folder / f"ready-{n}").exists() for n in range(len(shapes))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return started


def sampler() -> None:
    cfg = StacksConfig()
    cases = {"a rank 300 threads x 500 frames deep, beside a plain rank": ([("deep", 300, 500), ("plain", 1, 5)], 10),
             "32 small ranks of one job, beside one rank of another": ([("many", 1, 5)] * 32 + [("one", 1, 5)], 4)}
    for name, (shapes, rounds) in cases.items():
        with tempfile.TemporaryDirectory() as folder:
            ranks = _ranks(Path(folder), shapes)
            try:
                targets = [SampleTarget(p.pid, float(n), (0,), n, job) for n, (p, job) in enumerate(ranks)]
                rankers = RankSampler(StackCapturer.from_config(cfg), cfg, lambda chosen=targets: chosen)
                lengths, cpu = [], []
                for _ in range(rounds):
                    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
                    started = time.monotonic()
                    rankers.sample_once()
                    lengths.append(time.monotonic() - started)
                    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
                    cpu.append(sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)))
                sampled: dict[str, int] = {}
                for (pid, _), counts in rankers.counts.items():
                    job = next(job for p, job in ranks if p.pid == pid)
                    sampled[job] = sampled.get(job, 0) + counts.samples
                print(f"sampler, {name}: rounds {', '.join(f'{x:.1f}' for x in lengths)} s "
                      f"(stacks.sample_seconds {cfg.sample_seconds:g}); CPU {sum(cpu) / sum(lengths):.0%} of a core; "
                      f"main-thread samples kept by job: {sampled}", flush=True)
            finally:
                for process, _ in ranks:
                    process.kill()
                    process.wait()


def webhook() -> None:
    body = json.dumps({"version": "4", "alerts": [{"labels": {"training_job": f"job-{n:05d}-" + "x" * 490}}
                                                  for n in range(3000)]}).encode()
    started = time.perf_counter()
    jobs = job_requests(body)
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


READER_CASES = {  # name -> (what a fresh Python does with args["path"], what to make there)
    "Flight Recorder pickle, 16 MiB of `]`": ("fr", lambda: hostile.opcode_pickle(b"]")),
    "Flight Recorder pickle, 16 MiB of `(`": ("fr", lambda: hostile.opcode_pickle(b"(")),
    "Flight Recorder pickle, 16 MiB of `}`": ("fr", lambda: hostile.opcode_pickle(b"}")),
    "Flight Recorder pickle, 16 MiB of `N`": ("fr", lambda: hostile.opcode_pickle(b"N")),
    "Flight Recorder pickle, 16 MiB of PROTO (builds nothing)": ("fr", lambda: hostile.HOSTILE_DUMPS["pickle PROTO"]()),
    "Flight Recorder JSON, 16 MiB of `[],`": ("fr", lambda: hostile.empty_lists_json()),
    "py-spy's JSON, 15 MiB of `[],`": ("py-spy", lambda: hostile.empty_lists_json(15 * 2**20, head=b"[")),
    "RAS reply, 16 MiB of `[],`": ("ras", lambda: hostile.empty_lists_json(16 * 2**20 - 64,
                                                                           head=b'{"communicators": [')),
    "py-spy text, a frame line of `f` and 20,000 ` (`": ("analyze",
                                                          lambda: hostile.PATHOLOGICAL["py-spy frame"].encode()),
    "timeout log naming ranks 0 and 9999999": ("analyze", lambda: (hostile.TIMEOUT_LINE.format(rank=0) +
                                                                   hostile.TIMEOUT_LINE.format(rank=9_999_999)).encode()),
    "60 MB of random bytes": ("analyze", lambda: random.Random(40).randbytes(60_000_000)),
    "8 MiB of random printable text": ("analyze", lambda: bytes(random.Random(40).choices(
        b"ab cdefghij(0123456789):\n\"'_.-/[]{}", k=8 * 2**20))),
    "Flight Recorder pickle, one 300-character string in every field through the memo": ("fr", lambda: shared_string()),
    "a folder of 12 logs of 60 MB": ("analyze", "logs"),
    "replay of a recording whose 200 lines each name 1,024 new GPUs (3.3 MB)": ("replay", traces.new_gpus_recording),
    "replay --lenient of a recording whose 200 lines each name 1,024 new GPUs": ("replay --lenient",
                                                                               traces.new_gpus_recording),
    "replay of an nvidia-smi log whose index never repeats (40,000 rows)": ("replay", traces.never_repeating_index_csv),
    "replay --lenient of an nvidia-smi log whose index never repeats": ("replay --lenient",
                                                                      traces.never_repeating_index_csv),
    "replay --lenient of a clock-event mask of 400 hex digits": ("replay --lenient",
                                                                 lambda: traces.mask_csv("0x" + "f" * 400)),
    "replay of a clock-event mask of -0x8": ("replay", lambda: traces.mask_csv("-0x8")),
    "replay of a utilization of 1e13 % (nounits)": ("replay", lambda: traces.utilization_csv("1e13")),
    "replay --lenient of two healthy logs joined by cat, columns in other orders": ("replay --lenient",
                                                                                    traces.two_logs_cat),
    "replay --lenient of 20 records of 1 MiB: 1,024 GPUs, every column": ("replay --lenient", traces.large_records),
    "replay --lenient of 20 records of 1 MiB: 64 GPUs, 4,000 Xids each": ("replay --lenient",
                                                                          lambda: traces.large_records(gpus=64)),
    "replay --lenient of 20 records of 1 MiB within every bound: 64 GPUs, 256 processes and Xids each": (
        "replay --lenient", lambda: traces.large_records(gpus=64, xids=256, pids=256)),
}
# A replay in one process (no reader process beside it, whose memory would not be counted), given 4 GiB of address
# space as a sidecar would be; its own imports (numpy, the detectors) are not what the input costs: the peak and
# the clocks start after them.
_REPLAY = """
import contextlib, io, resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import watchdog.cli.replay, watchdog.detect.engine
with open("/proc/self/clear_refs", "w") as peak:
    peak.write("5")
base, started, cpu = kib("VmRSS:"), time.perf_counter(), time.process_time()
from watchdog.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(["replay", "--jobs", "1", "--json", *FLAGS, args["path"]])
    except BaseException as exc:  # what the user saw as a traceback
        code = f"{type(exc).__name__} ({str(exc)[:100]})"
pages = sum('"severity": "critical"' in line and '"event": "fired"' in line for line in out.getvalue().splitlines())
outcome = f"exit {code}, {pages} critical pages; " + " ".join(err.getvalue().split())[:240]
"""
READERS = {
    "fr": """
from watchdog.stacks import fr_dumps
try:
    outcome = f"read, {len(fr_dumps.parse(open(args['path'], 'rb').read(), 3, args['path']).entries)} entries"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
""",
    "py-spy": """
import os, sys
from watchdog.config import StacksConfig
from watchdog.stacks.capture import StackCapturer, Target
from watchdog.stacks.sampling import RankSampler, SampleTarget
capture = StackCapturer([sys.executable, args["script"], args["path"]], 60).capture_one(Target(os.getpid()))
outcome = f"{capture.result}: {capture.message}"
""",
    "ras": """
from watchdog.stacks import ras_report
try:
    outcome = ras_report.parse(open(args["path"]).read()).format
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
""",
    "analyze": """
import contextlib, io
from watchdog.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(["analyze", "--json", args["path"]])
verdicts = [json.loads(line)["verdict"]["kind"] for line in out.getvalue().splitlines() if line.startswith("{")]
outcome = f"exit {code}, {len(out.getvalue()):,} bytes out, verdicts {verdicts}; " + err.getvalue()[-160:].strip()
""",
    "replay": _REPLAY.replace("*FLAGS, ", ""),
    "replay --lenient": _REPLAY.replace("*FLAGS", '"--lenient"'),
}


def readers(before: Path | None, only: str = "") -> None:
    """Each hostile input read by this checkout and, with `before`, by the older one: peak RSS past the imports
    of a fresh Python (MiB), its time, and what it made of the input."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "py-spy"
        script.write_text(hostile.HOSTILE_PY_SPY)
        for name, (reader, make) in READER_CASES.items():
            if only not in name:
                continue
            path = Path(folder) / "input"
            if make == "logs":
                path.mkdir()
                line = b"2026-11-26 22:00:00 INFO iteration 10 / 1000 | loss 2.31 | lr 1e-4 | grad norm 0.5\n"
                for n in range(12):
                    (path / f"rank{n:02d}.log").write_bytes(line * (60_000_000 // len(line)) +
                                                             hostile.TIMEOUT_LINE.format(rank=n).encode())
            else:
                path.write_bytes(make())  # type: ignore[operator]
            args = {"path": str(path), "script": str(script)}
            for label, root in (("before", before), ("after", hostile.REPO)):
                if root is None:
                    continue
                try:
                    found = hostile.measure(READERS[reader], args, root, timeout=600)
                    print(f"{name} [{label}]: peak +{float(found['grew_mib']):.0f} MiB, "  # type: ignore[arg-type]
                          f"{float(found['seconds']):.2f} s; {str(found['outcome'])[:300]}", flush=True)  # type: ignore[arg-type]
                except (AssertionError, subprocess.TimeoutExpired) as exc:
                    print(f"{name} [{label}]: did not finish ({str(exc)[:200]})", flush=True)
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readers", action="store_true", help="only the readers' figures")
    parser.add_argument("--sampler", action="store_true", help="only the stack sampler's figures")
    parser.add_argument("--before", type=Path, help="an older checkout to measure the readers against")
    parser.add_argument("--only", default="", help="only the readers' cases whose name holds this text")
    options = parser.parse_args()
    if options.sampler:
        sampler()
        raise SystemExit(0)
    if not options.readers:
        flight_recorder()
        py_spy()
        webhook()
        slow_clients()
        sampler()
    readers(options.before, options.only)
