"""A loopback stand-in for NCCL's RAS service (NCCL needs GPUs these machines lack).

It speaks the wire protocol of NCCL's src/ras/client_support.cc (CLIENT PROTOCOL / TIMEOUT / SET FORMAT /
[VERBOSE] STATUS) and writes its reports the way that code writes them: the JSON layout line for line
(`jsonWriteRankData`, `jsonWriteMissingRank`...), including NCCL 2.28.9's missing comma after a missing
rank's `nvml_dev`, and the text report's MISMATCH / INCOMPLETE / DEAD sections. `formats` lists what the
service answers to SET FORMAT json: a pre-2.28.7 service answers an error and writes text.
"""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

OPS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


@dataclass
class FakeRank:
    rank: int
    host: str
    pid: int
    gpu: int
    counts: dict[str, int] = field(default_factory=dict)
    missing: bool = False
    dead: bool = False


def json_report(ranks: list[FakeRank], version: str = "2.29.1") -> str:
    """rasDumpCommsToJSON for one communicator, as NCCL `version` writes it."""
    out = ["{\n", f'  "nccl_version": "{version}",\n', '  "cuda_runtime_version": 13000,\n',
           '  "cuda_driver_version": 13000,\n', '  "timestamp": "2026-11-22 13:06:53",\n',
           '  "communicators_count": 1,\n', '  "communicators": [\n']
    present = [r for r in ranks if not r.missing]
    missing = [r for r in ranks if r.missing]
    out += ["    {\n", '      "hash": "0xae94423cfbb2ef4a",\n', '      "secondary_hash": "0xb7e7:0xb824",\n',
            f'      "size": {len(ranks)},\n', f'      "ranks_count": {len(present)},\n',
            f'      "missing_ranks_count": {len(missing)},\n', '      "ranks": [\n']
    for number, r in enumerate(present):
        if number:
            out.append(",\n")
        out += ["        {\n", f'          "rank": {r.rank},\n', f'          "host": "{r.host}",\n',
                f'          "pid": {r.pid},\n', f'          "cuda_dev": {r.gpu},\n',
                f'          "nvml_dev": {r.gpu},\n',
                '          "status": {\n', '            "init_state": 0,\n', '            "async_error": 0,\n',
                '            "finalize_called": false,\n', '            "destroy_flag": false,\n',
                '            "abort_flag": false\n', '          },\n', '          "collective_counts": {\n']
        for i, op in enumerate(OPS):
            out.append(f'            "{op}": {r.counts.get(op, 0)}' + ("," if i < len(OPS) - 1 else "") + "\n")
        out += ["          }\n", "        }"]
    out += ["\n      ],\n", '      "missing_ranks": [\n']
    comma = "" if version.startswith("2.28.9") else ","  # the 2.28.9 bug
    for number, r in enumerate(missing):
        if number:
            out.append(",\n")
        out += ["        {\n", f'          "rank": {r.rank},\n', f'          "host": "{r.host}",\n',
                f'          "pid": {r.pid},\n', f'          "cuda_dev": {r.gpu},\n',
                f'          "nvml_dev": {r.gpu}{comma}\n', '          "status": {\n',
                '            "unresponsive": true,\n',
                f'            "considered_dead": {"true" if r.dead else "false"}\n',
                "          }\n", "        }"]
    out += ["\n      ]\n", "    }", "\n  ],\n", '  "ras": {\n', '    "collection_time_sec": 0.000,\n',
            '    "timeouts_count": 0\n', "  }\n", "}\n"]
    return "".join(out)


