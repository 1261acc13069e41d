"""Real py-spy against real processes: a capture, and every way one fails."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import python_target
from watchdog.stacks.capture import (
    GONE,
    NO_PY_SPY,
    NOT_PYTHON,
    OK,
    PERMISSION,
    TIMEOUT,
    StackCapturer,
    Target,
    find_py_spy,
)


def test_py_spy_is_installed_with_the_package() -> None:
    assert find_py_spy() is not None


def test_capture_reads_the_stack_without_pausing(tmp_path: Path) -> None:
    with python_target("queue", tmp_path) as process:
        (capture,) = StackCapturer().capture([Target(process.pid, rank=5, gpus=(5,))])
    assert capture.result == OK and not capture.blocking
    dump = capture.dump
    assert dump is not None and (dump.member, dump.pid, dump.gpus) == ("rank 5", process.pid, (5,))
    names = [f.function for f in dump.main_thread.frames]  # type: ignore[union-attr]
    assert "Queue.get" in names and "BatchLoader.__next__" in names and names[-1] == "<module>"
    assert capture.raw and capture.raw[0]["pid"] == process.pid


def test_captures_run_in_parallel(tmp_path: Path) -> None:
    """Each py-spy starts its capture only once all three have started (a wrapper waits for the others, and gives
    up after a minute): captures run one after another would never get there."""
    started = tmp_path / "started"
    started.mkdir()
    wrapper = tmp_path / "py-spy"
    wrapper.write_text(f"#!/bin/sh\ntouch {started}/$$\nfor i in $(seq 600); do\n"
                       f"  [ $(ls {started} | wc -l) -ge 3 ] && exec {find_py_spy()} \"$@\"\n  sleep 0.1\ndone\n"
                       "echo 'the other captures never started' >&2; exit 1\n")
    wrapper.chmod(0o755)
    with python_target("queue", tmp_path) as a, python_target("queue", tmp_path) as b, \
            python_target("queue", tmp_path) as c:
        captures = StackCapturer([str(wrapper)], timeout_seconds=120).capture([Target(p.pid) for p in (a, b, c)])
    assert [x.result for x in captures] == [OK, OK, OK], [x.message for x in captures]


def test_gone_process() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    (capture,) = StackCapturer().capture([Target(process.pid)])
    assert capture.result == GONE and "exited" in capture.message


def test_not_python() -> None:
    process = subprocess.Popen(["sleep", "30"])
    try:
        (capture,) = StackCapturer().capture([Target(process.pid)])
    finally:
        process.kill()
        process.wait()
    assert capture.result == NOT_PYTHON and "not a Python process" in capture.message


def test_permission_denied_says_cap_sys_ptrace(tmp_path: Path) -> None:
    py_spy = find_py_spy()
    assert py_spy is not None
    if os.geteuid() == 0:
        # py-spy run as nobody cannot read a root-owned process: a real permission failure.
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py_spy]
        with python_target("queue", tmp_path) as process:
            (capture,) = StackCapturer(command).capture([Target(process.pid)])
    else:
        (capture,) = StackCapturer([py_spy]).capture([Target(1)])  # init, owned by root
    assert capture.result == PERMISSION and "CAP_SYS_PTRACE" in capture.message


def test_a_hung_py_spy_is_killed_at_the_timeout(tmp_path: Path) -> None:
    # A py-spy stuck forever, with a child of its own. The child is a script of this test's, so that the
    # search below finds it and nothing else of the machine's (a `sleep 300` of someone else's once
    # failed this test).
    child = tmp_path / "hung-py-spy-child"
    child.write_text("#!/bin/sh\nsleep 300\n")
    hung = tmp_path / "py-spy"
    hung.write_text(f"#!/bin/sh\n{shlex.quote(str(child))} &\nwait\n")
    for script in (child, hung):
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (capture,) = StackCapturer([str(hung)], timeout_seconds=0.5).capture([Target(os.getpid())])
    assert capture.result == TIMEOUT  # killed at its deadline: the result says so
    # SIGKILL is sent at the timeout; on a loaded machine the killed child may take a moment to be scheduled
    # and die: it must be gone within seconds.
    deadline = time.monotonic() + 60
    while True:
        leftovers = [p for p in psutil.process_iter(["cmdline", "status"]) if str(child) in (p.info["cmdline"] or ())
                     and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert leftovers == [], ("the hung py-spy's process group was not killed: "
                             + "; ".join(_described(p) for p in leftovers))


def test_missing_py_spy_is_reported() -> None:
    (capture,) = StackCapturer(["/nonexistent/py-spy"]).capture([Target(os.getpid())])
    assert capture.result == NO_PY_SPY


def test_native_frames_need_a_blocking_read(tmp_path: Path) -> None:
    with python_target("queue", tmp_path) as process:
        (capture,) = StackCapturer(native=True).capture([Target(process.pid)])
    if capture.result == OK:
        assert capture.blocking
    else:  # some kernels forbid the unwinder; the failure must still be classified, never a crash
        assert capture.result in (PERMISSION, "failed") and capture.message


def test_a_rank_dying_during_capture_is_classified(tmp_path: Path) -> None:
    with python_target("queue", tmp_path) as process:
        capturer = StackCapturer()
        process.kill()
        process.wait()
        (capture,) = capturer.capture([Target(process.pid)])
    assert capture.result == GONE


def _described(process: psutil.Process) -> str:
    """What a leftover is, for the failure message: whose child, in which process group and session."""
    try:
        return (f"pid {process.pid} status {process.status()} ppid {process.ppid()} pgid {os.getpgid(process.pid)} "
                f"sid {os.getsid(process.pid)} (this test: pgid {os.getpgid(0)})")
    except (psutil.Error, OSError) as exc:
        return f"pid {process.pid} ({exc})"
