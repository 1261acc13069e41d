"""A process's host-side counters, read from /proc: CPU seconds, bytes read and written, its start time (which tells
a reused pid from the process that had it) and its threads' states. Plain reads, not psutil: the daemon reads them
for every rank every second."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostActivity:
    """A rank's host-side counters at one instant (cumulative since the process started)."""

    cpu_seconds: float
    read_bytes: int | None  # rchar: bytes passed to read syscalls, cache hits included
    write_bytes: int | None  # wchar: bytes passed to write syscalls (a checkpoint writer grows it)
    threads: Mapping[str, int] = field(default_factory=dict)  # thread state letter (R, S, D...) -> count

    @property
    def io_bytes(self) -> int:
        """Bytes read and written (a counter not readable counts as none moved)."""
        return (self.read_bytes or 0) + (self.write_bytes or 0)

    def since(self, earlier: HostActivity) -> HostActivity:
        def delta(now: int | None, then: int | None) -> int | None:
            return None if now is None or then is None else now - then

        return HostActivity(self.cpu_seconds - earlier.cpu_seconds, delta(self.read_bytes, earlier.read_bytes),
                            delta(self.write_bytes, earlier.write_bytes), self.threads)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_counters(pid: int, proc_root: str = "/proc") -> tuple[int, float, int | None, int | None]:
    """(start time in clock ticks since boot, CPU seconds, rchar, wchar) of a process, from one read each
    of /proc/<pid>/stat and /proc/<pid>/io (rchar and wchar None where io is not ours to read). The
    start time tells a reused pid from the process that had it. OSError when the process is gone.
    Plain reads, not psutil: the daemon does this for every rank every second."""
    start, cpu = stat_counters(read_proc(f"{proc_root}/{pid}/stat"))
    try:
        read, write = io_counters(read_proc(f"{proc_root}/{pid}/io"))
    except PermissionError:
        return start, cpu, None, None
    return start, cpu, read, write


def stat_counters(stat: bytes) -> tuple[int, float]:
    """(start time in clock ticks since boot, CPU seconds) from the text of /proc/<pid>/stat."""
    # "pid (comm) S ppid ...": the comm may hold spaces and parentheses; the state follows the last ')'
    fields = stat[stat.rindex(b")") + 2:].split(None, 20)  # up to starttime, the rest left whole
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # starttime; utime + stime


def io_counters(io: bytes) -> tuple[int, int]:
    """(rchar, wchar) from the text of /proc/<pid>/io."""
    fields = io.split(None, 4)  # "rchar: N" and "wchar: N" lead
    if fields[0] != b"rchar:" or fields[2] != b"wchar:":
        raise ValueError(f"not /proc/<pid>/io: {io[:40]!r}")
    return int(fields[1]), int(fields[3])


def read_proc(path: str) -> bytes:
    """The first 4 KiB of a small /proc file, in one read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)
