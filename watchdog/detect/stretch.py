"""A stretch of ticks x GPUs as the detectors see it, and the windows they judge over.

A detector is a function of a stretch and of the cells it is asked about: a cell is one GPU on one tick
that is due for judgement, seen as its newest sample up to that tick (a GPU missing from the tick is seen
as it last was). `Cells.window` gives each cell's trailing window of samples as a matrix (cells x samples,
oldest first, NaN past the window's own length), so that a rule is stated once over all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from watchdog.detect.row_buffers import appended
from watchdog.detect.tally import Tally
from watchdog.vocabulary.model import NUMERIC_FIELDS, GpuHealth, GpuSample

NUMERIC = NUMERIC_FIELDS
HEALTH_CODES = (GpuHealth.OK, GpuHealth.LOST, GpuHealth.HUNG)
_KEPT_SAMPLES = 10  # a window keeps this many samples whatever their age: -l 5 samples still have enough
MIN_WINDOW_SAMPLES = 3  # a window's median or percentile needs this many samples: one or two are a blip
BUSY_PERCENTILE = 0.9  # a reading "seen busy" in a window: its 90th percentile, so that a few blips do not count
_EDGE_SAMPLES = 5  # ... and never its top sample once it holds this many (seen_busy)


def no_pids(shape: tuple[int, ...]) -> np.ndarray:
    """An array of processes with none on any GPU (np.full cannot fill with an empty tuple)."""
    array = np.empty(shape, dtype=object)
    array.fill(())
    return array


@dataclass(frozen=True)
class Context:
    """What every rule may know besides its own section: the window the engine keeps of each GPU's samples,
    and the memory a job's GPU holds at least (config job.memory_min_bytes)."""

    short_seconds: float
    memory_min_bytes: int


