"""What a process the daemon starts (py-spy, a command receiver, ncclras, scontrol) inherits from it, and
the one way a short command is run.

The daemon's environment holds secrets (a receiver's `url_env` or `token_env`, the endpoint's
`basic_auth_password_env`): a child gets a PATH, a locale and a time zone, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO

MAX_OUTPUT_BYTES = 64 * 1024  # a short command's standard output kept (scontrol's answers are a few hundred bytes)
MAX_ERROR_BYTES = 64 * 1024


class CommandError(Exception):
    """A command that could not start, did not finish in time (`timed_out`), or failed: the message says which."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out

KEPT = ("PATH", "LANG", "LC_ALL", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEPT}
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def read_bounded(process: subprocess.Popen[bytes], timeout: float, max_out: int, max_err: int,
                 stop_on_long_output: bool = True, out: IO[bytes] | None = None) -> tuple[bytes, bytes, str | None]:
    """A child's stdout and stderr, read as they come until both close: (stdout, stderr, None), or with
    "timeout" when it ran past `timeout`, or "too_long" when its stdout passed `max_out` and
    `stop_on_long_output` (the caller kills it then). Past its cap a stream is read and dropped, so the
    child never blocks on a full pipe and the daemon keeps at most the caps. `out`: another pipe the child
    writes its output to, read in place of stdout (py-spy record writes its data to a path and talks on
    stdout)."""
    deadline = time.monotonic() + timeout
    data = out if out is not None else process.stdout
    caps: dict[object, int] = {data: max_out, process.stderr: max_err}
    got: dict[object, list[bytes]] = {data: [], process.stderr: []}
    sizes: dict[object, int] = dict.fromkeys(got, 0)
    with selectors.DefaultSelector() as selector:
        for pipe in (data, process.stderr):
            if pipe is not None:
                selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(got[data]), b"".join(got[process.stderr]), "timeout"
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                room = caps[key.fileobj] - sizes[key.fileobj]
                sizes[key.fileobj] += len(chunk)
                if sizes[key.fileobj] > caps[key.fileobj]:
                    if key.fileobj is data and stop_on_long_output:
                        return b"", b"".join(got[process.stderr]), "too_long"
                    chunk = chunk[:max(0, room)]  # the first of it is kept: it says what went wrong
                got[key.fileobj].append(chunk)
    try:
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"".join(got[data]), b"".join(got[process.stderr]), "timeout"
    for pipe in (data, process.stderr):
        if pipe is not None:
            pipe.close()
    return b"".join(got[data]), b"".join(got[process.stderr]), None


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child started in a session of its own, and whatever it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def run(argv: Sequence[str], stdin: str = "", timeout: float = 10.0, env: dict[str, str] | None = None,
        max_output: int = MAX_OUTPUT_BYTES) -> str:
    """Run argv (no shell) in a session of its own with `stdin`, and return its standard output (the first
    `max_output` bytes; the rest is read and dropped). `env` adds to environment(). A timeout kills the command
    and every child it started; a non-zero exit is a CommandError that carries the last line of its standard
    error."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True,
                                   env={**environment(), **(env or {})})
    except OSError as exc:
        raise CommandError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    # Written from a thread: a command that never reads its input must not hold the caller past `timeout`.
    threading.Thread(target=_feed, args=(process, stdin.encode()), daemon=True).start()
    out, err, over = read_bounded(process, timeout, max_output, MAX_ERROR_BYTES, stop_on_long_output=False)
    if over is not None:
        kill_group(process)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=2)
        raise CommandError(f"{argv[0]} did not finish within {timeout:g} s", timed_out=True)
    if process.returncode != 0:
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise CommandError(f"{argv[0]} exited with status {process.returncode}"
                           + (f": {last[0][:200]}" if last[0] else ""))
    return out.decode("utf-8", "replace")


def _feed(process: subprocess.Popen[bytes], data: bytes) -> None:
    assert process.stdin is not None
    with contextlib.suppress(OSError):  # the command exited or closed its input: it did not want it
        process.stdin.write(data)
    with contextlib.suppress(OSError):
        process.stdin.close()
