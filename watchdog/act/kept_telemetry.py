"""The node's samples of the last few minutes, kept for the incident bundles (bundles.py writes them as
telemetry.jsonl). Held compactly: each tick's readings that change from tick to tick as one float array, the
rest of each GPU's sample (its name, uuid, health, processes, counters) held once for all the ticks it is the same
in; built back into snapshots only when a bundle is written. At 64 GPUs, 9 minutes of GpuSample tuples
with their own floats took about 18 MiB; this takes about 3."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from watchdog.vocabulary.model import GpuSample, NodeSnapshot

# The readings that move every tick, held as float64 (a missing one NaN); whole numbers among them (memory_used_bytes)
# are exact in a float64 up to 2**53 bytes. Every other field stays in the sample, shared while it does not change.
_MOVING = ("utilization_ratio", "memory_utilization_ratio", "power_watts", "sm_clock_hertz", "memory_used_bytes",
           "temperature_celsius", "sm_activity_ratio", "host_cpu_ratio", "host_io_bytes_per_second")
_SLOTS = tuple(GpuSample._fields.index(name) for name in _MOVING)
_READINGS = operator.itemgetter(*_SLOTS)
_REST = operator.itemgetter(*(slot for slot in range(len(GpuSample._fields)) if slot not in _SLOTS))
_WHOLE = tuple(name == "memory_used_bytes" for name in _MOVING)
_sample = tuple.__new__
_KNOWN_PER_GPU = 8  # the rests remembered to share, a GPU: a clock-event reason or a process that comes and goes


class KeptTelemetry:
    """Snapshots appended one a tick, kept while they are no more than `seconds` older than the newest (by their
    own times); iterating gives them back."""

    def __init__(self) -> None:
        self._ticks: deque[tuple[float, np.ndarray, tuple[GpuSample, ...]]] = deque()
        self._known: dict[tuple, GpuSample] = {}  # the rests of samples seen lately, each held once, by their fields

    def __len__(self) -> int:
        return len(self._ticks)

    def __copy__(self) -> KeptTelemetry:
        """The snapshots kept now, apart from what is appended later (cheap: the arrays and rests are shared)."""
        return self.since(float("-inf"))

    def since(self, t: float) -> KeptTelemetry:
        """A copy holding the snapshots at or after time t."""
        copy = KeptTelemetry()
        copy._ticks = deque(tick for tick in self._ticks if tick[0] >= t)
        return copy

    def append(self, snapshot: NodeSnapshot, seconds: float) -> None:
        gpus = snapshot.gpus
        readings = np.array(list(map(_READINGS, gpus)), dtype=float)
        known = self._known
        if len(known) > _KNOWN_PER_GPU * len(gpus):
            known.clear()
        rests = []
        for sample in gpus:
            key = _REST(sample)
            rest = known.get(key)  # the same name, health, processes...: one object
            if rest is None:
                fields = list(sample)
                for slot in _SLOTS:
                    fields[slot] = None
                rest = known[key] = _sample(GpuSample, fields)
            rests.append(rest)
        ticks = self._ticks
        ticks.append((snapshot.time_seconds, readings, tuple(rests)))
        while ticks and snapshot.time_seconds - ticks[0][0] > seconds:
            ticks.popleft()

    def __iter__(self) -> Iterator[NodeSnapshot]:
        for t, readings, rests in list(self._ticks):
            samples = []
            for rest, values in zip(rests, readings.tolist()):
                fields = list(rest)
                for slot, value, whole in zip(_SLOTS, values, _WHOLE):
                    fields[slot] = None if value != value else int(value) if whole else value
                samples.append(_sample(GpuSample, fields))
            yield NodeSnapshot(t, tuple(samples))


def kept_since(telemetry: Iterable[NodeSnapshot], t: float) -> Iterable[NodeSnapshot]:
    """The snapshots at or after time t: still held compactly where they were (built one at a time as a bundle
    writes them, so writing one never holds them all as samples)."""
    if isinstance(telemetry, KeptTelemetry):
        return telemetry.since(t)
    return [s for s in telemetry if s.time_seconds >= t]
