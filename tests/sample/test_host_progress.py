"""Host progress from /proc: the counters against psutil's on a real process, a process that moves
against one that waits, a process that goes away, and a pid that another process takes over."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from watchdog.sample import host_progress
from watchdog.sample.host_progress import HostProgress
from watchdog.sample.proc_counters import proc_counters
from watchdog.vocabulary.model import GpuSample, NodeSnapshot


def test_counters_agree_with_psutil() -> None:
    start, cpu, read, write = proc_counters(os.getpid())
    me = psutil.Process()
    times, io = me.cpu_times(), me.io_counters()
    assert abs(cpu - (times.user + times.system)) < 0.05
    assert read is not None and write is not None
    assert 0 <= io.read_chars - read < 2**20 and 0 <= io.write_chars - write < 2**20
    boot = psutil.boot_time()
    assert abs(boot + start / os.sysconf("SC_CLK_TCK") - me.create_time()) < 1.0


def test_a_process_that_is_gone_is_an_oserror() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    with pytest.raises(OSError):
        proc_counters(child.pid)


def test_a_busy_process_moves_and_a_sleeping_one_does_not() -> None:
    clock = iter(float(n) for n in range(100))
    progress = HostProgress(monotonic=lambda: next(clock))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "30"])
    try:
        snapshot = NodeSnapshot(0.0, (GpuSample(0, pids=(busy.pid,)), GpuSample(1, pids=(idle.pid,)),
                                      GpuSample(2)))
        first = progress.annotate(snapshot)
        assert [g.host_cpu_ratio for g in first.gpus] == [None, None, None]  # a first look has no rate
        # Let the busy one burn a quarter of a CPU second, however loaded the machine (the clock above says a
        # second passed between the two looks, so the ratio is at least 0.25).
        burnt = psutil.Process(busy.pid).cpu_times()
        deadline = time.monotonic() + 30
        while psutil.Process(busy.pid).cpu_times().user + psutil.Process(busy.pid).cpu_times().system \
                < burnt.user + burnt.system + 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        second = progress.annotate(snapshot)
        assert second.gpus[0].host_cpu_ratio is not None and second.gpus[0].host_cpu_ratio >= 0.2
        assert second.gpus[1].host_cpu_ratio == 0.0 and second.gpus[2].host_cpu_ratio is None
        busy.kill()
        busy.wait()
        third = progress.annotate(snapshot)
        assert third.gpus[0].host_cpu_ratio is None and third.gpus[1].host_cpu_ratio == 0.0
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait()


def test_a_reused_pid_starts_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pid with another start time is another process: no rate from the old one's counters."""
    readings = iter([(100, 50.0, 0), (100, 50.5, 10), (999, 0.1, 0), (999, 0.6, 0)])

    class Scripted:
        """A process whose /proc counters read as scripted."""

        def __init__(self, pid: int, keep_open: bool = True) -> None:
            self.kept, self.at, (self.start, self.cpu_seconds, self.io_bytes) = keep_open, 0.0, next(readings)

        def counters(self) -> tuple[int, float, int]:
            return next(readings)

        def close(self) -> None:
            pass

    monkeypatch.setattr(host_progress, "_Process", Scripted)
    clock = iter(float(n) for n in range(10))
    progress = HostProgress(monotonic=lambda: next(clock))
    snapshot = NodeSnapshot(0.0, (GpuSample(0, pids=(4242,)),))
    rates = [progress.annotate(snapshot).gpus[0].host_cpu_ratio for _ in range(4)]
    assert rates == [None, 0.5, None, 0.5]


