"""Host progress as a reading: for the processes on each GPU, how much CPU they used and how many bytes
they moved through read and write calls since the previous sample, as per-GPU rates.

A rank that writes a checkpoint or evaluates on the host moves; a rank blocked in a queue, a lock or a
collective that will never complete does not. The counters are two small /proc reads per process
(`/proc/<pid>/stat` and `/proc/<pid>/io`: rchar and wchar, socket and cache traffic included). Only the
GPU's own processes count, not their children: a DataLoader worker that still runs does not make the
rank waiting on it move.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from watchdog.model import NodeSnapshot
from watchdog.sample.ranks import proc_counters


@dataclass
class _Seen:
    start: int  # the process's start time: a pid reused by another process starts afresh
    at: float
    cpu_seconds: float
    io_bytes: int | None


class HostProgress:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._monotonic = monotonic
        self._seen: dict[int, _Seen] = {}

    def _read(self, pid: int, now: float) -> tuple[float | None, float | None]:
        """(CPU ratio, I/O bytes per second) of one process since it was last read; None for a first look."""
        seen = self._seen.get(pid)
        try:
            start, cpu, read, write = proc_counters(pid)
        except (OSError, ValueError, IndexError):  # gone, or not a process we may look at
            self._seen.pop(pid, None)
            return None, None
        io_bytes = read + write if read is not None and write is not None else None
        self._seen[pid] = _Seen(start, now, cpu, io_bytes)
        if seen is None or now <= seen.at or seen.start != start:
            return None, None
        elapsed = now - seen.at
        io_rate = (io_bytes - seen.io_bytes) / elapsed if io_bytes is not None and seen.io_bytes is not None else None
        return max(0.0, cpu - seen.cpu_seconds) / elapsed, io_rate

    def annotate(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """The snapshot with each GPU's host_cpu_ratio and host_io_bytes_per_second filled in."""
        now = self._monotonic()
        rates: dict[int, tuple[float | None, float | None]] = {}
        gpus = []
        for gpu in snapshot.gpus:
            if not gpu.pids:
                gpus.append(gpu)
                continue
            cpu_total = io_total = None
            for pid in gpu.pids:
                if pid not in rates:
                    rates[pid] = self._read(pid, now)
                cpu, io = rates[pid]
                if cpu is not None:
                    cpu_total = (cpu_total or 0.0) + cpu
                if io is not None:
                    io_total = (io_total or 0.0) + io
            gpus.append(gpu._replace(host_cpu_ratio=cpu_total, host_io_bytes_per_second=io_total))
        for gone in self._seen.keys() - rates.keys():
            del self._seen[gone]
        return NodeSnapshot(snapshot.time_seconds, tuple(gpus))
