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
from watchdog.daemon import build
from watchdog.sample import sim
from watchdog.sample.ranks import REDACTED, RankDiscovery, proc_counters


def test_stopping_kills_a_hung_capture_within_the_stop_timeout(tmp_path: Path) -> None:
    hung = tmp_path / "py-spy"
    hung.write_text("#!/bin/sh\nsleep 120\n")
    hung.chmod(0o755)
    with python_target("queue", tmp_path) as rank:
        pids = {gpu: [rank.pid] for gpu in range(8)}
        config = daemon_config(tmp_path, source={"scenario": "spin_hang", "pids": pids},
                               bundles={"capture_stacks": True},
                               stacks={"py_spy_command": [str(hung)], "timeout_seconds": 90})
        daemon = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 285, pids, clock=stepping_clock()))
        ticks = 0
        while not daemon.incidents.open and ticks < 60:
            daemon.tick()
            ticks += 1
        assert daemon.incidents.open, "the spin was never suspected"
        time.sleep(0.5)  # the capture is running (and hung)
        started = time.monotonic()
        daemon.shutdown(timeout=10)
        took = time.monotonic() - started
    assert took < 20, f"shutdown took {took:.0f} s behind a hung py-spy (systemd stops after 30 s)"
    stray = subprocess.run(["pgrep", "-f", str(hung)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", "the hung py-spy was left running"


def test_secret_looking_arguments_and_variables_never_leave_the_rank(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--hf-token=hf_SECRET1",
                                "--api-key", "SECRET2", "--tokenizer", "gpt2"],
                               env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "NCCL_IB_AUTH_TOKEN": "SECRET3",
                                    "NCCL_DEBUG": "WARN"})
    try:
        time.sleep(0.3)
        info = RankDiscovery().describe(process.pid)
    finally:
        process.kill()
        process.wait()
    assert info is not None
    text = " ".join(info.cmdline) + " " + " ".join(f"{k}={v}" for k, v in info.env.items())
    assert "SECRET" not in text
    assert f"--hf-token={REDACTED}" in info.cmdline and "gpt2" in info.cmdline
    assert info.env["NCCL_IB_AUTH_TOKEN"] == REDACTED and info.env["NCCL_DEBUG"] == "WARN"


def test_a_short_command_is_bounded_in_bytes_and_time_whatever_it_prints_or_reads(tmp_path: Path) -> None:
    """children.run (scontrol, the command action, the command receiver): 200 MB on stdout and stderr is
    read and dropped past 64 KiB each; a command that never reads its 1 MB input, or that leaves a
    grandchild holding the pipes, is still cut at its timeout."""
    import resource

    from watchdog import children

    flood = "import os, sys\nfor _ in range(1600):\n    os.write(1, b'x' * 65536); os.write(2, b'y' * 65536)\n"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = children.run([sys.executable, "-c", flood], timeout=60)
    assert len(out) == children.MAX_OUTPUT_BYTES and set(out) == {"x"}
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: far below 200 MB
    started = time.monotonic()
    with pytest.raises(children.CommandError) as caught:
        children.run([sys.executable, "-c", "import time; time.sleep(60)"], stdin="z" * 2**20, timeout=2)
    assert caught.value.timed_out and time.monotonic() - started < 10
    escaped = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\ntime.sleep(60)\n"
    started = time.monotonic()
    with pytest.raises(children.CommandError, match="did not finish within 2 s"):
        children.run([sys.executable, "-c", escaped], timeout=2)
    assert time.monotonic() - started < 10


def test_a_rank_named_like_proc_stat_fields_does_not_move_its_counters() -> None:
    """A rank may name itself anything that fits /proc/<pid>/comm, parentheses, spaces and digits included:
    its host-progress counters are still read from the fields after the kernel's own closing parenthesis."""
    child = subprocess.Popen([sys.executable, "-c",
                              "open('/proc/self/comm', 'w').write(') R 1 2 3 (9'); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
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
