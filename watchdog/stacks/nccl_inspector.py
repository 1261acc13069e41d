"""NCCL Inspector logs: how long each of a rank's collectives took, by NCCL's own clock, where a job enables it.

NCCL's Inspector profiler plugin (plugins/profiler/inspector in NCCL's repository), loaded with
`NCCL_PROFILER_PLUGIN=.../libnccl-profiler-inspector.so NCCL_INSPECTOR_ENABLE=1`, appends one JSON object a
line per completed collective to `<NCCL_INSPECTOR_DUMP_DIR>/<host>-pid<pid>.log` (the folder defaults to
`nccl-inspector-<SLURM_JOBID>`, else `nccl-inspector-unknown-jobid`, in the rank's working directory), every
`NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS` (its default, -1, writes only when the communicator is torn
down: nothing to read while the job runs). A line's `coll_perf.coll_exec_time_us` is how long the collective
ran on the GPU: the wait for the last peer, then the transfer. So the rank its peers wait for is the one whose
collectives take least. Each read adds the rank's time inside collectives and the wall time since the last
read, in milliseconds; detect/rank_waits.py compares the shares like the stack samples' wait shares, timed by
NCCL instead of sampled (GpuSample.nccl_waits).

The log is named by the host the rank sees and the pid it has in its own namespace: where the rank shares the
daemon's host name (its UTS namespace is the daemon's), that name exactly; in a container, the host name its
environment gives (HOSTNAME), else the one log of that pid in the folder (a folder shared by several nodes'
ranks then holds one per node: said, not guessed). The log is the rank's to write: it is found and read like
any file a rank names (rank_files.read_tail: inside the rank's root, no link followed, the rank's own user's
file, checked before it is opened), at most MAX_TAIL_BYTES a read (a log that grew more is read from its
newest part, the rest counted by proportion), and only the collective times of its lines are taken.
Prometheus mode (`NCCL_INSPECTOR_PROM_DUMP=1`) keeps averages per GPU with no timeline of a rank: not read.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from watchdog.boundary.rank_files import RankFileError, Tail, read_tail

MAX_TAIL_BYTES = 8 << 20  # of one log in one read: a rank that runs thousands of collectives a second fills it
_EXEC = re.compile(rb'"coll_exec_time_us"\s*:\s*(\d{1,15})(?=[\s,}])')
_STATUS_MAX = 16 * 1024
MAX_FOLDER = 4096  # PATH_MAX: a longer folder is not one the plugin could write to


def log_folder(env: Mapping[str, str]) -> str | None:
    """The folder a rank's Inspector writes its JSON log to, from the variables the plugin itself reads; None
    where it is not enabled, writes Prometheus files instead, or names no folder a path could be."""
    if env.get("NCCL_INSPECTOR_ENABLE", "").strip() != "1" or env.get("NCCL_INSPECTOR_PROM_DUMP", "").strip() == "1":
        return None
    folder = env.get("NCCL_INSPECTOR_DUMP_DIR")
    if folder:
        return folder if len(folder) <= MAX_FOLDER else None
    job = env.get("SLURM_JOBID", "").strip()
    return f"nccl-inspector-{job.lstrip('0') or '0'}" if job.isdigit() and len(job) <= 18 else \
        "nccl-inspector-unknown-jobid"


def host_of(pid: int, claimed: str | None, proc_root: str | Path = "/proc") -> str | None:
    """The host name the rank sees: this host's where it shares the daemon's UTS namespace (the kernel's word),
    else what its environment says (HOSTNAME: in a pod, the pod's), else None."""
    try:
        if os.stat(f"{proc_root}/{pid}/ns/uts").st_ino == os.stat("/proc/self/ns/uts").st_ino:
            return socket.gethostname()
    except OSError:
        pass
    return claimed if claimed and len(claimed) <= 255 and "/" not in claimed else None


def collective_micros(data: bytes) -> tuple[int, int]:
    """(collectives, their GPU time in microseconds) of whole log lines: each `coll_exec_time_us` counts
    (a line the rank wrote with two counts as two; the rank only misleads its own job's judgement)."""
    times = [int(m) for m in _EXEC.findall(data)]
    return len(times), sum(times)


def namespace_pid(pid: int, proc_root: str | Path = "/proc") -> int:
    """The process's id in its own pid namespace (the number the plugin puts in its log's name): the last of
    /proc/<pid>/status's NSpid, else the pid itself."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as handle:
            status = handle.read(_STATUS_MAX)
    except OSError:
        return pid
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            values = line.split()[1:]
            if values and values[-1].isdigit():
                return int(values[-1])
    return pid


@dataclass(frozen=True)
class Timed:
    """A rank's collectives between two reads: wall milliseconds and milliseconds inside collectives."""

    span_ms: int
    busy_ms: int
    collectives: int


class InspectorTail:
    """One rank's Inspector log, followed from where the first read found its end."""

    def __init__(self, pid: int, folder: str, proc_root: str | Path = "/proc", host: str | None = None):
        """`host`: the host name the rank sees (host_of), which names its log; None: the one log of its pid."""
        self.pid, self.folder, self.proc_root = pid, folder, proc_root
        suffix = f"-pid{namespace_pid(pid, proc_root)}.log"
        self.name, self.exact = (host + suffix, True) if host else (suffix, False)
        self.tail: Tail | None = None  # where the last read ended (its data is not kept)
        self.at: float | None = None

    def read(self, now: float) -> Timed | None:
        """What the log gained since the last read (None at the first); RankFileError where it cannot be read
        (then the next read starts afresh)."""
        try:
            tail = read_tail(self.pid, self.folder, self.name, self.tail, MAX_TAIL_BYTES, exact=self.exact,
                             proc_root=self.proc_root)
        except RankFileError:
            self.tail = self.at = None
            raise
        before, at = self.tail, self.at
        self.tail, self.at = replace(tail, data=b""), now
        if before is None or at is None or now <= at:
            return None
        count, micros = collective_micros(tail.data)
        if tail.skipped and tail.data:
            micros = micros * (len(tail.data) + tail.skipped) // len(tail.data)
        span_ms = int((now - at) * 1000)
        return Timed(span_ms, min(micros // 1000, span_ms), count)
