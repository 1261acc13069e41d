"""Signals back to back stop a process: the handler takes no lock (watchdog/plumbing/signals.py). A handler
that set a threading.Event could run inside that event's own set() or wait() in the main thread and never
return: the demo hung on two Ctrl+C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.fakes.loopback import free_port
from tests.test_run import config_text, wait_for_line
from watchdog.plumbing.signals import SignalEvents
from watchdog.sample import read_ahead

# The main thread sets and waits on the event without pause while a thread sends it signals back to back: a
# handler that calls event.set() lands, sooner or later, where the main thread holds the event's lock.
STORM = textwrap.dedent("""
    import os, signal, sys, threading
    from watchdog.plumbing.signals import SignalEvents
    event = threading.Event()
    def send():
        for n in range(20000):
            os.kill(os.getpid(), signal.SIGUSR1 if n % 2 else signal.SIGUSR2)
    with SignalEvents({signal.SIGUSR1: event, signal.SIGUSR2: event}):
        sender = threading.Thread(target=send)
        sender.start()
        while sender.is_alive():
            event.set()
            event.wait(0.0001)
            event.clear()
        sender.join()
        os.kill(os.getpid(), signal.SIGUSR1)  # one after the last clear(): set from the reading thread
        event.wait(30)
    print("survived", event.is_set())
""")


def test_a_storm_of_signals_never_wedges_the_main_thread() -> None:
    done = subprocess.run([sys.executable, "-c", STORM], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "survived True", done.stderr[-2000:]


def test_each_signal_sets_its_own_event_and_the_old_handlers_come_back() -> None:
    stop, reload = threading.Event(), threading.Event()
    before = signal.getsignal(signal.SIGUSR1)
    with SignalEvents({signal.SIGUSR1: stop, signal.SIGUSR2: reload}):
        os.kill(os.getpid(), signal.SIGUSR2)
        assert reload.wait(30) and not stop.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(30)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert [t for t in threading.enumerate() if t.name == "signals"] == []  # its thread ended with it


def burst(process: subprocess.Popen[str], count: int = 400) -> None:
    for n in range(count):
        try:
            process.send_signal(signal.SIGINT if n % 2 else signal.SIGTERM)
        except ProcessLookupError:
            return


def reader(process: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")),  # type: ignore[union-attr]
                     daemon=True).start()
    return lines


def service(verb: str, tmp_path: Path) -> tuple[list[str], str]:
    """The command line of `run` (a simulated node) or `coordinate` on a free loopback port, and its line of ready."""
    port = free_port()
    if verb == "run":
        config = tmp_path / "config.yaml"
        config.write_text(config_text(tmp_path, port))
        return ["run", "--config", str(config)], "event=started"
    return (["coordinate", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "jobs"),
             "--listen", f"127.0.0.1:{port}"], "event=coordinating")


@pytest.mark.parametrize("verb", ["run", "coordinate"])
def test_the_daemon_and_the_coordinator_stop_on_a_burst_of_sigterm_and_sigint(verb: str, tmp_path: Path) -> None:
    argv, ready = service(verb, tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "watchdog", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    lines = reader(process)
    try:
        wait_for_line(lines, process, ready, timeout=60)
        burst(process)
        assert process.wait(timeout=60) == 0, "\n".join(lines[-20:])
        time.sleep(0.2)  # the reader thread's last lines
        assert not [line for line in lines if "Traceback" in line or "KeyboardInterrupt" in line], lines[-20:]
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_and_sigint_together_stop_the_coordinator_every_time(tmp_path: Path) -> None:
    """The second of two signals back to back goes to another thread while the first is pending on the main one;
    Python runs its handler only when the main thread next runs, so a main thread asleep without a timeout lost
    the stop (a hostile trial: 7 of 10 coordinators kept running)."""
    for trial in range(6):
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "watchdog", "coordinate", "--prometheus",
                                    "http://127.0.0.1:9", "--out", str(tmp_path / f"jobs{trial}"), "--listen",
                                    f"127.0.0.1:{port}"], cwd=REPO, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        lines = reader(process)
        try:
            wait_for_line(lines, process, "event=coordinating", timeout=60)
            os.kill(process.pid, signal.SIGTERM)
            os.kill(process.pid, signal.SIGINT)
            assert process.wait(timeout=60) == 0, (trial, lines[-10:])
        finally:
            if process.poll() is None:
                process.kill()


def test_a_replay_stopped_by_sigterm_leaves_no_reader_behind(tmp_path: Path) -> None:
    """replay reads a trace in a second process where it can: killed, the replay takes it along, even while it
    reads an input that never ends."""
    process = subprocess.Popen([sys.executable, "-m", "watchdog", "replay", "/dev/urandom", "--lenient",
                                "--csv-fields", "timestamp,index,utilization.gpu,power.draw,memory.used"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        children: list[psutil.Process] = []
        while not children and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
            children = psutil.Process(process.pid).children(recursive=True)
        assert children or not read_ahead.available(), "no reader process: read ahead is used on 2 cores or more"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], f"left running: {alive}"
    finally:
        if process.poll() is None:
            process.kill()


# The signals come after the command's first line and before its handlers are in: while it imports and reads its
# configuration (half a second, in which they killed it).
EARLY = textwrap.dedent("""
    import os, signal, sys
    import watchdog.cli
    from watchdog.entry import main
    command = watchdog.cli.main
    def early(args):
        for number in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            os.kill(os.getpid(), number)
        return command(args)
    watchdog.cli.main = early
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("verb", ["run", "coordinate"])
def test_signals_before_the_handlers_are_in_stop_the_service_cleanly(verb: str, tmp_path: Path) -> None:
    argv, _ = service(verb, tmp_path)
    done = subprocess.run([sys.executable, "-c", EARLY, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "event=stopping" in done.stderr