def test_files_stay_open_while_a_process_is_on_a_gpu_and_close_when_it_ends() -> None:
    """Each reading is a pread of files kept open; a process that ended answers an error, is no longer
    read, and its files are closed (none left behind however many processes come and go)."""
    before = len(os.listdir("/proc/self/fd"))
    clock = iter(float(n) for n in range(100))
    progress = HostProgress(monotonic=lambda: next(clock))
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    snapshot = NodeSnapshot(0.0, tuple(GpuSample(n, pids=(c.pid,)) for n, c in enumerate(children)))
    for _ in range(3):
        rates = [g.host_cpu_ratio for g in progress.annotate(snapshot).gpus]
    assert rates == [0.0, 0.0, 0.0]
    assert len(os.listdir("/proc/self/fd")) == before + 6  # stat and io of each
    children[1].kill()
    children[1].wait()
    assert [g.host_cpu_ratio for g in progress.annotate(snapshot).gpus] == [0.0, None, 0.0]
    assert len(os.listdir("/proc/self/fd")) == before + 4
    progress.annotate(NodeSnapshot(0.0, ()))  # every process left the GPUs
    assert len(os.listdir("/proc/self/fd")) == before
    for child in children:
        child.kill()
        child.wait()


def test_past_max_open_processes_are_read_without_keeping_their_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with more GPU processes than MAX_OPEN cannot take the daemon's descriptors: the others are
    opened at each reading, and read the same."""
    monkeypatch.setattr(host_progress, "MAX_OPEN", 2)
    before = len(os.listdir("/proc/self/fd"))
    clock = iter(float(n) for n in range(100))
    progress = HostProgress(monotonic=lambda: next(clock))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3)] + [busy]
    snapshot = NodeSnapshot(0.0, tuple(GpuSample(n, pids=(c.pid,)) for n, c in enumerate(children)))
    try:
        progress.annotate(snapshot)
        time.sleep(0.5)
        gpus = progress.annotate(snapshot).gpus
        assert len(os.listdir("/proc/self/fd")) == before + 4  # two processes' stat and io
        assert [g.host_cpu_ratio for g in gpus[:3]] == [0.0, 0.0, 0.0]
        assert gpus[3].host_cpu_ratio is not None and gpus[3].host_cpu_ratio > 0  # read, not kept open
    finally:
        for child in children:
            child.kill()
            child.wait()
    progress.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_process_on_gpus_at_work_is_read_every_fifth_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every GPU of a process is at work its rates are read every AT_WORK_SECONDS and stand in between;
    a process on an idle GPU (or on one idle GPU among others) is read every tick, and a GPU that stops
    working has its processes read on its first idle sample."""
    reads: list[int] = []
    counters = host_progress._Process.counters

    def counted(self: host_progress._Process) -> tuple[int, float, int | None]:
        reads.append(self.pid)
        return counters(self)

    monkeypatch.setattr(host_progress._Process, "counters", counted)
    clock = iter(float(n) for n in range(100))
    progress = HostProgress(monotonic=lambda: next(clock))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    shared, idle = (subprocess.Popen(["sleep", "30"]) for _ in range(2))
    working = {0, 2}
    snapshot = NodeSnapshot(0.0, (GpuSample(0, pids=(busy.pid,)), GpuSample(1, pids=(idle.pid, shared.pid)),
                                  GpuSample(2, pids=(shared.pid,))))
    spent = psutil.Process(busy.pid)
    try:
        rates = []
        for _ in range(12):
            # A clock tick of CPU for the busy process between ticks, however loaded the machine (a fixed 60 ms
            # was sometimes none: its rate read 0): counted from its own CPU time, not waited for by the clock.
            before = sum(spent.cpu_times()[:2])
            while sum(spent.cpu_times()[:2]) <= before:
                time.sleep(0.01)
            gpus = progress.annotate(snapshot, lambda gpu: gpu.index in working).gpus
            rates.append(gpus[0].host_cpu_ratio)
        assert reads.count(idle.pid) == reads.count(shared.pid) == 12  # every tick
        assert reads.count(busy.pid) == 4  # its first look, then ticks 1 (its first rate), 6 and 11
        assert rates[0] is None and all(r is not None and r > 0 for r in rates[1:])
        assert len(set(rates[1:6])) == 1 and len(set(rates[6:11])) == 1  # the rates as last read, standing in
        working.discard(0)  # GPU 0 stops working: its process is read at once
        progress.annotate(snapshot, lambda gpu: gpu.index in working)
        assert reads.count(busy.pid) == 5
        progress.annotate(snapshot)  # no at_work: every process read
        assert reads.count(busy.pid) == 6
    finally:
        for child in (busy, shared, idle):
            child.kill()
            child.wait()
