"""The stream's own time: the stamps of a trace or of the daemon's ticks put in order, with a wall clock's
steps taken out. A judgement weighs time that was observed; a jump of the wall clock is not.

Wall clocks step: DST on a local-time nvidia-smi log (an hour back in autumn, an hour forward in spring), an
NTP step live, a resumed VM, one sample stamped a day off, two nvidia-smi writers on one file (one a few
seconds behind the other). Each stamp is read on one of a few clocks, the one it follows most closely:

- a stamp at most `gap_seconds` past a clock's newest stamp follows it (the nearest such clock, the one
  used last on a tie), and the stream's time moves by what that clock moved;
- a stamp further ahead than that on every clock is a forward jump (a gap): the time between was not
  observed, so the stream moves by one sampling interval, and the jump is counted (`jumps`) to say once;
- a stamp before every clock's newest (beyond the tolerance of a sample's rows printed out of order) starts
  a new clock, counted (`steps`), that continues from the stream's time: one interval on where the step was
  longer than a gap (DST in autumn), at it where it was shorter (as likely a second writer's older sample).

So a step back and a step forward cost at most one interval each; two writers on one file are two clocks,
each read in its own order, and the stream's time never grows faster than the stamps of either; a sample a
day ahead is one gap and one step back, never "idle for 24 h". The gap is `_GAP_SECONDS` or ten sampling
intervals, whichever is longer: the interval is learnt from the stamps, and can grow at most twofold a sample,
so a run of slow samples is a slower cadence, while one jump is a gap.
"""

from __future__ import annotations

from dataclasses import dataclass

_TOLERANCE_SECONDS = 0.5  # nvidia-smi prints a sample's GPUs milliseconds apart, not always in order
_GAP_SECONDS = 120.0  # the least forward jump read as a gap, not as time observed
_GAP_INTERVALS = 10  # ... or this many sampling intervals, when sampling is slower
_CLOCKS = 4  # the clocks remembered at once (the least recently used is forgotten)
_STEP_CAP_SECONDS = 60.0  # the sampling step handed to the rules never exceeds this


@dataclass
class _Clock:
    newest: float  # the newest stamp read on this clock
    offset: float  # stream time = stamp + offset
    used: int  # when it was used last (a count of stamps)


class StreamClock:
    """The stream's time for each stamp, kept in order; counts the clock's steps back and jumps forward."""

    def __init__(self) -> None:
        self.steps = 0  # steps back survived (a new clock)
        self.jumps = 0  # forward jumps read as gaps
        self.last_step_seconds = 0.0  # how far the last step went back
        self.last_jump_seconds = 0.0  # how far the last jump went forward
        self.interval: float | None = None  # the learnt sampling interval (None until two stamps)
        self.now: float | None = None  # the stream's time of the newest stamp
        self._clocks: list[_Clock] = []
        self._count = 0

    def gap_seconds(self) -> float:
        return max(_GAP_SECONDS, _GAP_INTERVALS * (self.interval or 0.0))

    def read(self, stamps: list[float]) -> tuple[list[float], list[float]]:
        """The stream time of each stamp, and the sampling step as of each (at most _STEP_CAP_SECONDS)."""
        times, steps = [], []
        for stamp in stamps:
            times.append(self._read(stamp))
            steps.append(min(self.interval or 1.0, _STEP_CAP_SECONDS))
        return times, steps

    def _read(self, stamp: float) -> float:
        self._count += 1
        now = self.now
        if now is None:
            self._clocks.append(_Clock(stamp, 0.0, self._count))
            self.now = stamp
            return stamp
        # The first move sets the cadence: however long, it is the sampling interval, not a jump.
        gap, last = self.gap_seconds() if self.interval is not None else float("inf"), self._clocks[-1]
        fits = [c for c in self._clocks if c.newest - _TOLERANCE_SECONDS <= stamp <= c.newest + gap]
        step = self.interval or 1.0
        if fits:
            clock = fits[0] if len(fits) == 1 else min(fits, key=lambda c: (max(stamp - c.newest, 0.0), -c.used))
            if stamp > clock.newest:  # a move along one clock: the sampling interval of whoever writes it
                self._learn(stamp - clock.newest)
        elif stamp > last.newest:  # ahead of every clock by more than a gap: not time observed
            clock = last
            self.jumps += 1
            self.last_jump_seconds = stamp - clock.newest - step  # the stamp was due an interval after the newest
            clock.offset -= stamp - clock.newest - step
        else:  # behind every clock: a new one, continuing from the stream's time
            self.steps += 1
            back = last.newest - stamp
            self.last_step_seconds = back + step  # how far the clock was set back (DST: an hour, not an hour less)
            # A clock set back by more than a gap (DST in autumn) goes on an interval later; a few seconds back is
            # as likely a second writer's sample, taken before the newest: it joins the stream where it is.
            later = step if back > gap else 0.0
            clock = _Clock(stamp, now + later - stamp, self._count)
            self._clocks.append(clock)
            del self._clocks[:-_CLOCKS]
        clock.newest, clock.used = max(clock.newest, stamp), self._count
        if clock is not self._clocks[-1]:
            self._clocks.remove(clock)
            self._clocks.append(clock)  # the list in order of use: the last is the one used last
        self.now = max(now, stamp + clock.offset)
        return self.now

    def _learn(self, moved: float) -> None:
        """The sampling interval from a move along one clock: it may shrink at once and grow at most twofold."""
        if moved <= _TOLERANCE_SECONDS and self.interval is not None:
            return  # a sample's rows printed apart, or a duplicate: not the cadence
        self.interval = moved if self.interval is None else min(moved, 2 * self.interval)
