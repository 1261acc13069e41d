"""The detectors' memory of the recent past, held as arrays: a row per tick, a column per GPU.

Readings are float64, a missing one (an `[N/A]`, a failed read, a GPU absent from a tick) NaN, so that it
fails every comparison as None does. `Frames.add` takes the newest ticks (the daemon's one snapshot, or a
replay's stretch of thousands), puts them on the stream's own clock, learns this GPU's idle and busy power
and its processes' host motion over them (detect/levels.py), and returns a `Stretch`: the rows kept from
before followed by the new ones, over which the detectors judge the ticks that are due.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from watchdog.detect.levels import LEARNT, LEVELS, Levels
from watchdog.detect.stream_clock import StreamClock
from watchdog.detect.stretch import HEALTH_CODES, NUMERIC, Stretch, no_pids
from watchdog.detect.tally import Tally
from watchdog.vocabulary.model import GpuSample, NodeSnapshot, SnapshotBlock

_KEEP_ROWS = 64  # kept whatever their age: a window of -l 5 samples still has enough to judge
_SLOT = {name: slot for slot, name in enumerate(GpuSample._fields)}
_HEALTH = {health: code for code, health in enumerate(HEALTH_CODES)}
_NUMERIC_OF = operator.itemgetter(*(_SLOT[name] for name in NUMERIC))


class Ticks:
    """New ticks as arrays before they join the frames: times (n,), each numeric field (n, gpus), the GPUs
    present, their health and processes, and the errors of failed reads (row, column) -> errors."""

    def __init__(self, times: np.ndarray, gpus: list[int], values: dict[str, np.ndarray], present: np.ndarray,
                 health: np.ndarray, pids: np.ndarray | None, errors: dict[tuple[int, int], tuple]):
        self.times, self.gpus, self.values, self.present = times, gpus, values, present
        self.health, self.pids, self.errors = health, pids, errors

    @classmethod
    def of_snapshots(cls, snapshots: Sequence[NodeSnapshot]) -> Ticks:
        gpus = sorted({sample.index for snapshot in snapshots for sample in snapshot.gpus})
        column = {gpu: n for n, gpu in enumerate(gpus)}
        shape = (len(snapshots), len(gpus))
        rows = [(row, column[sample.index], sample)
                for row, snapshot in enumerate(snapshots) for sample in snapshot.gpus]
        where = (np.fromiter((r for r, _, _ in rows), int, len(rows)),
                 np.fromiter((c for _, c, _ in rows), int, len(rows)))
        # Every numeric field of every sample in one conversion (None becomes NaN).
        readings = np.array([_NUMERIC_OF(sample) for _, _, sample in rows], dtype=float)
        if len(rows) == shape[0] * shape[1] and all(c == n % shape[1] for n, (_, c, _) in enumerate(rows)):
            # Every GPU in every tick, in order (the daemon's usual snapshot): the readings are the arrays.
            columns = readings.T.reshape(len(NUMERIC), *shape)
            values = dict(zip(NUMERIC, columns))
            present = np.ones(shape, bool)
        else:
            values = {}
            for n, name in enumerate(NUMERIC):
                array = np.full(shape, np.nan)
                array[where] = readings[:, n] if len(rows) else ()
                values[name] = array
            present = np.zeros(shape, bool)
            present[where] = True
        health = np.zeros(shape, np.int8)
        pids = None
        errors: dict[tuple[int, int], tuple] = {}
        ok = GpuSample._field_defaults["health"]
        for row, col, sample in rows:
            if sample.health is not ok:
                health[row, col] = _HEALTH[sample.health]
            if sample.pids:
                if pids is None:
                    pids = no_pids(shape)
                pids[row, col] = sample.pids
            if sample.errors:
                errors[row, col] = sample.errors
        times = np.fromiter((s.time_seconds for s in snapshots), float, len(snapshots))
        return cls(times, gpus, values, present, health, pids, errors)

    @classmethod
    def of_block(cls, block: SnapshotBlock) -> Ticks:
        """A reader's column block: its columns reshaped, not its samples built."""
        count, width = len(block), len(block.layout)
        order = sorted(range(width), key=block.layout.__getitem__)
        shape = (count, width)

        def column(name: str, dtype: Any = float) -> np.ndarray | None:
            values = block.columns[_SLOT[name]]
            if values is None:
                return None
            if isinstance(values, np.ndarray):
                array = values
            elif dtype is object:  # tuples (processes, errors) stay one value each
                array = np.fromiter(values, dtype=object, count=len(values))
            else:
                array = np.array(values, dtype=dtype)
            return array.reshape(shape)[:, order]

        values = {}
        for name in NUMERIC:
            array = column(name)
            values[name] = np.full(shape, np.nan) if array is None else array.astype(float, copy=False)
        health = np.zeros(shape, np.int8)
        states = column("health", object)
        if states is not None and any(state is not GpuSample._field_defaults["health"] for state in states.flat):
            health = np.vectorize(_HEALTH.__getitem__, otypes=[np.int8])(states)
        pids = column("pids", object)
        if pids is not None and not any(map(bool, pids.flat)):
            pids = None
        errors = {}
        failed = column("errors", object)
        if failed is not None:
            errors = {(int(r), int(c)): failed[r, c] for r, c in zip(*np.nonzero(np.vectorize(bool)(failed)))}
        times = np.asarray(block.times, dtype=float)
        present = np.ones(shape, bool) if block.present is None else np.array(block.present, bool).reshape(
            shape)[:, order]
        return cls(times, sorted(block.layout), values, present, health, pids, errors)


