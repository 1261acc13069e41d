"""What a process the daemon starts (py-spy, a command receiver, ncclras, scontrol) inherits from it, and
the one way a short command is run.

The daemon's environment holds secrets (a receiver's `url_env` or `token_env`, the endpoint's
`basic_auth_password_env`): a child gets a PATH, a locale and a time zone, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

MAX_OUTPUT_BYTES = 64 * 1024


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


def run(argv: Sequence[str], stdin: str = "", timeout: float = 10.0, env: dict[str, str] | None = None) -> str:
    """Run argv (no shell) in a session of its own with `stdin`, and return its standard output (the first
    64 KiB). `env` adds to environment(). A timeout kills the command and every child it started; a non-zero
    exit is a CommandError that carries the last line of its standard error."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                   env={**environment(), **(env or {})})
    except OSError as exc:
        raise CommandError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    try:
        out, err = process.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise CommandError(f"{argv[0]} did not finish within {timeout:g} s", timed_out=True) from None
    if process.returncode != 0:
        last = (err or "").strip().splitlines()[-1:] or [""]
        raise CommandError(f"{argv[0]} exited with status {process.returncode}"
                           + (f": {last[0][:200]}" if last[0] else ""))
    return out[:MAX_OUTPUT_BYTES]
