"""Capture the ranks' Python stacks with py-spy, in parallel, each bounded by a timeout.

`py-spy dump --json --nonblocking` reads the target's memory without pausing it; if that read fails
(the stack changed under it) one blocking attempt follows, which pauses the rank for milliseconds.
`--native` (C/C++ frames, e.g. inside NCCL) needs a blocking read. `--locals` is never used: locals
hold tokens and data. Failures are classified so that the message says what to do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from watchdog.boundary import children, untrusted_data
from watchdog.config import StacksConfig
from watchdog.stacks.formats import parse_pyspy_json, trim_pyspy_json
from watchdog.vocabulary.stack_model import StackDump

OK, PERMISSION, GONE, NOT_PYTHON, TIMEOUT, FAILED, NO_PY_SPY = (
    "ok", "permission", "gone", "not_python", "timeout", "failed", "no_py_spy")

_ADVICE = {
    PERMISSION: "py-spy may not read this process: run the watchdog as root or grant it CAP_SYS_PTRACE "
                "(systemd: AmbientCapabilities=CAP_SYS_PTRACE; containers: --cap-add SYS_PTRACE)",
    GONE: "the process exited before its stack was read",
    NOT_PYTHON: "not a Python process (py-spy found no interpreter in it)",
    NO_PY_SPY: "py-spy is not installed next to stall-watchdog nor on PATH",
}


@dataclass(frozen=True)
class Target:
    pid: int
    rank: int | None = None
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Capture:
    target: Target
    result: str  # one of OK, PERMISSION, GONE, NOT_PYTHON, TIMEOUT, FAILED, NO_PY_SPY
    message: str
    seconds: float
    blocking: bool  # a blocking read was used (the rank was paused briefly)
    dump: StackDump | None = None
    raw: list[dict[str, object]] | None = None  # py-spy's JSON, as written to an incident bundle

    def to_json(self) -> dict[str, object]:
        return {"pid": self.target.pid, "rank": self.target.rank, "gpus": list(self.target.gpus),
                "result": self.result, "message": self.message, "seconds": round(self.seconds, 3),
                "blocking": self.blocking}


def find_py_spy() -> str | None:
    """The py-spy installed with this package (the same venv) first, then PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def classify_failure(stderr: str) -> str:
    text = stderr.lower()
    if "permission denied" in text or "operation not permitted" in text:
        return PERMISSION
    if "no such process" in text or "check that the process is running" in text or "failed to find process" in text:
        return GONE
    if "failed to find python version" in text or "not a python process" in text or "python interpreter" in text:
        return NOT_PYTHON
    return FAILED


def _first_line(stderr: str) -> str:
    for line in stderr.splitlines():
        line = line.strip()
        if line and not line.startswith(("Stack backtrace", "Caused by")):
            return line.removeprefix("Error: ")
    return "py-spy failed without a message"


