"""What the incident page's timeline draws (export/report.py), and no more: each snapshot's time, the GPUs seen,
and the readings of each panel, kept as arrays while a bundle's telemetry is read back a stretch at a time."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from watchdog.vocabulary.model import GpuSample, NodeSnapshot, SnapshotBlock

# The timeline's panels: the reading drawn, its label, the scale to its unit, the unit.
PANELS = (("utilization_ratio", "Utilization", 100.0, "%"), ("power_watts", "Power", 1.0, "W"),
          ("sm_clock_hertz", "SM clock", 1e-6, "MHz"))

_NONE = float("nan")


class Drawn:
    """What the timeline draws, and no more: each snapshot's time, the GPUs seen, and each panel's reading of every
    GPU in every snapshot (NaN: none), eight bytes a reading. Built a stretch at a time (a bundle's telemetry read
    back), so that 64 GPUs' five minutes cost half a megabyte, not the tens a sample object per reading would.

    With `most`, at most that many snapshots are kept, evenly: past it every other one kept is dropped and from
    then on one in twice as many is kept (a file of any length is drawn in bounded memory; a bundle the daemon
    writes holds far fewer)."""

    def __init__(self, items: Iterable[NodeSnapshot | SnapshotBlock] = (), most: int | None = None):
        self.times = array("d")
        self.gpus: set[int] = set()
        self.readings: dict[str, dict[int, array[float]]] = {name: {} for name, *_ in PANELS}
        self._most, self._stride, self._seen = most, 1, 0  # _seen: snapshots offered, kept or not
        for item in items:
            self.add(item)

    def add(self, item: NodeSnapshot | SnapshotBlock) -> None:
        start = len(self.times)
        if isinstance(item, NodeSnapshot):
            self._seen += 1
            if (self._seen - 1) % self._stride:
                return
            self.times.append(item.time_seconds)
            for g in item.gpus:
                self.gpus.add(g.index)
                for name, by_gpu in self.readings.items():
                    value = getattr(g, name)
                    self._series(by_gpu, g.index, start).append(_NONE if value is None else value)
        else:
            self._add_block(item, start)
        for by_gpu in self.readings.values():  # a GPU missing from these snapshots reads nothing in them
            for series in by_gpu.values():
                series.extend([_NONE] * (len(self.times) - len(series)))
        while self._most is not None and len(self.times) > self._most:
            self._halve()

    def _halve(self) -> None:
        """Keep every other snapshot kept (those offered at a multiple of twice the stride), and one in twice as
        many from now on."""
        self.times = self.times[::2]
        for by_gpu in self.readings.values():
            for gpu, series in by_gpu.items():
                by_gpu[gpu] = series[::2]
        self._stride *= 2

    def _add_block(self, block: SnapshotBlock, start: int) -> None:
        count, stride = len(block.times), self._stride
        first = -self._seen % stride  # the block's first snapshot kept: the next offered at a multiple of the stride
        self._seen += count
        picked = slice(first, None, stride)
        self.times.extend(block.times[picked])
        width = len(block.layout)
        for position, gpu in enumerate(block.layout):
            present = None if block.present is None else block.present[position::width][picked]
            if present is not None and not any(present):
                continue
            self.gpus.add(gpu)
            for name, by_gpu in self.readings.items():
                column = block.columns[_SLOTS[name]]
                if column is None:
                    continue
                values = column[position::width][picked]
                values = values.tolist() if hasattr(values, "tolist") else values  # a reader's float64 array
                if present is not None:
                    values = [v if here else None for v, here in zip(values, present)]
                self._series(by_gpu, gpu, start).extend([_NONE if v is None else v for v in values])

    def _series(self, by_gpu: dict[int, array[float]], gpu: int, start: int) -> array[float]:
        series = by_gpu.get(gpu)
        if series is None:
            series = by_gpu[gpu] = array("d", [_NONE]) * start
        return series

    def __len__(self) -> int:
        return len(self.times)


_SLOTS = {name: GpuSample._fields.index(name) for name, *_ in PANELS}
