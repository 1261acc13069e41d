"""Signalling a process through a pidfd opened for it and checked to be the process meant: a pid reused by
another process in between is never signalled (a pidfd refers to one process for its whole life).

Linux 5.3 and later (pidfd_open, pidfd_send_signal); a pidfd is readable once its process has exited.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable

import psutil

_POLL_SECONDS = 0.2


class SignalRefused(Exception):
    """The process could not be signalled (not permitted, or another error); the message says which and why."""


def open_checked(pid: int, create_time: float) -> int | None:
    """A pidfd for the process `pid` names, if it is still the one that started at `create_time`; None when it
    is gone or the pid now names another process. Opened first, checked after: the pidfd then refers to the
    process that was checked, whatever happens to the pid later."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        if abs(psutil.Process(pid).create_time() - create_time) > 0.01:
            os.close(fd)
            return None  # the pid names another process now
    except psutil.Error:
        os.close(fd)
        return None
    return fd


def send(pid: int, fd: int, signum: signal.Signals) -> None:
    try:
        signal.pidfd_send_signal(fd, signum)
    except ProcessLookupError:
        pass  # exited meanwhile
    except PermissionError:
        raise SignalRefused(f"cannot signal pid {pid}: operation not permitted (the daemon needs CAP_KILL to signal "
                          "another user's ranks: deploy/systemd/actions.conf, or the DaemonSet's actions "
                          "overlay)") from None
    except OSError as exc:
        raise SignalRefused(f"cannot signal pid {pid}: {exc.strerror or exc}") from None


def wait_gone(victims: list[tuple[int, int]], seconds: float,
               stop: Callable[[], str | None]) -> list[tuple[int, int]]:
    """The victims still running after `seconds` (or as soon as `stop()` says why): a pidfd is readable once
    its process has exited, a zombie included."""
    deadline = time.monotonic() + seconds
    alive = list(victims)
    while alive:
        poller = select.poll()
        for _, fd in alive:
            poller.register(fd, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            ready = {fd for fd, _ in poller.poll(min(left, _POLL_SECONDS) * 1000)}
        except InterruptedError:
            ready = set()
        alive = [(pid, fd) for pid, fd in alive if fd not in ready]
        if alive and stop() is not None:
            break
    return alive
