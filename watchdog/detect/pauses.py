"""The pauses a job has shown it recovers from (zero_util and waiting episodes that ended by themselves:
checkpoints, evaluations), remembered by length and by rhythm.

A new pause is expected when it starts where the job's rhythm says the next one is due and lasts no longer
than the longest one seen (times a margin). Such a pause is not alerted again. A pause at an unexpected
time is alerted at once: a hang can start at any time, while a checkpoint comes every N steps.
"""

from __future__ import annotations

from collections import deque

_KEPT = 16
_MIN_SECONDS = 15.0  # shorter dips tell nothing about the job's checkpoints
_TOLERANCE_SECONDS = 60.0
_TOLERANCE_RATIO = 0.1  # of the period: step times drift
_MAX_MISSED = 2  # a pause may come a few periods after the last one seen (one was too short to record)


class PauseMemory:
    def __init__(self) -> None:
        self.pauses: deque[tuple[float, float]] = deque(maxlen=_KEPT)  # (onset, seconds), oldest first
        self.longest: float | None = None  # the longest pause recorded
        self.period: float | None = None  # the median interval between recorded pauses; None before two

    def record(self, onset: float, seconds: float) -> None:
        if seconds < _MIN_SECONDS:
            return
        self.pauses.append((onset, seconds))
        self.longest = max(seconds for _, seconds in self.pauses)
        onsets = [onset for onset, _ in self.pauses]
        gaps = sorted(b - a for a, b in zip(onsets, onsets[1:]) if b > a)
        self.period = gaps[len(gaps) // 2] if gaps else None

    def expected(self, onset: float, elapsed: float, margin: float) -> bool:
        """Whether a pause that began at `onset` and has lasted `elapsed` is one the job has shown it
        recovers from: due by the rhythm, and no longer than the longest seen times `margin`."""
        longest, period = self.longest, self.period
        if longest is None or period is None or elapsed > margin * longest:
            return False
        since = onset - self.pauses[-1][0]
        beats = min(_MAX_MISSED, max(1, round(since / period)))
        tolerance = max(_TOLERANCE_SECONDS, _TOLERANCE_RATIO * period * beats)
        return abs(since - beats * period) <= tolerance