class Stretch:
    """Rows of ticks (times on the stream's clock, in order), a column per GPU (`gpus`): every numeric
    reading, which GPUs the tick had, their health, processes and read errors, and the learnt levels
    (detect/levels.py) as of each row."""

    def __init__(self, gpus: list[int], times: np.ndarray, values: dict[str, np.ndarray], present: np.ndarray,
                 health: np.ndarray, pids: np.ndarray | None, levels: dict[str, np.ndarray], steps: np.ndarray,
                 errors: dict[tuple[int, int], tuple], first_row: int, gap_row: int | None = None):
        self.gpus, self.times, self.values, self.present = gpus, times, values, present
        self.health, self.pids, self.levels, self.steps = health, pids, levels, steps
        self.errors, self.first_row = errors, first_row
        if gap_row is None:
            gaps = np.flatnonzero(~present.all(axis=1))
            gap_row = first_row + int(gaps[-1]) if len(gaps) else -1
        self.gap_row = gap_row  # the newest row (numbered from the first ever) lacking some GPU; -1: none
        self._order: tuple[np.ndarray, np.ndarray] | None = None
        self._store: list[np.ndarray | None] | None = None  # the buffers the rows are views of (joined)
        self._lo = 0
        self.learn: Callable[[], None] | None = None  # works out the learnt levels not yet known (Frames)
        self.tally: Tally | None = None  # utilization's totals over underuse's longer window (Frames.add)

    def __len__(self) -> int:
        return len(self.times)

    def _parts(self) -> list[Any]:
        return [self.times, *self.values.values(), self.present, self.health, self.pids, *self.levels.values(),
                self.steps]

    def _build(self, parts: list[Any], errors: dict, first_row: int, gap_row: int) -> Stretch:
        names, levels = list(self.values), list(self.levels)
        times, rest = parts[0], parts[1:]
        values = dict(zip(names, rest[:len(names)]))
        present, health, pids = rest[len(names):len(names) + 3]
        learnt = dict(zip(levels, rest[len(names) + 3:len(names) + 3 + len(levels)]))
        return Stretch(self.gpus, times, values, present, health, pids, learnt, rest[-1], errors, first_row, gap_row)

    def joined(self, later: Stretch) -> Stretch:
        """These rows followed by `later`'s. The rows live in buffers with room to spare, so that a tick
        appended costs its own rows, not a copy of every row kept."""
        if self.pids is not None or later.pids is not None:
            self.pids, later.pids = (p if p is not None else no_pids(s.present.shape)
                                     for p, s in ((self.pids, self), (later.pids, later)))
        store, lo, parts = appended(self._store, self._lo, self._parts(), later._parts())
        joined = self._build(parts, {**self.errors, **later.errors}, self.first_row, max(self.gap_row, later.gap_row))
        joined._store, joined._lo = store, lo
        return joined

    def rows_from(self, first: int) -> Stretch:
        errors = {key: e for key, e in self.errors.items() if key[0] >= self.first_row + first}
        rest = self._build([None if a is None else a[first:] for a in self._parts()], errors, self.first_row + first,
                           self.gap_row)
        rest._store, rest._lo = self._store, self._lo + first
        return rest

    def widened(self, gpus: list[int]) -> Stretch:
        width = len(gpus)
        def wide(a: np.ndarray | None, fill: Any = None) -> np.ndarray | None:
            if a is None or a.ndim == 1:
                return a
            shape = (a.shape[0], width - a.shape[1])
            if fill is None:  # what a GPU not yet seen reads: nothing, none present, no samples counted
                fill = np.nan if a.dtype.kind == "f" else 0
            extra = no_pids(shape) if a.dtype == object else np.full(shape, fill, dtype=a.dtype)
            return np.hstack([a, extra])
        gap = self.first_row + len(self) - 1 if width > len(self.gpus) and len(self) else self.gap_row
        parts = [wide(a) for a in self._parts()[:-len(self.levels) - 1]]
        parts += [wide(a, -1 if name == "newest" else None) for name, a in self.levels.items()]  # newest: no row yet
        stretch = self._build([*parts, self.steps], self.errors, self.first_row, gap)
        stretch.gpus = gpus
        return stretch

    def level(self, name: str) -> np.ndarray:
        """A learnt level (detect/levels.py), rows x GPUs, worked out up to the newest row first."""
        if self.learn is not None:
            self.learn()
        return self.levels[name]

    def counts(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Each cell's count of samples from the stretch's first row up to its row."""
        samples = self.levels["samples"]
        return samples[rows, cols] - (samples[0, cols] - self.present[0, cols])

    def sample_rows(self, cols: np.ndarray, k: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        """The row of each column's k-th sample from the stretch's first row (-1 where not `inside`). Where
        every GPU is in every row (the daemon's usual stretch), the k-th sample is row k."""
        if self.gap_row < self.first_row:
            return k if inside is None else np.where(inside, k, -1)
        if self._order is None:  # each GPU's rows in order, all GPUs one after the other, and where each begins
            _, rows = np.nonzero(self.present.T)
            counts = self.present.sum(axis=0)
            self._order = rows, np.concatenate([[0], np.cumsum(counts)[:-1]])
        rows, starts = self._order
        position = np.clip(starts[cols] + k, 0, max(len(rows) - 1, 0))
        if inside is None:
            return rows[position]
        return np.where(inside, rows[np.where(inside, position, 0)], -1)

    def newest(self, rows: np.ndarray) -> np.ndarray:
        """For each of these rows, each GPU's newest sample up to it (its row; -1: none yet)."""
        newest = self.levels["newest"][rows] - self.first_row
        return np.where(newest >= 0, newest, -1)

    def sample(self, row: int, col: int) -> GpuSample:
        """The GPU's sample of this row, as a sample (for the words of a finding)."""
        fields: dict[str, Any] = {}
        for name in NUMERIC:
            value = float(self.values[name][row, col])
            if not np.isnan(value):
                fields[name] = int(value) if name in ("memory_used_bytes", "clock_event_reasons") else value
        pids = () if self.pids is None else self.pids[row, col]
        return GpuSample(self.gpus[col], health=HEALTH_CODES[self.health[row, col]], pids=pids,
                         errors=self.errors.get((self.first_row + row, col), ()), **fields)


@dataclass
class Window:
    """Each cell's window: `count` samples, their rows (cells x width, -1 past the count) and readings."""

    stretch: Stretch
    cols: np.ndarray
    rows: np.ndarray
    count: np.ndarray
    _read: dict[str, np.ndarray] = field(default_factory=dict, init=False, repr=False)  # readings taken
    _past: np.ndarray = field(init=False, repr=False)  # the places past each window's count

    def __post_init__(self) -> None:
        self._past = self.rows < 0

    def readings(self, name: str) -> np.ndarray:
        """A reading's window (cells x width, NaN past the count), read once: callers never write into it."""
        read = self._read.get(name)
        if read is None:
            read = self.stretch.values[name][self.rows, self.cols[:, None]]
            read[self._past] = np.nan
            read.flags.writeable = False
            self._read[name] = read
        return read

    def times(self) -> np.ndarray:
        return np.where(self._past, np.nan, self.stretch.times[self.rows])

    def newest(self, samples: int) -> Window:
        """The newest `samples` of each window."""
        width = self.rows.shape[1]
        keep = np.minimum(self.count, samples)
        shift = np.clip(self.count - keep, 0, None)
        take = np.minimum(np.arange(min(samples, width))[None, :] + shift[:, None], width - 1)
        rows = np.take_along_axis(self.rows, take, axis=1)
        rows = np.where(np.arange(rows.shape[1])[None, :] < keep[:, None], rows, -1)
        return Window(self.stretch, self.cols, rows, keep)


class Cells:
    """GPUs on ticks due for judgement: for each, the row of the tick (`at`), the GPU's column and the row of
    its newest sample up to that tick (`end`)."""

    def __init__(self, stretch: Stretch, at: np.ndarray, cols: np.ndarray, end: np.ndarray):
        self.stretch, self.at, self.cols, self.end = stretch, at, cols, end

    def __len__(self) -> int:
        return len(self.at)

    def subset(self, chosen: np.ndarray) -> Cells:
        return Cells(self.stretch, self.at[chosen], self.cols[chosen], self.end[chosen])

    def latest(self, name: str) -> np.ndarray:
        return self.stretch.values[name][self.end, self.cols]

    def level(self, name: str) -> np.ndarray:
        return self.stretch.level(name)[self.end, self.cols]

    def now(self) -> np.ndarray:
        return self.stretch.times[self.end]

    def has_pids(self) -> np.ndarray:
        pids = self.stretch.pids
        if pids is None:
            return np.zeros(len(self.at), bool)
        return np.fromiter(map(bool, pids[self.end, self.cols]), bool, len(self.at))

    def span(self, seconds: float, samples: float) -> np.ndarray:
        """The stretch to judge over: `seconds`, or long enough to hold `samples` samples when sampling is
        slow (nvidia-smi -l 5, -l 10): from the time between the cell's last two samples."""
        seen = self.stretch.counts(self.end, self.cols)
        previous = self.stretch.sample_rows(self.cols, np.maximum(seen - 2, 0))
        step = np.where(seen >= 2, self.now() - self.stretch.times[previous], 0.0)
        return np.maximum(seconds, samples * step)

    def window(self, seconds: np.ndarray | float, short_seconds: float) -> Window:
        """The samples of each cell's last `seconds` (oldest first), of those a window of `short_seconds`
        keeps: the samples of its last short_seconds, or its last _KEPT_SAMPLES whatever their age."""
        stretch = self.stretch
        now, seen = self.now(), stretch.counts(self.end, self.cols)

        def since(cutoff: np.ndarray) -> np.ndarray:
            first = np.searchsorted(stretch.times, cutoff, "left")
            before = np.where(first > 0, stretch.counts(np.maximum(first - 1, 0), self.cols), 0)
            return seen - before

        kept = np.maximum(since(now - short_seconds), np.minimum(_KEPT_SAMPLES, seen))
        count = np.minimum(since(now - np.asarray(seconds, dtype=float)), kept)
        width = int(count.max(initial=0))
        offsets = np.arange(width)[None, :]
        inside = offsets < count[:, None]
        picked = stretch.sample_rows(self.cols[:, None], (seen - count)[:, None] + offsets, inside)
        return Window(stretch, self.cols, picked, count)


def ranked(readings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's readings sorted (missing ones last) and how many there are."""
    return np.sort(readings, axis=1), np.add.reduce(~np.isnan(readings), axis=1, dtype=np.intp)


def nearest_rank(sorted_readings: np.ndarray, count: np.ndarray, q: float,
                 top: np.ndarray | None = None) -> np.ndarray:
    """Nearest-rank percentile of each row (NaN where it has no readings): the reading at int(q * n), at most
    rank `top` (default: the row's last reading)."""
    top = count - 1 if top is None else top
    rank = np.minimum((q * count).astype(int), np.maximum(top, 0))
    return np.where(count > 0, at_rank(sorted_readings, rank), np.nan)


def seen_busy(sorted_readings: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Each row's reading "seen busy" (NaN where it has none): its BUSY_PERCENTILE nearest rank, so that a few
    blips do not count, but never its top reading where it holds _EDGE_SAMPLES or more. At slow sampling
    (-l 5, -l 10) a window of five to ten samples still holds the one taken before a spin began, at work:
    one sample at its edge would veto the spin until the window had passed it (issue 58: 10-s spins
    critical at 49 s)."""
    return nearest_rank(sorted_readings, count, BUSY_PERCENTILE, np.where(count >= _EDGE_SAMPLES, count - 2, count - 1))


def at_rank(sorted_readings: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Each row's reading at its rank (NaN for a row with no readings at all)."""
    rows, width = sorted_readings.shape
    if not width:
        return np.full(rows, np.nan)
    return sorted_readings[np.arange(rows), np.minimum(np.maximum(rank, 0), width - 1)]


def run_start(times: np.ndarray, holds: np.ndarray, count: np.ndarray, share: float = 0.8) -> np.ndarray:
    """Onset of a condition that `holds` at each sample of each window (or not): the earliest sample that
    holds such that at least `share` of the samples from it to the newest hold too, or, where the window
    holds a sample before that one, halfway between the two (the condition began between them: at -l 10 it
    is seen up to 10 s after it began, and dating it from its first sample made a spin critical 10 s late
    half the time). Brief dips inside the run do not move the onset; the samples from before the condition
    began do not pull it earlier than that."""
    width = times.shape[1]
    inside = np.arange(width)[None, :] < count[:, None]
    holds = holds & inside
    held = np.cumsum(holds[:, ::-1], axis=1)[:, ::-1]  # from each sample to the newest
    total = count[:, None] - np.arange(width)[None, :]
    good = holds & (held >= share * total)
    first = np.argmax(good, axis=1)
    rows = np.arange(len(count))
    newest = times[rows, np.maximum(count - 1, 0)]
    began = np.where(first > 0, (times[rows, first] + times[rows, np.maximum(first - 1, 0)]) / 2, times[rows, first])
    return np.where(good.any(axis=1), began, newest)


def active(cells: Cells, ctx: Context) -> np.ndarray:
    """Part of a running job: holds job-sized memory (an [N/A]: the newest reading its window keeps stands
    in), runs a kernel, has compute processes, or has stopped answering (a lost GPU is gpu_lost's)."""
    used = cells.latest("memory_used_bytes")
    missing = np.isnan(used)
    if missing.any():
        memory = cells.subset(np.flatnonzero(missing)).window(np.inf, ctx.short_seconds).readings(
            "memory_used_bytes")
        there = ~np.isnan(memory)
        if memory.shape[1]:
            last = memory.shape[1] - 1 - np.argmax(there[:, ::-1], axis=1)
            newest = np.take_along_axis(memory, last[:, None], axis=1)[:, 0]
        else:  # no sample in the window at all: nothing stands in for the [N/A]
            newest = np.full(len(memory), np.nan)
        used = used.copy()
        used[missing] = np.where(there.any(axis=1), newest, np.nan)
    health = cells.stretch.health[cells.end, cells.cols]
    running = cells.latest("utilization_ratio") > 0.02
    return (health != 0) | (used >= ctx.memory_min_bytes) | running | cells.has_pids()
