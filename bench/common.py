"""Shared by the benchmarks: a day-long simulated node and an nvidia-smi CSV writer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TextIO

from watchdog.model import NodeSnapshot, iso_time
from watchdog.sample.sim import Scenario

DAY = 24 * 3600


def training_day(gpus: int = 8) -> Scenario:
    """A day of training: hourly 2-minute checkpoints where rank 0 writes while the others wait, and a
    busy-spin hang in the last hour."""
    others = tuple(range(1, gpus))
    timeline: list[tuple[int, tuple[int, ...] | None, str]] = [(0, None, "startup"), (40, None, "train")]
    for hour in range(1, 23):
        timeline += [(hour * 3600, (0,), "checkpoint_writer"), (hour * 3600, others, "spin"),
                     (hour * 3600 + 120, None, "train")]
    timeline.append((23 * 3600, None, "spin"))
    return Scenario("training_day", "one day of 8xH100 training", "h100", gpus, DAY, tuple(timeline), gpm=True)


CSV_HEADER = ("timestamp, index, utilization.gpu [%], utilization.memory [%], power.draw [W], "
              "enforced.power.limit [W], clocks.current.sm [MHz], clocks.max.sm [MHz], memory.used [MiB], "
              "memory.total [MiB], temperature.gpu")


def write_smi_csv(out: TextIO, snapshots: Iterable[NodeSnapshot]) -> None:
    """As `nvidia-smi --query-gpu=... --format=csv -l 1` writes it."""
    out.write(CSV_HEADER + "\n")
    for snap in snapshots:
        stamp = iso_time(snap.time_seconds, naive=True).replace("-", "/").replace("T", " ")
        for g in snap.gpus:
            out.write(f"{stamp}, {g.index}, {round((g.utilization_ratio or 0) * 100)} %, "
                      f"{round((g.memory_utilization_ratio or 0) * 100)} %, {g.power_watts:.2f} W, "
                      f"{g.power_limit_watts:.2f} W, {(g.sm_clock_hertz or 0) / 1e6:.0f} MHz, "
                      f"{(g.sm_clock_max_hertz or 0) / 1e6:.0f} MHz, {(g.memory_used_bytes or 0) >> 20} MiB, "
                      f"{(g.memory_total_bytes or 0) >> 20} MiB, {g.temperature_celsius:.0f}\n")
