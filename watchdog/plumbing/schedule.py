"""Ticks on the monotonic clock without drift, shared by the daemon's loop and `record`: each tick is due
one interval after the last one was due; a tick more than an interval behind skips ahead rather than
bunching up."""

from __future__ import annotations

import time
from collections.abc import Callable


class Ticker:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self.monotonic = monotonic
        self._due = monotonic()

    def advance(self, interval: float) -> tuple[float, bool]:
        """Seconds to wait until the next tick is due, and whether the tick just run overran its interval."""
        self._due += interval
        delay = self._due - self.monotonic()
        if delay >= 0:
            return delay, False
        if delay < -interval:
            self._due = self.monotonic()
        return 0.0, True