def text_report(ranks: list[FakeRank]) -> str:
    """The text report's sections for one communicator (client_support.cc's wording)."""
    out = ["Job summary\n===========\n\n", "Communicators... (0.00s)\n=============\n\n"]
    present = [r for r in ranks if not r.missing]
    missing = [r for r in ranks if r.missing]
    errors, warnings = [], []
    if missing:
        errors.append("#0-0 (ae94423cfbb2ef4a) INCOMPLETE\n  Missing communicator data from "
                      f"{len(missing)} rank{'s' if len(missing) > 1 else ''}\n"
                      + "".join(f"  The missing rank: {r.rank}\n" for r in missing))
        dead = [r for r in missing if r.dead]
        if dead:
            errors.insert(0, f"DEAD\n  {len(dead)} job process is considered dead (unreachable via the RAS network)\n"
                          + "".join(f"  Process {r.pid} on node {r.host} managing GPU {r.gpu}\n" for r in dead))
    mismatch = []
    for op in OPS:
        values: dict[int, list[FakeRank]] = {}
        for r in present:
            values.setdefault(r.counts.get(op, 0), []).append(r)
        if len(values) < 2:
            continue
        mismatch.append(f"  Communicator ranks have different {op} operation counts\n")
        for value, members in sorted(values.items(), key=lambda kv: -len(kv[1])):
            if len(members) > 1:
                mismatch.append(f"  {len(members)} ranks have launched up to operation {value}\n")
            if len(members) * 4 <= len(present) or len(members) < len(present) / 2:  # an outlier group
                for r in members:
                    head = f"  Rank {r.rank}" if len(members) > 1 else \
                        f"  Rank {r.rank} has launched up to operation {value}"
                    mismatch.append(f"{head} -- GPU {r.gpu} managed by process {r.pid} on node {r.host}\n")
        mismatch.append("\n")
    if mismatch:
        warnings.append("#0-0 (ae94423cfbb2ef4a) MISMATCH\n" + "".join(mismatch))
    if errors:
        out.append("\nErrors\n======\n\n" + "\n".join(errors))
    if warnings:
        out.append("\nWarnings\n========\n\n" + "\n".join(warnings))
    return "".join(out)


class FakeRasService:
    """Serves `state()` (the ranks now) on 127.0.0.1:<port> until stopped. `version`: the NCCL version
    the JSON names (2.28.9 writes the invalid JSON); `json_supported`: whether SET FORMAT json is OK."""

    def __init__(self, state: Callable[[], list[FakeRank]], version: str = "2.29.1", json_supported: bool = True):
        self.state, self.version, self.json_supported = state, version, json_supported
        self.queries = 0
        service = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                fmt = "text"
                for raw in self.rfile:
                    command = raw.decode().strip().upper()
                    if command.startswith("CLIENT PROTOCOL"):
                        self.wfile.write(b"SERVER PROTOCOL 2\n")
                    elif command.startswith("TIMEOUT"):
                        self.wfile.write(b"OK\n")
                    elif command.startswith("SET FORMAT"):
                        if service.json_supported:
                            fmt = command.split()[-1].lower()
                            self.wfile.write(b"OK\n")
                        else:
                            self.wfile.write(b"ERROR: Unknown command\n")
                    elif command.endswith("STATUS"):
                        service.queries += 1
                        ranks = service.state()
                        report = json_report(ranks, service.version) if fmt == "json" else text_report(ranks)
                        self.wfile.write(report.encode())
                        return
                    else:
                        self.wfile.write(b"ERROR: Unknown command\n")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]

    @contextmanager
    def running(self) -> Iterator[FakeRasService]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


def job(world: int = 64, per_node: int = 8, behind: dict[int, int] | None = None, base: int = 6650,
        missing: tuple[int, ...] = (), dead: tuple[int, ...] = ()) -> list[FakeRank]:
    """A job of `world` ranks on nodes of `per_node`, every rank at `base` AllReduce launches except the
    ranks in `behind` (rank -> how many behind)."""
    behind = behind or {}
    return [FakeRank(r, f"10.0.0.{r // per_node + 1}", 4000 + r, r % per_node,
                     {"AllReduce": base - behind.get(r, 0), "Broadcast": 3}, r in missing or r in dead, r in dead)
            for r in range(world)]
