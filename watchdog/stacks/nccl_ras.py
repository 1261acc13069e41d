"""NCCL's RAS service (NCCL 2.24+): every rank's collective counts across the whole job, from any rank's host.

Each NCCL process runs a RAS thread; the first on a host listens on localhost:28028 (or NCCL_RAS_ADDR).
The protocol is text (NCCL's docs/troubleshooting/ras.rst and src/ras/client.cc):

    -> CLIENT PROTOCOL 2        <- SERVER PROTOCOL <n>
    -> TIMEOUT <seconds>        <- OK
    -> SET FORMAT json          <- OK          (2.28.7+; older versions answer otherwise: text then)
    -> VERBOSE STATUS           <- the report, until the server closes the connection

The official `ncclras` client is used where installed; otherwise the same protocol is spoken here.
What the report says, and how two of them a few seconds apart are judged, is in ras_report.py.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from watchdog.sample import listeners
from watchdog.stacks.ras_report import MAX_LINE, RasError, RasFinding, judge, parse

DEFAULT_PORT = 28028
PROTOCOL = 2
MAX_REPORT_BYTES = 16 * 2**20


def address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """Where a rank's RAS service listens; None when the job switched RAS off (NCCL_RAS_ENABLE=0).

    The address comes from a rank's environment, and the daemon runs as root: only an address of this node
    (loopback, where NCCL listens by default, or an address of one of its own interfaces; no names looked
    up) and a port in 1-65535 are taken. Anything else falls back to the default, so a rank cannot make
    root connect to another host and report what answers there."""
    if env.get("NCCL_RAS_ENABLE", "1").strip() == "0":
        return None
    text = env.get("NCCL_RAS_ADDR", "").strip()
    if not text:
        return "localhost", DEFAULT_PORT
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "localhost"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) <= 65535) \
            or not _this_node(host):
        return "localhost", DEFAULT_PORT
    return host, int(port)


def _this_node(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    try:
        mine = {a.address.split("%", 1)[0] for addresses in psutil.net_if_addrs().values() for a in addresses}
    except OSError:
        return False
    return str(ip) in mine


# -- asking --------------------------------------------------------------------------------------------
def query(host: str = "localhost", port: int = DEFAULT_PORT, timeout_seconds: float = 5.0,
          binary: str | None = None) -> str:
    """One VERBOSE STATUS report, JSON where the service can write it. `binary`: the ncclras client to
    use (default: the one on PATH, if any)."""
    binary = binary if binary is not None else shutil.which("ncclras")
    if binary:
        return _query_binary(binary, host, port, timeout_seconds)
    return _query_socket(host, port, timeout_seconds)


def _query_binary(binary: str, host: str, port: int, timeout_seconds: float) -> str:
    wait = max(1, int(timeout_seconds))
    for fmt in ("json", None):
        argv = [binary, "-h", host, "-p", str(port), "-t", str(wait), "-v"] + (["-f", fmt] if fmt else [])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                                  timeout=timeout_seconds * 2 + 5)
        except subprocess.TimeoutExpired:
            raise RasError(f"ncclras did not answer within {timeout_seconds * 2 + 5:.0f} s") from None
        except OSError as exc:
            raise RasError(f"ncclras: {exc.strerror or exc}") from None
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout
        if fmt and "Invalid format" not in done.stderr and "Unexpected response" not in done.stderr:
            break  # not a format problem: asking for text will not help
    first = (done.stderr.strip().splitlines() or ["no output"])[0]
    raise RasError(f"ncclras exited {done.returncode}: {first[:200]}")


def _query_socket(host: str, port: int, timeout_seconds: float) -> str:
    deadline = time.monotonic() + timeout_seconds * 2 + 5  # RAS's own gathering may take the timeout
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout_seconds, 2.0))
    except OSError as exc:
        raise RasError(f"nothing answers at {host}:{port} ({exc.strerror or exc}): the job is not NCCL 2.24+, "
                       "set NCCL_RAS_ENABLE=0, or listens elsewhere (NCCL_RAS_ADDR)") from None
    with sock:
        reader = _Lines(sock, deadline)
        reader.send(f"CLIENT PROTOCOL {PROTOCOL}\n")
        hello = reader.line()
        if not hello.upper().startswith("SERVER PROTOCOL"):
            raise RasError(f"{host}:{port} is not NCCL's RAS service (it said {hello[:60]!r})")
        reader.send(f"TIMEOUT {max(1, int(timeout_seconds))}\n")
        if reader.line().strip().upper() != "OK":
            raise RasError(f"{host}:{port}: TIMEOUT refused")
        reader.send("SET FORMAT json\n")
        reader.line()  # OK on 2.28.7+; anything else: the report comes as text
        reader.send("VERBOSE STATUS\n")
        return reader.rest()


class _Lines:
    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.buffer = sock, deadline, bytearray()  # grown in place: 16 MiB is linear

    def _recv(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasError("the RAS service did not finish its answer in time")
        self.sock.settimeout(left)
        try:
            return self.sock.recv(65536)
        except OSError as exc:
            raise RasError(f"reading from the RAS service: {exc.strerror or exc}") from None

    def send(self, text: str) -> None:
        try:
            self.sock.sendall(text.encode())
        except OSError as exc:
            raise RasError(f"writing to the RAS service: {exc.strerror or exc}") from None

    def line(self) -> str:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise RasError(f"the RAS service sent a line over {MAX_LINE} bytes; not NCCL's protocol")
            chunk = self._recv()
            if not chunk:
                raise RasError("the RAS service closed the connection")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode(errors="replace")

    def rest(self) -> str:
        while len(self.buffer) <= MAX_REPORT_BYTES:
            chunk = self._recv()
            if not chunk:
                return self.buffer.decode(errors="replace")
            self.buffer += chunk
        raise RasError(f"the RAS report is over {MAX_REPORT_BYTES // 2**20} MiB")


def ask_twice(host: str, port: int, gap_seconds: float = 3.0, timeout_seconds: float = 5.0,
              binary: str | None = None, pids: Sequence[int] | None = None,
              proc_root: str | Path = "/proc") -> RasFinding:
    """Query, wait `gap_seconds`, query again, judge. A failure is a finding with its problem, never raised.
    `pids`: the job's local ranks; each query is made only while every socket listening on `port` is one of
    theirs (any user may listen on a free port and answer for the job)."""
    try:
        first = parse(_ask(host, port, timeout_seconds, binary, pids, proc_root))
        time.sleep(gap_seconds)
        second = parse(_ask(host, port, timeout_seconds, binary, pids, proc_root))
    except RasError as exc:
        return RasFinding(False, (), (), (), 0, problem=str(exc))
    return judge(first, second)


def _ask(host: str, port: int, timeout_seconds: float, binary: str | None, pids: Sequence[int] | None,
         proc_root: str | Path) -> str:
    why = listeners.strangers(port, pids, proc_root) if pids is not None else None
    if why is not None:
        raise RasError(f"unknown: {why} (not asked: its answer would not be the job's)")
    return query(host, port, timeout_seconds, binary)


def where_to_ask(envs: Sequence[Mapping[str, str]]) -> tuple[str, int] | None:
    """The RAS address the local ranks agree on (the first that names one), None when RAS is off."""
    return next((a for a in map(address, envs) if a is not None), None)
