"""Hostile processes: a py-spy that hangs when the daemon is told to stop, and a rank whose command line
and environment carry secrets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import python_target
from tests.fakes.daemon import daemon_config, stepping_clock
from tests.users import described
from watchdog.sample import sim
from watchdog.sample.host_progress import AT_WORK_SECONDS
from watchdog.sample.ranks import REDACTED, RankDiscovery, proc_counters
from watchdog.service import build


def test_stopping_kills_a_hung_capture_within_the_stop_timeout(tmp_path: Path) -> None:
    hung = tmp_path / "py-spy"
    hung.write_text("#!/bin/sh\nsleep 900\n")
    hung.chmod(0o755)
    with python_target("queue", tmp_path) as rank:
        pids = {gpu: [rank.pid] for gpu in range(8)}
        config = daemon_config(tmp_path, source={"scenario": "spin_hang", "pids": pids},
                               bundles={"capture_stacks": True},
                               stacks={"py_spy_command": [str(hung)], "timeout_seconds": 600})
        service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 285, pids, clock=stepping_clock()))
        daemon = service.daemon
        ticks = 0
        while not daemon.incidents.open and ticks < 60:
            daemon.tick()
            ticks += 1
        assert daemon.incidents.open, "the spin was never suspected"
        time.sleep(0.5)  # the capture is running (and hung)
        # Its own timeout is ten minutes away and the stop waits 10 s: a stop that only waited would return with
        # the py-spy still running.
        service.close(timeout=10)
    stray = subprocess.run(["pgrep", "-f", str(hung)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", "the stop left the hung py-spy running (systemd would wait on it)"


def test_secret_looking_arguments_and_variables_never_leave_the_rank(tmp_path: Path) -> None:
    info = described(["--hf-token=hf_SECRET1", "--api-key", "SECRET2", "--tokenizer", "gpt2"],
                     {"RANK": "0", "WORLD_SIZE": "1", "NCCL_IB_AUTH_TOKEN": "SECRET3", "NCCL_DEBUG": "WARN"})
    text = " ".join(info.cmdline) + " " + " ".join(f"{k}={v}" for k, v in info.env.items())
    assert "SECRET" not in text
    assert f"--hf-token={REDACTED}" in info.cmdline and "gpt2" in info.cmdline
    assert info.env["NCCL_IB_AUTH_TOKEN"] == REDACTED and info.env["NCCL_DEBUG"] == "WARN"


def test_a_short_command_is_bounded_in_bytes_and_time_whatever_it_prints_or_reads(tmp_path: Path) -> None:
    """children.run (scontrol, the command action, the command receiver): 200 MB on stdout and stderr is
    read and dropped past 64 KiB each; a command that never reads its 1 MB input, or that leaves a
    grandchild holding the pipes, is still cut at its timeout."""
    import resource

    from watchdog.boundary import children

    flood = "import os, sys\nfor _ in range(1600):\n    os.write(1, b'x' * 65536); os.write(2, b'y' * 65536)\n"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = children.run([sys.executable, "-c", flood], timeout=60)
    assert len(out) == children.MAX_OUTPUT_BYTES and set(out) == {"x"}
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: far below 200 MB
    with pytest.raises(children.CommandError) as caught:
        children.run([sys.executable, "-c", "import time; time.sleep(60)"], stdin="z" * 2**20, timeout=2)
    assert caught.value.timed_out
    escaped = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\ntime.sleep(60)\n"
    with pytest.raises(children.CommandError, match="did not finish within 2 s"):  # the escaped child does not hold it
        children.run([sys.executable, "-c", escaped], timeout=2)


def test_a_rank_named_like_proc_stat_fields_does_not_move_its_counters() -> None:
    """A rank may name itself anything that fits /proc/<pid>/comm, parentheses, spaces and digits included:
    its host-progress counters are still read from the fields after the kernel's own closing parenthesis."""
    child = subprocess.Popen([sys.executable, "-c",
                              "open('/proc/self/comm', 'w').write(') R 1 2 3 (9'); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        comm = Path(f"/proc/{child.pid}/comm")
        while ") R 1 2 3" not in comm.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ") R 1 2 3" in comm.read_text()
        start, cpu, read, write = proc_counters(child.pid)
        process = psutil.Process(child.pid)
        boot = psutil.boot_time()
        assert abs(boot + start / os.sysconf("SC_CLK_TCK") - process.create_time()) < 1.0
        times = process.cpu_times()
        assert abs(cpu - (times.user + times.system)) < 0.05
        io = process.io_counters()
        assert read is not None and write is not None and read <= io.read_chars and write <= io.write_chars
    finally:
        child.kill()
        child.wait()


def test_a_rank_whose_threads_name_themselves_in_invalid_utf8_is_still_described() -> None:
    """A thread's name is whatever bytes it set (prctl, /proc/self/task/<tid>/comm), invalid UTF-8 and a
    parenthesis included: the rank is described (its threads counted by state), found by a scan, and its
    thread names never reach the verdict."""
    script = ("import threading, time\n"
              "def named():\n"
              "    open(f'/proc/self/task/{threading.get_native_id()}/comm', 'wb').write(b'x\\xff\\xfe) R 1')\n"
              "    time.sleep(30)\n"
              "threading.Thread(target=named, daemon=True).start()\n"
              "open('/proc/self/comm', 'wb').write(b'\\xc3(\\xff')\n"
              "time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", script],
                             env={**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                b"\xff\xfe" in (task / "comm").read_bytes() for task in Path(f"/proc/{child.pid}/task").iterdir()):
            time.sleep(0.05)
        discovery = RankDiscovery()
        info = discovery.describe(child.pid)
        assert info is not None and info.activity is not None and info.rank == 1
        assert sum(info.activity.threads.values()) == 2 and set(info.activity.threads) <= set("RSDZTtXIPWK")
        assert child.pid in {rank.pid for rank in discovery.scan()}
    finally:
        child.kill()
        child.wait()


def _on_pid(pid: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """A new process on a pid that has just been freed (the kernel hands out the next pid after
    ns_last_pid); None when other processes keep taking it first."""
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        child = subprocess.Popen(argv, env=env)
        if child.pid == pid:
            # Popen may return while the child is still inside execve (the parent of a vfork resumes once the
            # child's new memory is in place, before its environment is): /proc/<pid>/environ reads empty until
            # then, and a description taken in that moment has no rank.
            deadline = time.monotonic() + 60
            while not Path(f"/proc/{pid}/environ").read_bytes() and time.monotonic() < deadline:
                time.sleep(0.01)
            return child
        child.kill()
        child.wait()
    return None


def test_a_reused_pid_is_described_afresh(tmp_path: Path) -> None:
    """rank_info names the process on the pid now: when a rank ends and another process (another job's
    rank) gets its pid, the labels follow as soon as host progress reads the pid again (at once on an idle
    GPU, within AT_WORK_SECONDS on one at work)."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing the next pid needs root (writes /proc/sys/kernel/ns_last_pid)")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    first = subprocess.Popen(sleeper, env={**os.environ, "RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "jobA"})
    pid, second = first.pid, None
    try:
        pids = {gpu: [pid] for gpu in range(8)}
        config = daemon_config(tmp_path, source={"scenario": "spin_hang", "pids": pids})
        service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 285, pids, clock=stepping_clock()),
                       monotonic=stepping_clock(1000.0))
        daemon = service.daemon
        daemon.tick()
        assert {(row.rank, row.job) for row in daemon.published.ranks} == {(3, "run:jobA")}
        time.sleep(0.1)  # /proc's start times count in clock ticks (10 ms): the two processes must not share one
        first.kill()
        first.wait()
        second = _on_pid(pid, sleeper, {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "jobB"})
        assert second is not None, f"pid {pid} could not be handed to a new process"
        labels = []
        for _ in range(int(AT_WORK_SECONDS) + 2):  # a second of the daemon's clock a tick
            daemon.tick()
            labels.append({(row.rank, row.job) for row in daemon.published.ranks})
        assert labels[-1] == {(0, "run:jobB")} and {(3, "run:jobA")} not in labels[int(AT_WORK_SECONDS) + 1:], labels
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait()


def test_a_process_that_cannot_be_described_costs_its_labels_not_the_metrics(tmp_path: Path) -> None:
    """Whatever a rank does to its /proc files, a description that fails leaves the node's metrics whole:
    the process is published without rank or job, and the failure is counted and said."""

    class Failing(RankDiscovery):
        def describe(self, pid: int, *args: object, **kwargs: object) -> None:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a rank's bytes")

    with python_target("queue", tmp_path) as rank:
        pids = {gpu: [rank.pid] for gpu in range(8)}
        config = daemon_config(tmp_path, source={"scenario": "spin_hang", "pids": pids})
        service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 285, pids, clock=stepping_clock()),
                       discovery=Failing())
        daemon = service.daemon
        daemon.tick()
        exposition = service.exposition().decode()
    assert daemon.guard.up.get("export") is True
    assert 'gpu_utilization_ratio{gpu="0"' in exposition
    assert "stall_watchdog_last_sample_timestamp_seconds" in exposition
    assert daemon.counters.get("component_errors_total", "ranks") == 1
    assert {(row.pid, row.rank, row.job) for row in daemon.published.ranks} == {(rank.pid, None, "")}
