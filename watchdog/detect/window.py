"""Per-GPU memory of the recent past: the short sample window, the long utilization mean, and the
power levels this GPU has shown when idle and when doing real work (its own baseline)."""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from watchdog.model import GpuHealth, GpuSample

_MIN_SAMPLES = 10  # kept whatever their age: a window of -l 5 samples still has enough to judge
_IDLE_BLOCK = 5  # consecutive util-0 samples averaged before they can lower the idle estimate
_BUSY_SECONDS = 50.0  # time constant of the busy level's average


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

    @property
    def long_mean_utilization(self) -> float | None: ...

    @property
    def long_span_seconds(self) -> float: ...

    @property
    def active(self) -> bool: ...

    def recent(self, seconds: float) -> list[tuple[float, GpuSample]]: ...


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
        self._long: deque[tuple[float, float]] = deque()
        self._long_sum = 0.0
        self.idle_watts: float | None = None
        self.busy_watts: float | None = None
        self._idle_block: list[float] = []
        self.now = 0.0
        self.memory_min_bytes = 0
        self.progress_cpu_min_ratio = 0.2
        self.progress_io_min_bytes_per_second = 65536.0
        self.progress_still_seconds = 30.0
        self.host_first_at: float | None = None
        self.host_seen_at: float | None = None
        self.moved_at: float | None = None
        self.latest = GpuSample(index)

    def add(self, t: float, sample: GpuSample) -> None:
        self.now = t
        self.latest = sample
        samples = self.samples
        samples.append((t, sample))
        cutoff = t - self.short_seconds
        while samples[0][0] < cutoff and len(samples) > _MIN_SAMPLES:  # slow sampling keeps a few more
            samples.popleft()
        util = sample.utilization_ratio
        if util is not None:
            self._long.append((t, util))
            self._long_sum += util
            long_cutoff = t - self.long_seconds
            while self._long[0][0] < long_cutoff:
                self._long_sum -= self._long.popleft()[1]
        self._learn(t, sample)
        cpu, io = sample.host_cpu_ratio, sample.host_io_bytes_per_second
        if cpu is not None or io is not None:
            if self.host_seen_at is None or t - self.host_seen_at > self.short_seconds:
                self.host_first_at = t  # processes (re)appeared: their stillness counts from here
            self.host_seen_at = t
            if (cpu or 0.0) >= self.progress_cpu_min_ratio or (io or 0.0) >= self.progress_io_min_bytes_per_second:
                self.moved_at = t

    def _learn(self, t: float, s: GpuSample) -> None:
        power, util = s.power_watts, s.utilization_ratio
        if power is None or util is None:
            return
        if util == 0.0:
            self._idle_block.append(power)
            if len(self._idle_block) == _IDLE_BLOCK:
                mean = sum(self._idle_block) / _IDLE_BLOCK
                if self.idle_watts is None or mean < self.idle_watts:
                    self.idle_watts = mean
                self._idle_block.clear()
            return
        self._idle_block.clear()
        if util < 0.5:
            return
        busy = self.busy_watts
        reference = self.idle_watts
        if reference is None and s.power_limit_watts:
            reference = self._default_idle_ratio * s.power_limit_watts
        if reference is not None:
            working = power > self._busy_floor_multiple * reference
        else:  # a log without a power limit that never saw this GPU idle: learn from work, not from a spin
            working = busy is None or power > self._fell_max_ratio * busy
        if not working:
            return
        if busy is None or self._busy_at is None:
            self.busy_watts = power
        else:  # an average over about a minute of work, whatever the sampling interval
            alpha = 1.0 - math.exp(-min(t - self._busy_at, 10.0) / _BUSY_SECONDS)
            self.busy_watts = busy + alpha * (power - busy)
        self._busy_at = t

    @property
    def long_mean_utilization(self) -> float | None:
        return self._long_sum / len(self._long) if self._long else None

    @property
    def long_span_seconds(self) -> float:
        return self._long[-1][0] - self._long[0][0] if self._long else 0.0

    def recent(self, seconds: float) -> list[tuple[float, GpuSample]]:
        """Samples of the last `seconds`, oldest first."""
        cutoff = self.now - seconds
        out: list[tuple[float, GpuSample]] = []
        for item in reversed(self.samples):
            if item[0] < cutoff:
                break
            out.append(item)
        out.reverse()
        return out

    @property
    def active(self) -> bool:
        """Part of a running job: holds job-sized memory, runs a kernel, has compute processes, or has
        stopped answering (a lost GPU is part of the picture the others wait on)."""
        s = self.latest
        return bool(
            s.health is not GpuHealth.OK
            or (s.memory_used_bytes is not None and s.memory_used_bytes >= self.memory_min_bytes)
            or (s.utilization_ratio is not None and s.utilization_ratio > 0.02)
            or s.pids
        )
