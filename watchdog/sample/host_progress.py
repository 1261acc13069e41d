"""Host progress as a reading: for the processes on each GPU, how much CPU they used and how many bytes
they moved through read and write calls since the previous sample, as per-GPU rates.

A rank that writes a checkpoint or evaluates on the host moves; a rank blocked in a queue, a lock or a
collective that will never complete does not. The counters are two small /proc reads per process
(`/proc/<pid>/stat` and `/proc/<pid>/io`: rchar and wchar, socket and cache traffic included). Only the
GPU's own processes count, not their children: a DataLoader worker that still runs does not make the
rank waiting on it move. Both files stay open while their process is on a GPU, and each reading is one
pread of each (procfs renders them afresh at offset 0): at 64 GPUs an open and a close per file and tick
were most of the reading's cost. A file of a process that has ended answers an error, and is opened again
(a reused pid is told apart by its start time). At most MAX_OPEN processes keep their files open, so a node
with thousands of GPU processes cannot take the daemon's descriptors; the others are opened at each reading.

Host progress decides between a stall and a pause only where the GPU does no work of its own. A process whose
GPUs are all at work in this sample (the caller's `at_work`: memory controller or SMs busy, or a hang on them
already paged for) is read at most every AT_WORK_SECONDS, its last rates standing in between: on a node of busy
GPUs that is a fifth of the reads, and a GPU that stops working is read again on its first idle sample.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from watchdog.sample.proc_counters import io_counters, proc_counters, stat_counters
from watchdog.vocabulary.model import GpuSample, NodeSnapshot


class _Process:
    """One process on a GPU: its /proc/<pid>/stat and /proc/<pid>/io, kept open (io None where it is not
    ours to read) or, past MAX_OPEN processes, opened at each reading; and its counters as last read."""

    __slots__ = ("pid", "kept", "stat", "io", "start", "at", "cpu_seconds", "io_bytes", "rates")

    def __init__(self, pid: int, keep_open: bool = True):
        self.pid, self.kept = pid, keep_open
        self.stat: int | None = None
        self.io: int | None = None
        self.at = 0.0
        self.rates: tuple[float | None, float | None] = (None, None)  # as last read: what stands in meanwhile
        try:
            if keep_open:
                self.stat = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
                with contextlib.suppress(PermissionError):  # another user's process: its CPU, not its I/O
                    self.io = os.open(f"/proc/{pid}/io", os.O_RDONLY)
            self.start, self.cpu_seconds, self.io_bytes = self.counters()
        except BaseException:
            self.close()
            raise

    def counters(self) -> tuple[int, float, int | None]:
        """(start time, CPU seconds, rchar + wchar) now, as proc_counters.proc_counters reads them."""
        if self.stat is None:
            start, cpu, read, write = proc_counters(self.pid)
            return start, cpu, read + write if read is not None and write is not None else None
        start, cpu = stat_counters(os.pread(self.stat, _MAX_BYTES, 0))
        if self.io is None:
            return start, cpu, None
        read, write = io_counters(os.pread(self.io, _MAX_BYTES, 0))
        return start, cpu, read + write

    def close(self) -> None:
        for fd in (self.stat, self.io):
            if fd is not None:
                os.close(fd)
        self.stat = self.io = None


AT_WORK_SECONDS = 4.5  # a process on GPUs at work is read every 5th tick at 1 Hz
MAX_OPEN = 256  # processes whose files stay open (two descriptors each); the rest are opened at each reading
_MAX_BYTES = 4096  # both files are a few hundred bytes
# The two readings side by side in a sample: set without _replace, which goes through every field by name.
_CPU = GpuSample._fields.index("host_cpu_ratio")
assert GpuSample._fields[_CPU + 1] == "host_io_bytes_per_second"
_new = tuple.__new__


class HostProgress:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._monotonic = monotonic
        self._processes: dict[int, _Process] = {}

    def close(self) -> None:
        for pid in list(self._processes):
            self._forget(pid)

    def _kept(self) -> int:
        return sum(1 for process in self._processes.values() if process.kept)

    def _forget(self, pid: int) -> None:
        process = self._processes.pop(pid, None)
        if process is not None:
            process.close()

    def start_of(self, pid: int) -> int | None:
        """The process's start time (clock ticks since boot) as last read; None for a pid not read. A pid
        whose start changes is another process."""
        process = self._processes.get(pid)
        return process.start if process is not None else None

    def _read(self, pid: int, now: float) -> tuple[float | None, float | None]:
        """(CPU ratio, I/O bytes per second) of one process since it was last read; None for a first look."""
        process = self._processes.get(pid)
        if process is not None:
            try:
                start, cpu, io_bytes = process.counters()
            except (OSError, ValueError, IndexError):  # ended: its pid may be another process's now
                self._forget(pid)
                process = None
        if process is None:
            try:
                self._processes[pid] = _Process(pid, keep_open=self._kept() < MAX_OPEN)
            except (OSError, ValueError, IndexError):  # gone, or not a process we may look at
                return None, None
            self._processes[pid].at = now
            return None, None
        if start != process.start or now <= process.at:  # another process than the one read before: afresh
            process.start, process.at, process.cpu_seconds, process.io_bytes = start, now, cpu, io_bytes
            process.rates = (None, None)
            return process.rates
        elapsed = now - process.at
        before_cpu, before_io = process.cpu_seconds, process.io_bytes
        process.at, process.cpu_seconds, process.io_bytes = now, cpu, io_bytes
        io_rate = (io_bytes - before_io) / elapsed if io_bytes is not None and before_io is not None else None
        process.rates = (max(0.0, cpu - before_cpu) / elapsed, io_rate)
        return process.rates

    def _rates(self, pid: int, now: float, idle: set[int]) -> tuple[float | None, float | None]:
        """The process's rates: read now, or (on GPUs all at work, read less than AT_WORK_SECONDS ago) as
        last read."""
        process = self._processes.get(pid)
        if pid in idle or process is None or process.rates[0] is None or now - process.at >= AT_WORK_SECONDS:
            return self._read(pid, now)
        return process.rates

    def annotate(self, snapshot: NodeSnapshot, at_work: Callable[[GpuSample], bool] | None = None) -> NodeSnapshot:
        """The snapshot with each GPU's host_cpu_ratio and host_io_bytes_per_second filled in. `at_work`
        says which GPUs do real work in this sample; without it, every process is read."""
        now = self._monotonic()
        rates: dict[int, tuple[float | None, float | None]] = {}
        idle = {pid for gpu in snapshot.gpus if at_work is None or not at_work(gpu) for pid in gpu.pids}
        gpus = []
        for gpu in snapshot.gpus:
            if not gpu.pids:
                gpus.append(gpu)
                continue
            cpu_total = io_total = None
            for pid in gpu.pids:
                if pid not in rates:
                    rates[pid] = self._rates(pid, now, idle)
                cpu, io = rates[pid]
                if cpu is not None:
                    cpu_total = (cpu_total or 0.0) + cpu
                if io is not None:
                    io_total = (io_total or 0.0) + io
            gpus.append(_new(GpuSample, (*gpu[:_CPU], cpu_total, io_total, *gpu[_CPU + 2:])))
        for gone in self._processes.keys() - rates.keys():
            self._forget(gone)
        return NodeSnapshot(snapshot.time_seconds, tuple(gpus))
