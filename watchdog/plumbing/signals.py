"""Signals that stop (or reload) a process, handed to a threading.Event without the handler taking a lock.

Python runs a signal handler in the main thread between two of its bytecodes, so a handler that calls
`event.set()` can run while that same thread already holds the event's lock: inside the `set()` of the signal
just before (two Ctrl+C, or a SIGTERM and a SIGINT, back to back), or on the way out of its own
`event.wait()`. The lock is not reentrant, and the process never stops. And a signal the kernel hands to
another thread (a second one, while the first is still pending on the main thread) runs its Python handler
only when the main thread next runs bytecode: never, for a main thread asleep in a wait without a timeout.
Here no Python handler does anything: Python's own C handler writes each signal's number to a pipe
(`signal.set_wakeup_fd`), whichever thread the signal reached, and a thread of its own reads the pipe and sets
the events, so every signal reaches its event, however they arrive and however the main thread waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any


class SignalEvents:
    """`with SignalEvents({signal.SIGTERM: stop, signal.SIGINT: stop}):` sets `stop` on either signal; the
    handlers that were there before are put back on the way out, or, with `restore=False` (a process whose work
    ends with the block), the signals are ignored from then on: a stop signal that comes while the process
    closes down and exits (the rest of a burst) is the stop already under way, not a kill by its default action
    (SIG_IGN, not a Python handler: Python puts the default action back under its own handlers as it exits).
    Only in the main thread (Python's rule for `signal.signal`)."""

    def __init__(self, wiring: Mapping[signal.Signals, threading.Event], restore: bool = True) -> None:
        self.wiring = {int(number): event for number, event in wiring.items()}
        self.restore = restore
        self._previous: dict[int, Any] = {}
        self._read, self._write, self._previous_fd = -1, -1, -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalEvents:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd's rule: a full pipe drops a signal, never blocks
        self._thread = threading.Thread(target=self._run, name="signals", daemon=True)
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for number in self.wiring:
            self._previous[number] = signal.signal(number, _written)
        for number in _held & self.wiring.keys():  # came while the process started (hold)
            self.wiring[number].set()
        _held.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous if self.restore else signal.SIG_IGN)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the thread reads the end of the pipe and returns
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(self._read)

    def _run(self) -> None:
        while chunk := os.read(self._read, 256):
            for number in set(chunk):
                event = self.wiring.get(number)
                if event is not None:
                    event.set()


_held: set[int] = set()  # signals caught by hold() and not yet handed on
HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def hold() -> None:
    """From now on, until a SignalEvents takes them: a stop or reload signal is kept, not acted on by its default
    (the process killed; a Ctrl+C a traceback), and the first SignalEvents wired for it sets its event then."""
    for number in HELD:
        signal.signal(number, _hold)


def _hold(number: int, frame: FrameType | None) -> None:
    _held.add(number)


def _written(number: int, frame: FrameType | None) -> None:
    """The Python handler of a wired signal: nothing left to do (the C handler wrote it to the pipe); installed
    so that the signal's default action (ending the process) is not taken."""


def die_with_parent(parent: int | None = None) -> None:
    """In a child process: killed (SIGKILL) when the process that started it dies, even by kill -9 (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). `parent`: its pid, checked after, for a parent that died before."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)