class StackCapturer:
    """`command` is how to start py-spy (a prefix may run it as another user); `timeout_seconds` bounds
    each capture, after which py-spy's whole process group is killed."""

    def __init__(self, command: Sequence[str] | None = None, timeout_seconds: float = 5.0, native: bool = False,
                 max_parallel: int = 16, nonblocking: bool = True):
        if command is None:
            found = find_py_spy()
            command = [found] if found else []
        self.command = list(command)
        self.timeout = timeout_seconds
        self.native = native
        self.max_parallel = max_parallel
        self.nonblocking = nonblocking and not native  # --native needs a blocking read
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._aborted = False

    @classmethod
    def from_config(cls, cfg: StacksConfig) -> StackCapturer:
        """The capturer a configuration asks for (ValueError: a stacks.py_spy_command whose program is not there)."""
        command = cfg.py_spy_command
        if command and shutil.which(command[0]) is None:
            raise ValueError(f"stacks.py_spy_command: {command[0]!r} is not a program that can be run (not found, "
                             "or not executable); null uses the py-spy installed with stall-watchdog")
        return cls(command, cfg.timeout_seconds, cfg.native, cfg.max_parallel)

    def reconfigure(self, cfg: StacksConfig) -> None:
        """A reload: later captures use `cfg` (running ones finish as they started)."""
        fresh = StackCapturer.from_config(cfg)
        self.command, self.timeout, self.native = fresh.command, fresh.timeout, fresh.native
        self.max_parallel, self.nonblocking = fresh.max_parallel, fresh.nonblocking

    def abort(self) -> None:
        """Shutting down: kill every py-spy still running (a capture hung on a wedged process would otherwise
        hold the stop up to its timeout) and start no more."""
        with self._lock:
            self._aborted = True
            running = list(self._running)
        for process in running:
            children.kill_group(process)
            # The capturing thread reads this process's pipes until they close: here only wait for the
            # death (a second reader would race it for the pipes).
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)

    def capture(self, targets: Iterable[Target]) -> list[Capture]:
        targets = list(targets)
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(targets)),
                                thread_name_prefix="py-spy") as pool:
            return list(pool.map(self.capture_one, targets))

    def capture_one(self, target: Target) -> Capture:
        started = time.monotonic()
        if not self.command:
            return Capture(target, NO_PY_SPY, _ADVICE[NO_PY_SPY], 0.0, False)
        attempts = [False, True] if self.nonblocking else [True]  # nonblocking first, then one blocking try
        result = Capture(target, FAILED, "not attempted", 0.0, False)
        for blocking in attempts:
            result = self._run(target, blocking, started)
            if result.result in (OK, PERMISSION, GONE, NOT_PYTHON, TIMEOUT):
                return result
        return result

    def _run(self, target: Target, blocking: bool, started: float) -> Capture:
        args = [*self.command, "dump", "--pid", str(target.pid), "--json"]
        if not blocking:
            args.append("--nonblocking")
        if self.native:
            args.append("--native")
        with self._lock:
            if self._aborted:
                return Capture(target, TIMEOUT, "stopping: not captured", 0.0, blocking)
            try:
                process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           start_new_session=True, env=children.environment())
            except OSError as exc:
                return Capture(target, NO_PY_SPY, f"cannot start py-spy: {exc}", time.monotonic() - started,
                               blocking)
            self._running.add(process)
        remaining = max(0.1, self.timeout - (time.monotonic() - started))
        try:
            out, err, over = children.read_bounded(process, remaining, MAX_OUTPUT_BYTES, MAX_ERROR_BYTES)
        finally:
            with self._lock:
                self._running.discard(process)
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if over is not None:
            children.kill_group(process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
            if over == "timeout":
                return Capture(target, TIMEOUT, f"py-spy did not finish within {self.timeout:g} s; killed",
                               time.monotonic() - started, blocking)
            return Capture(target, FAILED, f"py-spy printed over {MAX_OUTPUT_BYTES // 2**20} MiB of stacks; "
                           "killed and not kept", time.monotonic() - started, blocking)
        if self._aborted:
            return Capture(target, TIMEOUT, "stopping: capture killed", time.monotonic() - started, blocking)
        seconds = time.monotonic() - started
        if process.returncode != 0:
            kind = classify_failure(stderr)
            detail = _first_line(stderr)
            message = f"{_ADVICE[kind]} ({detail})" if kind in _ADVICE else detail
            return Capture(target, kind, message, seconds, blocking)
        try:
            raw = trim_pyspy_json(untrusted_data.loads_json(stdout, "py-spy's output"))
            dumps = parse_pyspy_json(raw, "py-spy", target.rank, target.gpus)
        except untrusted_data.TooMuchData as exc:  # what py-spy prints is the rank's to choose (its names)
            return Capture(target, FAILED, str(exc), seconds, blocking)
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            return Capture(target, FAILED, f"py-spy printed something that is not its JSON ({exc})", seconds,
                           blocking)
        dump = next((d for d in dumps if d.pid == target.pid), dumps[0] if dumps else None)
        if dump is None:
            return Capture(target, FAILED, "py-spy returned no threads", seconds, blocking)
        return Capture(target, OK, "ok", seconds, blocking, dump, raw)


    def record(self, pid: int, rate_hz: float, seconds: float) -> tuple[str, str, bytes]:
        """`py-spy record --nonblocking --idle --threads --nolineno --format raw` of one process for `seconds` at
        `rate_hz` (the process is never paused): (result, message, its collapsed stacks, at most MAX_RECORD_BYTES). The
        data comes through a pipe of its own (py-spy talks on stdout); the record is killed past half as long
        again plus this capturer's timeout (a loaded node starts many at once)."""
        if not self.command:
            return NO_PY_SPY, _ADVICE[NO_PY_SPY], b""
        limit = 1.5 * seconds + self.timeout
        read_end, write_end = os.pipe()
        with os.fdopen(read_end, "rb") as data:
            args = [*self.command, "record", "--pid", str(pid), "--rate", f"{rate_hz:g}", "--duration",
                    str(max(1, round(seconds))), "--nonblocking", "--idle", "--threads", "--nolineno",
                    "--format", "raw", "--output", f"/dev/fd/{write_end}"]
            try:
                with self._lock:
                    if self._aborted:
                        return TIMEOUT, "stopping: not sampled", b""
                    try:
                        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                   start_new_session=True, env=children.environment(),
                                                   pass_fds=(write_end,))
                    except OSError as exc:
                        return NO_PY_SPY, f"cannot start py-spy: {exc}", b""
                    self._running.add(process)
            finally:
                os.close(write_end)  # py-spy holds its own copy: the pipe closes when py-spy is done
            try:
                out, err, over = children.read_bounded(process, limit, MAX_RECORD_BYTES, MAX_ERROR_BYTES, out=data)
            finally:
                with self._lock:
                    self._running.discard(process)
        if over is not None:
            children.kill_group(process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
            if over == "timeout":
                return TIMEOUT, f"py-spy record did not finish within {limit:g} s; killed", b""
            return FAILED, f"py-spy record wrote over {MAX_RECORD_BYTES // 2**20} MiB of stacks; killed", b""
        if self._aborted:
            return TIMEOUT, "stopping: record killed", b""
        if process.returncode != 0:
            stderr = err.decode("utf-8", "replace")
            kind = classify_failure(stderr)
            detail = _first_line(stderr)
            return kind, f"{_ADVICE[kind]} ({detail})" if kind in _ADVICE else detail, b""
        return OK, "ok", out


MAX_OUTPUT_BYTES = 16 * 2**20  # py-spy's JSON for hundreds of threads is a few MiB at most
MAX_RECORD_BYTES = 2**20  # one line per distinct stack of a record: a few KiB for a training loop
MAX_ERROR_BYTES = 64 * 1024


