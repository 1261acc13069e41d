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

import pytest

from tests.conftest import REPO
from tests.fakes.loopback import free_port
from tests.test_run import config_text, wait_for_line
from watchdog.plumbing.signals import SignalEvents

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


@pytest.mark.parametrize("verb", ["run", "coordinate"])
def test_the_daemon_and_the_coordinator_stop_on_a_burst_of_sigterm_and_sigint(verb: str, tmp_path: Path) -> None:
    port = free_port()
    if verb == "run":
        config = tmp_path / "config.yaml"
        config.write_text(config_text(tmp_path, port))
        argv, ready = ["run", "--config", str(config)], "event=started"
    else:
        argv = ["coordinate", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "jobs"),
                "--listen", f"127.0.0.1:{port}"]
        ready = "event=coordinating"
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
