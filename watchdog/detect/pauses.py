"""The pauses a job has shown it recovers from (zero_util and waiting episodes that ended by themselves:
checkpoints, evaluations), remembered by length and by rhythm.

A new pause is expected when it starts no sooner after the last one than the job has ever paused again
(the shortest gap it has shown; after its first pause, the time from the start of watching to it) and
lasts no longer than the longest one seen (times a margin). Such a pause is not alerted again. A pause
that comes sooner is alerted at once: a hang can start at any time, while a checkpoint comes every N steps.
"""

from __future__ import annotations

from collections import deque

_KEPT = 16
_MIN_SECONDS = 15.0  # shorter dips tell nothing about the job's checkpoints
_TOLERANCE_SECONDS = 60.0
_TOLERANCE_RATIO = 0.2  # of the period: step times drift, and a watch may start mid-period


class PauseMemory:
    def __init__(self) -> None:
        self.pauses: deque[tuple[float, float]] = deque(maxlen=_KEPT)  # (onset, seconds), oldest first
        self.longest: float | None = None  # the longest pause recorded
        self.period: float | None = None  # the median interval between recorded pauses; None before two
        self.watched_since: float | None = None  # the first tick seen: a first pause's gap counts from it

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
        recovers from: no longer than the longest seen times `margin`, and due by the rhythm: no sooner
        after the last pause than the shortest gap between the job's pauses (less a tolerance). A
        checkpoint every N steps comes a period after the last one; a hang can start any time, most often
        well before the next checkpoint is due, and is alerted at once."""
        longest = self.longest
        if longest is None or elapsed > margin * longest:
            return False
        onsets = [start for start, _ in self.pauses]
        gaps = [b - a for a, b in zip(onsets, onsets[1:]) if b > a]
        if not gaps and self.watched_since is not None:  # one pause so far: its gap from the start of watching
            gaps = [onsets[0] - self.watched_since]
        if not gaps or min(gaps) <= 0:
            return False
        tolerance = max(_TOLERANCE_SECONDS, _TOLERANCE_RATIO * (self.period or gaps[0]))
        return onset - onsets[-1] >= min(gaps) - tolerance
