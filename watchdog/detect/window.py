"""Per-GPU memory of the recent past: the short sample window, the long utilization mean, and the
power levels this GPU has shown when idle and when doing real work (its own baseline)."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from watchdog.model import GpuHealth, GpuSample, SnapshotBlock

_MIN_SAMPLES = 10  # kept whatever their age: a window of -l 5 samples still has enough to judge
_IDLE_BLOCK = 5  # consecutive util-0 samples averaged before they can lower the idle estimate
_BUSY_SECONDS = 50.0  # time constant of the busy level's average
_DECAY = -1.0 / _BUSY_SECONDS
_UNIT = 1 << 40  # the long window sums utilization in these fixed-point steps: exact, in any order


def _weights(elapsed: Sequence[float]) -> Iterator[float]:
    """The busy average's weight for each sample `elapsed` seconds after the one before it:
    1 - exp(-min(elapsed, 10) / _BUSY_SECONDS), an average over about _BUSY_SECONDS of work whatever the
    sampling interval. Worked out a column at a time (a log with per-row timestamps has a step of its
    own at every sample)."""
    if max(elapsed, default=0.0) > 10.0:
        elapsed = list(map(min, elapsed, itertools.repeat(10.0)))
    return map(operator.sub, itertools.repeat(1.0), map(math.exp, map(operator.mul, elapsed, itertools.repeat(_DECAY))))


def _fixed(ratio: float) -> int:
    return int(ratio * _UNIT)


def fixed_utilizations(ratios: Sequence[float]) -> list[int]:
    """_fixed() over a column, without a call per value."""
    return list(map(int, map(operator.mul, ratios, itertools.repeat(_UNIT))))


_TIME, _FIXED = operator.itemgetter(0), operator.itemgetter(1)


class GpuView(Protocol):
    """What a detector may look at for one GPU on one tick. Detectors are pure functions of this."""

    index: int
    now: float
    latest: GpuSample
    samples: deque[tuple[float, GpuSample]]  # oldest first, covering the longest short window
    idle_watts: float | None  # learned: lowest 5-sample mean at 0% util
    busy_watts: float | None  # learned: EWMA of power while clearly working
    memory_min_bytes: int
    host_first_at: float | None  # first sample with a host-progress reading (processes seen)
    host_seen_at: float | None  # latest such sample
    moved_at: float | None  # latest sample whose processes moved on the host (CPU or I/O)
    progress_still_seconds: float  # processes that have not moved for this long are still
    # What a detector keeps between ticks, by its name: only what follows from the samples themselves
    # (work saved as the window slides), never a verdict.
    memo: dict[str, Any]

    @property
    def long_mean_utilization(self) -> float | None: ...

    @property
    def long_span_seconds(self) -> float: ...

    @property
    def active(self) -> bool: ...

    def recent(self, seconds: float) -> list[tuple[float, GpuSample]]: ...

    def recent_count(self, seconds: float) -> int: ...

    @property
    def added(self) -> int: ...

    def long_history(self) -> deque[tuple[float, int]]: ...

    @property
    def long_sum(self) -> int: ...

    long_unit: int


class GpuWindow:
    """Implements GpuView: the engine feeds it samples, then hands it to the detectors as it stands."""

    def __init__(
        self,
        index: int,
        short_seconds: float,
        long_seconds: float,
        idle_power_max_multiple: float,
        default_idle_power_ratio: float,
        fell_max_ratio: float = 0.75,
    ):
        self.index = index
        self.short_seconds = short_seconds
        self.long_seconds = long_seconds
        # Power above this multiple of idle while the GPU is busy counts as real work, which is what the
        # busy level is learned from (the same line busy_spin's power_near_idle leg draws).
        self._busy_floor_multiple = idle_power_max_multiple
        self._default_idle_ratio = default_idle_power_ratio
        self._fell_max_ratio = fell_max_ratio
        self._busy_at: float | None = None
        self.samples: deque[tuple[float, GpuSample]] = deque()
        self._long: deque[tuple[float, int]] = deque()  # (time, utilization in _UNIT steps)
        self._long_sum = 0
        self.idle_watts: float | None = None
        self.busy_watts: float | None = None
        self._idle_block: list[float] = []
        self._alpha_for = (-1.0, 0.0)  # (elapsed, weight) of the last busy-average step
        self._added = 0  # samples ever added: with len(samples), how many have left
        self._unordered_from = 0  # `samples` is in time order once this many have left
        self.now = 0.0
        self.memory_min_bytes = 0
        self.progress_cpu_min_ratio = 0.2
        self.progress_io_min_bytes_per_second = 65536.0
        self.progress_still_seconds = 30.0
        self.host_first_at: float | None = None
        self.host_seen_at: float | None = None
        self.moved_at: float | None = None
        self.latest = GpuSample(index)
        self.memo: dict[str, Any] = {}

    def add(self, t: float, sample: GpuSample) -> None:
        samples = self.samples
        if samples and t < samples[-1][0]:  # a clock step back within the engine's tolerance
            self._unordered_from = self._added  # ordered again once the samples before this one are gone
        self._added += 1
        self.now = t
        self.latest = sample
        samples.append((t, sample))
        cutoff = t - self.short_seconds
        while samples[0][0] < cutoff and len(samples) > _MIN_SAMPLES:  # slow sampling keeps a few more
            samples.popleft()
        util = sample.utilization_ratio
        if util is not None:
            history = self._long
            fixed = _fixed(util)
            history.append((t, fixed))
            self._long_sum += fixed
            long_cutoff = t - self.long_seconds
            while history[0][0] < long_cutoff:
                self._long_sum -= history.popleft()[1]
            power = sample.power_watts
            if power is not None and (util == 0.0 or util >= 0.5 or self._idle_block):
                self._learn(t, util, power, sample.power_limit_watts)
        cpu, io = sample.host_cpu_ratio, sample.host_io_bytes_per_second
        if cpu is not None or io is not None:
            self._host(t, cpu, io)

    def extend(self, run: GpuRun) -> None:
        """The state add() would leave after each of the run's samples in turn, reached in bulk: for a
        replay's stretches that no detector can fire on. The run's times must increase."""
        times, window = run.times, self.samples
        before, count = len(window), len(times)
        # What add() would have popped: the oldest entries up to the cutoff (on into the run, whose times
        # increase, when every entry before it is older), keeping _MIN_SAMPLES. Only the run's samples
        # that stay are built.
        cutoff = times[-1] - self.short_seconds
        gone = _older(window, cutoff)
        if gone == before:
            gone += bisect.bisect_left(times, cutoff)
        gone = max(0, min(gone, before + count - _MIN_SAMPLES))
        first = max(0, gone - before)
        stay = run.samples_from(first)
        if gone:
            window = self.samples = deque(itertools.islice(window, gone, None))
        window.extend(zip(times[first:], stay))
        self.now, self.latest = times[-1], stay[-1]
        self._added += count
        self._extend_host(times, run.column("host_cpu_ratio"), run.column("host_io_bytes_per_second"))
        utils, powers, limits = run.column("utilization_ratio"), run.column("power_watts"), run.column(
            "power_limit_watts")
        if None in utils:
            kept = [(t, u, p, limit) for t, u, p, limit in zip(times, utils, powers, limits) if u is not None]
            if not kept:
                return
            times, utils, powers, limits = map(tuple, zip(*kept))
        fixed = fixed_utilizations(utils)
        history = self._long
        history.extend(zip(times, fixed))
        self._long_sum += sum(fixed)
        old = _older(history, times[-1] - self.long_seconds)
        if old:
            leaving = list(map(_FIXED, itertools.islice(history, old)))
            self._long_sum -= sum(leaving)
            for _ in leaving:
                history.popleft()
        if min(utils) >= 0.5 and None not in powers:
            self._learn_working(times, powers, limits)
        elif 0.0 not in utils:  # no idle sample: the block clears, and only samples of real work teach
            self._idle_block.clear()
            mask = list(map(operator.le, itertools.repeat(0.5), utils))
            if None in powers:
                mask = list(map(operator.and_, mask, map(operator.is_not, powers, itertools.repeat(None))))
            if any(mask):
                self._learn_working(*(list(itertools.compress(column, mask)) for column in (times, powers, limits)))
        else:
            for t, util, power, limit in zip(times, utils, powers, limits):
                if power is not None and (util == 0.0 or util >= 0.5 or self._idle_block):
                    self._learn(t, util, power, limit)

    def _extend_host(self, times: Sequence[float], cpu: Sequence[float | None], io: Sequence[float | None]) -> None:
        if cpu.count(None) == len(cpu) and io.count(None) == len(io):
            return
        for t, c, i in zip(times, cpu, io):
            if c is not None or i is not None:
                self._host(t, c, i)

    def _host(self, t: float, cpu: float | None, io: float | None) -> None:
        if self.host_seen_at is None or t - self.host_seen_at > self.short_seconds:
            self.host_first_at = t  # processes (re)appeared: their stillness counts from here
        self.host_seen_at = t
        if (cpu or 0.0) >= self.progress_cpu_min_ratio or (io or 0.0) >= self.progress_io_min_bytes_per_second:
            self.moved_at = t

    def _learn_working(self, times: Sequence[float], powers: Sequence[float], limits: Sequence[float | None]) -> None:
        """_learn over samples all at 50% utilization or more: the same steps, without a call each."""
        self._idle_block.clear()
        reference = self.idle_watts
        if reference is None and limits[0] and None not in limits and min(limits) == max(limits):  # type: ignore[type-var]
            reference = self._default_idle_ratio * limits[0]
        if reference is None:  # a reference that moves, or none: sample by sample (see _learn)
            for t, power, limit in zip(times, powers, limits):
                self._learn(t, 1.0, power, limit)
            return
        floor = self._busy_floor_multiple * reference
        mask = list(map(floor.__lt__, powers))
        working, stamps = list(itertools.compress(powers, mask)), list(itertools.compress(times, mask))
        if not working:
            return
        busy, busy_at = self.busy_watts, self._busy_at
        if busy is None or busy_at is None:
            busy, busy_at, working, stamps = working[0], stamps[0], working[1:], stamps[1:]
        steps = list(map(operator.sub, stamps, [busy_at, *stamps[:-1]]))
        if steps and min(steps) == max(steps):  # the usual even sampling: one weight for every step
            alpha = self._alpha(steps[0])
            for power in working:
                busy += alpha * (power - busy)
        else:  # per-row timestamps: a weight per step
            for weight, power in zip(_weights(steps), working):
                busy = busy + weight * (power - busy)
        self.busy_watts, self._busy_at = busy, stamps[-1] if stamps else busy_at

    def _learn(self, t: float, util: float, power: float, limit: float | None) -> None:
        if util == 0.0:
            block = self._idle_block
            block.append(power)
            if len(block) == _IDLE_BLOCK:
                mean = sum(block) / _IDLE_BLOCK
                if self.idle_watts is None or mean < self.idle_watts:
                    self.idle_watts = mean
                block.clear()
            return
        self._idle_block.clear()
        if util < 0.5:
            return
        busy = self.busy_watts
        reference = self.idle_watts
        if reference is None and limit:
            reference = self._default_idle_ratio * limit
        if reference is not None:
            working = power > self._busy_floor_multiple * reference
        else:  # a log without a power limit that never saw this GPU idle: learn from work, not from a spin
            working = busy is None or power > self._fell_max_ratio * busy
        if not working:
            return
        if busy is None or self._busy_at is None:
            self.busy_watts = power
        else:  # an average over about a minute of work, whatever the sampling interval
            self.busy_watts = busy + self._alpha(t - self._busy_at) * (power - busy)
        self._busy_at = t

    def _alpha(self, elapsed: float) -> float:
        """The busy average's weight for a sample `elapsed` after the previous one (remembered: the
        sampling interval rarely changes)."""
        if elapsed != self._alpha_for[0]:
            self._alpha_for = (elapsed, next(_weights((elapsed,))))
        return self._alpha_for[1]

    @property
    def long_mean_utilization(self) -> float | None:
        return self._long_sum / len(self._long) / _UNIT if self._long else None

    def long_history(self) -> deque[tuple[float, int]]:
        """The long window: (time, utilization in `long_unit` steps), oldest first. Read only."""
        return self._long

    @property
    def long_sum(self) -> int:
        return self._long_sum

    long_unit = _UNIT

    @property
    def long_span_seconds(self) -> float:
        return self._long[-1][0] - self._long[0][0] if self._long else 0.0

    def recent(self, seconds: float) -> list[tuple[float, GpuSample]]:
        """Samples of the last `seconds`, oldest first: from the newest back to the first older one."""
        samples = self.samples
        return list(itertools.islice(samples, len(samples) - self.recent_count(seconds), None))

    def recent_count(self, seconds: float) -> int:
        """How many samples recent(seconds) holds."""
        samples, cutoff = self.samples, self.now - seconds
        if self._added - len(samples) >= self._unordered_from:  # in time order again: bisect
            return len(samples) - bisect.bisect_left(samples, cutoff, key=_TIME)
        return sum(1 for _ in itertools.takewhile(lambda item: item[0] >= cutoff, reversed(samples)))

    @property
    def added(self) -> int:
        """Samples ever added: the newest sample is number added - 1, and recent() ends with it."""
        return self._added

    @property
    def active(self) -> bool:
        """Part of a running job: holds job-sized memory, runs a kernel, has compute processes, or has
        stopped answering (detect/node.py leaves a lost GPU to gpu_lost)."""
        s = self.latest
        used = s.memory_used_bytes
        if used is None:  # an [N/A]: the newest reading the window holds stands in
            used = next((x.memory_used_bytes for _, x in reversed(self.samples) if x.memory_used_bytes is not None),
                        None)
        return bool(
            s.health is not GpuHealth.OK
            or (used is not None and used >= self.memory_min_bytes)
            or (s.utilization_ratio is not None and s.utilization_ratio > 0.02)
            or s.pids
        )


def span(view: GpuView, seconds: float, samples: int) -> float:
    """The stretch to judge over: `seconds`, or long enough to hold `samples` samples when sampling is slow
    (nvidia-smi -l 5, -l 10)."""
    window = view.samples
    if len(window) < 2:
        return seconds
    return max(seconds, samples * (window[-1][0] - window[-2][0]))


def _older(entries: deque[tuple[float, Any]], cutoff: float) -> int:
    """How many entries from the oldest on are older than `cutoff`, as a loop popping them would count."""
    return len(list(itertools.takewhile(cutoff.__gt__, map(_TIME, entries))))


class GpuRun:
    """One GPU's samples over a stretch of ticks, read column by column. A detector's
    `steady(run, view, cfg)` looks at it to say, without a call per sample, that it would find nothing
    on any of these samples; GpuWindow.extend ingests it. Built from samples (transposed once, on first
    use) or from a reader's SnapshotBlock (its columns sliced; samples built only where a window keeps
    them)."""

    def __init__(self, times: Sequence[float], samples: Sequence[GpuSample]):
        self.times = times
        self._samples: Sequence[GpuSample] | None = samples
        self._columns: dict[str, Sequence[Any]] | None = None
        self._block: tuple[SnapshotBlock, int, int] | None = None

    @classmethod
    def of_block(cls, times: Sequence[float], block: SnapshotBlock, position: int, start: int) -> GpuRun:
        """The GPU at `position` of `block` in its snapshots from `start` on, one per time in `times`."""
        run = cls(times, ())
        run._samples, run._columns, run._block = None, {}, (block, position, start)
        return run

    def __len__(self) -> int:
        return len(self.times)

    def column(self, name: str) -> Sequence[Any]:
        columns = self._columns
        if columns is None:
            columns = self._columns = dict(zip(GpuSample._fields, zip(*self._samples)))  # type: ignore[misc]
        elif name not in columns and self._block is not None:
            block, position, start = self._block
            columns[name] = block.column(_SLOT[name], position, start, start + len(self.times))
        return columns[name]

    def samples_from(self, first: int) -> Sequence[GpuSample]:
        """The run's samples from the `first` on."""
        if self._samples is not None:
            return self._samples[first:]
        block, position, start = self._block  # type: ignore[misc]
        return block.samples(position, start + first, start + len(self.times))


_SLOT = {name: slot for slot, name in enumerate(GpuSample._fields)}
