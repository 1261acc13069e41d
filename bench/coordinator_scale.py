"""The job coordinator at fleet scale: `stall-watchdog coordinate`, run as its own process, investigates a
hung job of 64, 512 and 1,024 nodes of 8 ranks (up to 8,192 ranks), every node a fake daemon on loopback.

Each fake node answers POST /v1/dump as a node's daemon does (watchdog/act/dump.py), after `--node-seconds`
(3.5 s: a dump with the default stacks settings watches the ranks 1 s and asks NCCL RAS twice, 3 s apart):
8 ranks with py-spy threads sized on the real dumps of ../shared/realdata/hang_stacks (a Megatron-DeepSpeed
main thread, tqdm's monitor, the pin-memory loop, two queue feeders, four threads without Python frames),
the node's own verdict, and each rank's Flight Recorder trace (`--fr-entries` newest entries; the process
groups as NCCL records them: the default group lists every rank of the job, a tensor-parallel group per
node, a data-parallel group per local rank). Exactly one rank of the job is the culprit: stuck in its data
loader while every other rank waits in an all_reduce it never entered. A loopback stand-in for Prometheus
answers the coordinator's query for the instances exporting the job's ranks.

Per size: the time from the alert POST to the job verdict decided (when it shows on GET /v1/jobs, less the
seconds its bundle took to write, which the coordinator says as `bundle_seconds`), and to it on GET /v1/jobs
with its bundle written; the coordinator's peak RSS (psutil, sampled every 20 ms), whether the culprit was
named (rank and node), and the merge (job_verdict.merge: the ranks' stacks and traces read, grouped, matched,
decided; the JSON parse aside) timed in this process on the same answers, per rank, to see whether it grows
linearly with them. A last line sizes a node's answer with the Flight Recorder ring PyTorch keeps at the
doctor's advice (TORCH_NCCL_TRACE_BUFFER_SIZE=2000) against what the coordinator reads of one node.

    python bench/coordinator_scale.py [--nodes 64,512,1024] [--node-seconds S] [--fr-entries N]

Goals at 512 nodes: the verdict within 10 s of the alert, coordinator RSS under 500 MiB, the culprit named;
with `--fr-entries 2000`, at 4,096 nodes within 10 s and at 12,500 within 30 s, both under 1 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fakes.loopback import free_port, get_json, started  # noqa: E402
from watchdog.coordinate.job_verdict import merge
from watchdog.coordinate.nodes import MAX_ANSWER_BYTES, MAX_JOB_BYTES, NodeAnswer, Placement
from watchdog.stacks import fr_dumps, fr_matching
from watchdog.stacks.analysis import analyze
from watchdog.stacks.formats import parse_pyspy_json
from watchdog.stacks.picture import with_job_evidence
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.words import iso_time

REPO = Path(__file__).resolve().parents[1]
JOB = "llm-pretrain-42"
RANKS_PER_NODE = 8
GOAL_NODES, GOAL_SECONDS, GOAL_RSS_MIB = 512, 10.0, 500
NODES_A_PROCESS = 6_000
FLEET_GOALS = {4096: (10.0, 1024), 12500: (30.0, 1024)}  # nodes: (seconds, MiB), with --fr-entries 2000

# -- one node's answer ----------------------------------------------------------------------------------
STDLIB, SITE = "/usr/lib/python3.10/", "/usr/local/lib/python3.10/dist-packages/"
CODE = "/workspace/Megatron-DeepSpeed/"
# Frames as the real dumps give them (innermost first): the BigScience BLOOM-176B hang (chronicles
# 2022-04-30 node 49, all_reduce in _reduce_outputs; 2022-05-18, the rank deadlocked in its DataLoader),
# tqdm's monitor thread (accelerate#3104, DeepSpeed#6524), the pin-memory thread (ami-data-companion#140).
EVAL = [("eval_batch", SITE + "deepspeed/runtime/pipe/engine.py", 452),
        ("evaluate", CODE + "megatron/training.py", 983),
        ("evaluate_and_print_results", CODE + "megatron/training.py", 1030),
        ("train", CODE + "megatron/training.py", 904), ("pretrain", CODE + "megatron/training.py", 188),
        ("main", CODE + "pretrain_gpt.py", 245),
        ("wrapper", SITE + "torch/distributed/elastic/multiprocessing/errors/__init__.py", 345),
        ("<module>", CODE + "pretrain_gpt.py", 249)]
WAITING = [("all_reduce", SITE + "torch/distributed/distributed_c10d.py", 1316),
           ("_reduce_outputs", SITE + "deepspeed/runtime/pipe/engine.py", 519), *EVAL]
CULPRIT = [("wait", STDLIB + "threading.py", 306), ("get", STDLIB + "queue.py", 179),
           ("_try_get_data", SITE + "torch/utils/data/dataloader.py", 1011),
           ("_get_data", SITE + "torch/utils/data/dataloader.py", 1163),
           ("_next_data", SITE + "torch/utils/data/dataloader.py", 1207),
           ("__next__", SITE + "torch/utils/data/dataloader.py", 530),
           ("_next_batch", SITE + "deepspeed/runtime/pipe/engine.py", 631),
           ("_exec_load_micro_batch", SITE + "deepspeed/runtime/pipe/engine.py", 799),
           ("_exec_schedule", SITE + "deepspeed/runtime/pipe/engine.py", 1384), *EVAL]
BOOTSTRAP = [("run", STDLIB + "threading.py", 953), ("_bootstrap_inner", STDLIB + "threading.py", 1016),
             ("_bootstrap", STDLIB + "threading.py", 973)]
TQDM = [("wait", STDLIB + "threading.py", 324), ("wait", STDLIB + "threading.py", 607),
        ("run", SITE + "tqdm/_monitor.py", 60), *BOOTSTRAP[1:]]
PIN_MEMORY = [("select", STDLIB + "selectors.py", 415), ("wait", STDLIB + "multiprocessing/connection.py", 1136),
              ("_poll", STDLIB + "multiprocessing/connection.py", 424),
              ("poll", STDLIB + "multiprocessing/connection.py", 257),
              ("get", STDLIB + "multiprocessing/queues.py", 113),
              ("do_one_step", SITE + "torch/utils/data/_utils/pin_memory.py", 31),
              ("_pin_memory_loop", SITE + "torch/utils/data/_utils/pin_memory.py", 54), *BOOTSTRAP]
FEEDER = [("wait", STDLIB + "threading.py", 320), ("_feed", STDLIB + "multiprocessing/queues.py", 231), *BOOTSTRAP]


def _frames(frames: list[tuple[str, str, int]]) -> list[dict[str, object]]:
    return [{"name": name, "filename": filename, "line": line} for name, filename, line in frames]


def pyspy_threads(pid: int, culprit: bool) -> list[dict[str, object]]:
    """One rank's `py-spy dump --json`, as a node's answer carries it (formats.trim_pyspy_json's fields)."""
    threads: list[tuple[str | None, bool, list[tuple[str, str, int]]]] = [
        ("MainThread", not culprit, CULPRIT if culprit else WAITING), ("Thread-1", False, TQDM),
        ("Thread-2 (_pin_memory_loop)", False, PIN_MEMORY), ("QueueFeederThread", False, FEEDER),
        ("QueueFeederThread", False, FEEDER)] + [(None, False, [])] * 4  # threads with no Python frame
    return [{"pid": pid, "thread_id": 139_900_000_000_000 + 4096 * n, "thread_name": name, "active": active,
             "frames": _frames(frames)} for n, (name, active, frames) in enumerate(threads)]


def fr_trace(rank: int, nodes: int, entries: int, culprit: int, node: str) -> dict[str, Any]:
    """One rank's Flight Recorder trace as RankTrace.to_json writes it: the newest `entries` collectives,
    rotating over its three process groups, then the default group's all_reduce every rank but the culprit
    entered and none completed."""
    world = nodes * RANKS_PER_NODE
    local, tp = rank % RANKS_PER_NODE, rank // RANKS_PER_NODE
    names = {"0": ("0", "default_pg"), "tp": (str(1 + tp), "TENSOR_MODEL_PARALLEL_GROUP"),
             "dp": (str(1 + nodes + local), "DATA_PARALLEL_GROUP")}
    ids = {key: int(name) for key, (name, _) in names.items()}
    ops = {"0": ("nccl:all_reduce", [[1]]), "tp": ("nccl:all_reduce", [[4, 2048, 6144]]),
           "dp": ("nccl:_reduce_scatter_base", [[201_326_592]])}
    seq = {key: 1000 for key in names}  # the job has run for a while: sequence numbers count from its start
    out: list[dict[str, Any]] = []
    for n in range(entries):
        key = ("0", "tp", "dp")[n % 3]
        seq[key] += 1
        op, sizes = ops[key]
        out.append({"record_id": 3000 + n, "pg_id": ids[key], "process_group": list(names[key]),
                    "collective_seq_id": seq[key], "p2p_seq_id": 0, "op_id": seq[key], "profiling_name": op,
                    "state": "completed", "retired": True, "is_p2p": False,
                    "time_created_ns": 1_753_000_000_000_000_000 + n * 1_000_000, "input_sizes": sizes,
                    "output_sizes": sizes, "input_dtypes": ["BFloat16"], "output_dtypes": ["BFloat16"]})
    last = dict(seq)
    if rank != culprit:
        last["0"] += 1
        out.append({**out[-1], "record_id": 3000 + entries, "op_id": last["0"], "pg_id": 0,
                    "process_group": list(names["0"]), "collective_seq_id": last["0"],
                    "profiling_name": "nccl:all_reduce", "state": "started", "retired": False,
                    "input_sizes": [[1]], "output_sizes": [[1]]})
    done = {key: last[key] - (key == "0" and rank != culprit) for key in names}
    return {"rank": rank, "version": "2.10", "node": node, "source": f"/tmp/nccl_trace_rank_{rank}",
            "groups": {names["0"][0]: list(range(world)),
                       names["tp"][0]: list(range(tp * RANKS_PER_NODE, (tp + 1) * RANKS_PER_NODE)),
                       names["dp"][0]: list(range(local, world, RANKS_PER_NODE))},
            "status": {str(ids[k]): {"last_enqueued_collective": last[k], "last_started_collective": last[k],
                                     "last_completed_collective": done[k]} for k in names},
            "entries": out}


def node_answer(index: int, nodes: int, culprit: int, fr_entries: int,
                decided: dict[str, Any] | None = None) -> dict[str, object]:
    """What node `index`'s daemon answers to POST /v1/dump: its verdict from its 8 ranks (decided by the
    project's own analysis, as the node decides it), every rank's threads and Flight Recorder trace (its
    whole ring summarised as the node sends it: RankTrace.summarised). `decided`: the node's own verdict,
    summary and Flight Recorder finding taken from another node like it (the coordinator reads only whether
    the node confirmed the hang; deciding 12,500 nodes' own verdicts would take the bench most of an hour)."""
    node = f"gpu-node-{index:04d}"
    rows, dumps, traces = [], [], []
    for local in range(RANKS_PER_NODE):
        rank = index * RANKS_PER_NODE + local
        pid = 211_000 + local * 17
        threads = pyspy_threads(pid, rank == culprit)
        if decided is None:
            dumps += parse_pyspy_json(threads, node, rank, (local,))
        t = fr_trace(rank, nodes, fr_entries, culprit, node)
        traces.append(fr_dumps.RankTrace(t["rank"], t["version"], tuple(t["entries"]),
                                         {k: tuple(v) for k, v in t["groups"].items()}, t["status"],
                                         t["source"], t["node"]))
        rows.append({"rank": rank, "pid": pid, "gpus": [local], "member": f"rank {rank}",
                     "workload": {"slurm_job_id": "884213", "slurm_step": "0", "slurm_user": "trainer"},
                     "capture": "ok", "threads": threads})
    if decided is None:
        analysis = analyze(dumps)
        fr = fr_matching.analyze(traces)
        decided = {"verdict": with_job_evidence(verdict(analysis, spans_other_nodes=True), fr, None).to_json(),
                   "summary": analysis.summary, "outliers": list(analysis.outliers),
                   "flight_recorder": fr.to_json(),
                   "where": {int(str(m).split()[-1]) % RANKS_PER_NODE: (g.activity.name, g.where)
                             for m, g in analysis.group_by_member().items()}}
    for local, row in enumerate(rows):
        row["activity"], row["where"] = decided["where"].get(local, (None, None))
    stamp = iso_time(1_753_000_000.0)
    sent = [t.summarised().to_json() for t in traces]  # as the node sends them
    return {"node": node, "captured_at": stamp, "shared": False, "seconds": 3.41,
            "jobs": [{"training_job": JOB, "world_size": nodes * RANKS_PER_NODE, "verdict": decided["verdict"],
                      "summary": decided["summary"], "outliers": decided["outliers"], "ranks": rows,
                      "flight_recorder": decided["flight_recorder"], "flight_recorder_traces": sent}],
            "bundle": "20250720T083320Z-dump-gpu0-1-2-3-4-5-6-7",
            "bundle_path": "/var/lib/stall-watchdog/incidents/20250720T083320Z-dump-gpu0-1-2-3-4-5-6-7"}


# -- the fleet on loopback ------------------------------------------------------------------------------
class Fleet:
    """Every fake node on its own loopback port (the coordinator addresses a node by its `instance`
    label, host:port), and the Prometheus stand-in on one more, all served by one asyncio loop on a thread:
    a node answers its prepared bytes `delay` seconds after the request. Over NODES_A_PROCESS nodes, forked
    processes serve the nodes a share each (a node holds a listening socket and, asked, a connection, and a
    process may hold 20,000 descriptors here), and this one serves Prometheus."""

    def __init__(self, answers: list[bytes], delay: float):
        self.answers, self.delay = answers, delay
        self.instances: list[str] = []
        self.asked = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet", daemon=True)
        self.servers: list[asyncio.Server] = []
        self.prometheus = ""
        self.shares: list[tuple[int, int, int]] = []  # forked: (pid, its pipe out, the pipe that stops it)

    def __enter__(self) -> Fleet:
        if len(self.answers) > NODES_A_PROCESS:
            for first in range(0, len(self.answers), NODES_A_PROCESS):
                self._fork(self.answers[first:first + NODES_A_PROCESS])
            for _, out, _ in self.shares:
                self.instances += json.loads(_line(out))
            self.answers = []
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(120)
        return self

    def _fork(self, answers: list[bytes]) -> None:
        out_r, out_w = os.pipe()
        stop_r, stop_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the share: its nodes served until the stop pipe closes, then how many were asked
            os.close(out_r)
            os.close(stop_w)
            for _, out, stop in self.shares:  # the earlier shares' pipes: held here, theirs would never close
                os.close(out)
                os.close(stop)
            try:
                with Fleet(answers, self.delay) as share:
                    os.write(out_w, json.dumps(share.instances).encode() + b"\n")
                    os.read(stop_r, 1)
                os.write(out_w, f"{share.asked}\n".encode())
            finally:
                os._exit(0)
        os.close(out_w)
        os.close(stop_r)
        self.shares.append((pid, out_r, stop_w))

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        for pid, out, stop in self.shares:
            os.close(stop)
            self.asked += int(_line(out) or 0)
            os.close(out)
            os.waitpid(pid, 0)

    async def _start(self) -> None:
        for answer in self.answers:
            server = await asyncio.start_server(self._node(answer), "127.0.0.1", 0, backlog=64)
            self.servers.append(server)
            self.instances.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        prometheus = await asyncio.start_server(self._prometheus, "127.0.0.1", 0)
        self.servers.append(prometheus)
        self.prometheus = f"http://127.0.0.1:{prometheus.sockets[0].getsockname()[1]}"

    async def _stop(self) -> None:
        for server in self.servers:
            server.close()

    def _node(self, answer: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async with _Exchange(reader, writer) as (path, body):
                if path != "/v1/dump" or json.loads(body or b"{}").get("training_job") != JOB:
                    _reply(writer, 404, b'{"error": "no local rank of that training job on this node"}')
                    return
                self.asked += 1
                await asyncio.sleep(self.delay)
                _reply(writer, 200, answer)
        return serve

    async def _prometheus(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with _Exchange(reader, writer) as (path, _):
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("query", [""])[0]
            found = self.instances if f'training_job="{JOB}"' in query else []
            result = [{"metric": {"instance": i}, "value": [1_753_000_000.0, str(RANKS_PER_NODE)]} for i in found]
            _reply(writer, 200, json.dumps({"status": "success",
                                            "data": {"resultType": "vector", "result": result}}).encode())


def _line(fd: int) -> bytes:
    """One line from a pipe (a forked share's)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        data += chunk
    return data.strip()


class _Exchange:
    """One request read (head up to 64 KiB, a body up to 64 KiB, 10 s), the writer closed after the reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def __aenter__(self) -> tuple[str, bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                       if k.strip().lower() == "content-length"), 0)
        body = await asyncio.wait_for(self.reader.readexactly(min(length, 65536)), 10) if length else b""
        return lines[0].split(" ")[1], body

    async def __aexit__(self, *_: object) -> None:
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        self.writer.close()


def _reply(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


# -- one size -------------------------------------------------------------------------------------------
class PeakRss:
    """A process's resident memory sampled every 20 ms on a thread; `peak` in bytes."""

    def __init__(self, pid: int):
        self.process, self.peak, self.stop = psutil.Process(pid), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> PeakRss:
        self.peak = self.process.memory_info().rss
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def run_size(nodes: int, node_seconds: float, fr_entries: int) -> dict[str, float | bool]:
    culprit_node = nodes * 2 // 3
    culprit = culprit_node * RANKS_PER_NODE + 5
    began = time.perf_counter()
    # Node 0 and the culprit's node decide their own verdicts; the other nodes, whose local picture is node 0's
    # (eight ranks waiting in the all_reduce), carry node 0's.
    first = node_answer(0, nodes, culprit, fr_entries)
    job = first["jobs"][0]  # type: ignore[index]
    like_first = {"verdict": job["verdict"], "summary": job["summary"], "outliers": job["outliers"],
                  "flight_recorder": job["flight_recorder"],
                  "where": {local: (r["activity"], r["where"]) for local, r in enumerate(job["ranks"])}}
    answers = [json.dumps(first if i == 0 else node_answer(i, nodes, culprit, fr_entries,
                                                           None if i == culprit_node else like_first),
                          separators=(",", ":")).encode() for i in range(nodes)]
    built = time.perf_counter() - began
    sizes = sorted(len(a) for a in answers)
    stacks = len(json.dumps(pyspy_threads(1, False), separators=(",", ":")))
    print(f"{nodes} nodes, {nodes * RANKS_PER_NODE} ranks: answers built in {built:.1f} s, "
          f"{sum(sizes) / 2**20:.0f} MiB in all, {sizes[len(sizes) // 2] / 1024:.0f} KiB a node "
          f"({stacks / 1024:.1f} KiB of py-spy threads a rank, {fr_entries} Flight Recorder entries a rank)")
    with Fleet(answers, node_seconds) as fleet, tempfile.TemporaryDirectory() as folder:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with started("coordinate", [sys.executable, "-m", "watchdog", "coordinate", "--prometheus", fleet.prometheus,
                                    "--listen", f"127.0.0.1:{port}", "--out", str(Path(folder) / "jobs"),
                                    "--timeout-seconds", "60"], Path(folder), base + "/healthz", cwd=REPO) \
                as coordinator:
            alert = {"version": "4", "status": "firing", "receiver": "coordinator",
                     "groupLabels": {"training_job": JOB}, "commonLabels": {"training_job": JOB},
                     "alerts": [{"status": "firing", "labels": {"alertname": "StallWatchdogJobCollectiveHang",
                                                                 "training_job": JOB, "severity": "critical"}}]}
            with PeakRss(coordinator.pid) as rss:
                idle = rss.peak
                posted = time.perf_counter()
                request = urllib.request.Request(base + "/v1/alerts", json.dumps(alert).encode(),
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    assert response.status == 202, response.status
                latest = _until(lambda: get_json(base + "/v1/jobs", 30).get(JOB), 300)
                took = time.perf_counter() - posted
            bundle = latest.get("bundle")
            odd = latest["odd_ranks"]
            named = [(o["rank"], o["node"]) for o in odd] == [(culprit, f"gpu-node-{culprit_node:04d}")]
            decided = took - latest["bundle_seconds"]
            print(f"  verdict decided {decided:.2f} s after the alert ({latest['seconds']:.2f} s investigating; "
                  f"{latest['nodes_answered']} of {nodes} nodes answered), on GET /v1/jobs "
                  f"with its bundle {took:.2f} s after (bundle "
                  f"{'written' if bundle and Path(bundle).is_dir() else 'MISSING'} in "
                  f"{latest['bundle_seconds']:.2f} s)")
            print(f"  coordinator RSS: {idle / 2**20:.0f} MiB idle, peak {rss.peak / 2**20:.0f} MiB")
            print(f"  {latest['verdict']['kind']}: {latest['verdict']['headline']}")
            print(f"  culprit rank {culprit} on gpu-node-{culprit_node:04d}: "
                  f"{'named' if named else 'NOT named (odd: ' + str([o['member'] for o in odd][:4]) + ')'}")
    print(f"  {fleet.asked} of {nodes} nodes were asked for their dump")
    parsed = [NodeAnswer(f"10.0.{i // 256}.{i % 256}:9944", 200, json.loads(a)) for i, a in enumerate(answers)]
    del answers
    gc.collect()
    gc.freeze()  # the parsed answers are the input: the collector need not walk them again and again
    began = time.perf_counter()
    merged = merge(JOB, parsed, Placement([a.instance for a in parsed]))
    merging = time.perf_counter() - began
    gc.unfreeze()
    assert [o["rank"] for o in merged.odd] == [culprit], merged.odd
    ranks = nodes * RANKS_PER_NODE
    print(f"  merge in this process: {merging:.2f} s, {merging / ranks * 1e6:.0f} us a rank")
    return {"seconds": took, "decided": decided, "rss": rss.peak, "named": named, "merge": merging, "ranks": ranks}


def _until(check: Callable[[], Any], seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"nothing after {seconds:.0f} s")


def share(nodes: int) -> int:
    """What the coordinator reads of one node's answer in a job of `nodes` (nodes.NodeClient.ask_all)."""
    return max(1 << 20, min(MAX_ANSWER_BYTES, MAX_JOB_BYTES // nodes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="64,512,1024", help="job sizes in nodes of 8 ranks (default 64,512,1024)")
    parser.add_argument("--node-seconds", type=float, default=3.5, help="how long a node takes to answer")
    parser.add_argument("--fr-entries", type=int, default=32, help="Flight Recorder entries a rank (default 32)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    print(f"each node answers {args.node_seconds:g} s after it is asked")
    results = {n: run_size(n, args.node_seconds, args.fr_entries) for n in sizes}
    print("merge per rank: " + ", ".join(f"{r['ranks']:.0f} ranks {r['merge'] / r['ranks'] * 1e6:.0f} us"
                                         for r in results.values()))
    if GOAL_NODES in results:
        r = results[GOAL_NODES]
        print(f"goal at {GOAL_NODES} nodes: verdict within {GOAL_SECONDS:g} s of the alert: {r['decided']:.2f} s "
              f"{'met' if r['decided'] <= GOAL_SECONDS else 'MISSED'}")
        print(f"goal at {GOAL_NODES} nodes: coordinator RSS < {GOAL_RSS_MIB} MiB: {r['rss'] / 2**20:.0f} MiB "
              f"{'met' if r['rss'] < GOAL_RSS_MIB * 2**20 else 'MISSED'}")
        print(f"goal at {GOAL_NODES} nodes: culprit named: {'met' if r['named'] else 'MISSED'}")
    for nodes, (seconds, mib) in FLEET_GOALS.items():
        if nodes in results:
            r = results[nodes]
            print(f"goal at {nodes} nodes: verdict within {seconds:g} s of the alert: {r['decided']:.2f} s "
                  f"{'met' if r['decided'] <= seconds else 'MISSED'}; coordinator RSS under {mib} MiB: "
                  f"{r['rss'] / 2**20:.0f} MiB {'met' if r['rss'] < mib * 2**20 else 'MISSED'}; culprit named: "
                  f"{'met' if r['named'] else 'MISSED'}")
    ring = len(json.dumps(node_answer(0, GOAL_NODES, 5, 2000), separators=(",", ":")))
    print(f"with the Flight Recorder ring the doctor advises (2,000 entries a rank) a node of a {GOAL_NODES}-node job "
          f"answers {ring / 2**20:.1f} MiB; the coordinator reads up to "
          + ", ".join(f"{share(n) / 2**20:.1f} MiB ({n} nodes)" for n in sizes)
          + (": fits" if all(ring <= share(n) for n in sizes) else ": OVER (such a node is left out)"))


if __name__ == "__main__":
    main()