class Frames:
    """The rows kept (enough for the longest window) and what carries from one stretch to the next: the
    stream clock, the GPU columns, and the learnt levels."""

    def __init__(self, keep_seconds: float, levels: Levels, tally_seconds: float = 0.0):
        self.keep_seconds = keep_seconds
        self.tally_seconds = tally_seconds  # the rows of utilization's totals kept (detect/tally.py): at least as many
        self.tally = Tally.empty()
        self.levels = levels
        self.gpus: list[int] = []
        self.stretch: Stretch | None = None  # the rows kept, as the last add left them
        self.first_row = 0  # the absolute number of the stretch's first row (errors are keyed by it)
        self.clock = StreamClock()  # the stream's own time: the wall clock's steps taken out
        self.pending = 0  # the newest rows whose learnt levels are not worked out yet (catch_up)

    def timeline(self, stamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stream's time for each stamp, kept in order, and the sampling step as of each: the wall
        clock's steps back and jumps forward taken out (detect/stream_clock.py), counted for the caller to say
        once. A loop, not arrays: a tick is one stamp, and a day is milliseconds of them."""
        times, steps = self.clock.read(stamps.tolist())
        return np.array(times, dtype=float), np.array(steps, dtype=float)

    def add(self, ticks: Ticks) -> tuple[Stretch, int]:
        """The stretch of the kept rows and these ticks, and the row the new ticks start at."""
        times, steps = self.timeline(ticks.times)
        self._widen(ticks.gpus)
        position = {gpu: n for n, gpu in enumerate(self.gpus)}
        at = [position[gpu] for gpu in ticks.gpus]
        width, count = len(self.gpus), len(times)

        def spread(array: np.ndarray, fill: Any) -> np.ndarray:
            if at == list(range(width)):
                return array
            wide = no_pids((count, width)) if array.dtype == object else np.full((count, width), fill, array.dtype)
            wide[:, at] = array
            return wide

        values = {name: spread(array, np.nan) for name, array in ticks.values.items()}
        present, health = spread(ticks.present, False), spread(ticks.health, 0)
        pids = None if ticks.pids is None else spread(ticks.pids, ())
        old = self.stretch
        base = 0 if old is None else len(old.times)
        errors = {(self.first_row + base + row, at[col]): e for (row, col), e in ticks.errors.items()}
        learnt = {name: np.full((count, width), np.nan) for name in LEARNT}
        totals = self.levels.totals(values["utilization_ratio"], present, self.first_row + base)
        tally = self.tally.joined(times, totals.pop("util_sum"), totals.pop("util_count"))
        learnt.update(totals)
        new = Stretch(self.gpus, times, values, present, health, pids, learnt, steps, errors, self.first_row + base)
        stretch = new if old is None else old.joined(new)
        self.pending += count
        if self.pending > _KEEP_ROWS:  # before rows not yet learnt from could be trimmed away
            self.catch_up(stretch)
        stretch.learn, stretch.tally = self.catch_up, tally
        self.stretch = self._trimmed(stretch)
        first = _first_kept(tally.times, max(self.tally_seconds, self.keep_seconds))
        self.tally = tally.rows_from(first) if first else tally
        return stretch, base

    def catch_up(self, stretch: Stretch | None = None) -> None:
        """Learn the levels of the rows not learnt yet (the newest `pending`), in place. They are learnt in
        order whenever a rule first asks for them: a day at once, a tick or a few dozen at a time live."""
        stretch = stretch if stretch is not None else self.stretch
        if not self.pending or stretch is None:
            return
        rows = slice(len(stretch) - self.pending, len(stretch))
        learnt = self.levels.learn(stretch.times[rows], {name: array[rows] for name, array in stretch.values.items()})
        for name, array in learnt.items():
            stretch.levels[name][rows] = array
        self.pending = 0

    def _widen(self, gpus: list[int]) -> None:
        added = [gpu for gpu in gpus if gpu not in self.gpus]
        if not added:
            return
        self.gpus = self.gpus + added
        self.levels.widen(len(self.gpus))
        self.tally = self.tally.widened(len(self.gpus))
        if self.stretch is not None:
            self.stretch = self.stretch.widened(self.gpus)

    def _trimmed(self, stretch: Stretch) -> Stretch:
        """The rows a later stretch needs: those of the last keep_seconds, and at least _KEEP_ROWS."""
        first = _first_kept(stretch.times, self.keep_seconds)
        if first == 0:
            return stretch
        self.first_row += first
        return stretch.rows_from(first)


def _first_kept(times: np.ndarray, keep_seconds: float) -> int:
    """The first of these rows a later stretch needs: those of the last keep_seconds, and at least _KEEP_ROWS."""
    first = int(np.searchsorted(times, times[-1] - keep_seconds, "left"))
    return max(0, min(first, len(times) - _KEEP_ROWS))


__all__ = ["Frames", "Ticks", "LEVELS"]
