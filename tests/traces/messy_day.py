"""Shared by the benchmarks: a day of an 8-GPU node as nvidia-smi logs it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TextIO

from watchdog.vocabulary.words import iso_time

DAY = 24 * 3600

MESSY_HEADER = ("timestamp, index, name, utilization.gpu [%], utilization.memory [%], power.draw [W], "
                "enforced.power.limit [W], clocks.current.sm [MHz], clocks.max.sm [MHz], memory.used [MiB], "
                "memory.total [MiB], temperature.gpu")


DAY_SHAPES = {
    "barrier": "checkpoints by rank 0 while the others wait in a barrier at full utilization and low power",
    "idle": "checkpoints with every GPU idle (0-3% utilization, memory held) and training noisier per GPU",
}


def write_messy_day(out: TextIO, gpus: int = 8, seconds: int = DAY, seed: int = 7, spin_seconds: int = 3600,
                    shape: str = "barrier") -> int:
    """A day of 8xH100 training as nvidia-smi really logs it (`-l 1`, the shape of the logs in
    ../shared/realdata): each GPU's row its own millisecond timestamp, a `name` column and units,
    utilization wandering 40-99% with power, memory traffic and clocks moving with it, a 20-40 s
    checkpoint after roughly every other 2-7 minute stretch of training (rank 0 writes, the others wait
    in a barrier at full utilization and low power), and a busy-spin hang for the last `spin_seconds`. With
    shape "idle", every GPU sits idle through each checkpoint (0-3%, memory held) and training utilization
    and power are noisier, GPU by GPU. Returns the number of GPU-samples written."""
    rng = random.Random(seed)
    out.write(MESSY_HEADER + "\n")
    name = "NVIDIA H100 80GB HBM3"
    phases = _phases(rng, seconds, seconds - spin_seconds)
    base = 1.9e9
    written = 0
    phase = 0
    temps = [35.0] * gpus
    for second in range(seconds + 1):
        while phase + 1 < len(phases) and phases[phase + 1][0] <= second:
            phase += 1
        what = phases[phase][1]
        stamp = base + second + rng.uniform(0.0, 0.02)
        for gpu in range(gpus):
            stamp += rng.uniform(0.001, 0.004)  # nvidia-smi prints each GPU's row as it reads it
            util, power, mem_util, clock = _reading(rng, what, gpu, shape)
            temps[gpu] += (30 + power / 14 - temps[gpu]) * 0.05
            used = 73_000 + (gpu * 37 + second // 600) % 900 if what != "startup" else 2_000 + second * 1500
            day = iso_time(stamp, naive=True).replace("-", "/").replace("T", " ")
            out.write(f"{day}, {gpu}, {name}, {util} %, {mem_util} %, {power:.2f} W, 700.00 W, "
                      f"{clock} MHz, 1980 MHz, {min(used, 81_559)} MiB, 81559 MiB, {temps[gpu]:.0f}\n")
            written += 1
    return written


def _phases(rng: random.Random, seconds: int, hang: int) -> list[tuple[int, str]]:
    """(start second, what the job does): start-up, training with a checkpoint after roughly every other
    2-7 minute stretch, and a spin from `hang` on."""
    phases: list[tuple[int, str]] = [(0, "startup"), (45, "train")]
    t = 45
    while t < hang:
        t += rng.randint(120, 420)
        if t >= hang:
            break
        if rng.random() < 0.5:
            phases.append((t, "checkpoint"))
            t += rng.randint(20, 40)
            phases.append((t, "train"))
    phases.append((hang, "spin"))
    return phases


def _reading(rng: random.Random, what: str, gpu: int, shape: str) -> tuple[int, float, int, int]:
    """(utilization %, power W, memory utilization %, SM clock MHz) of one GPU doing `what`."""
    if what == "train":
        util = rng.randint(40, 99) if shape == "barrier" else min(100, max(5, int(rng.gauss(75, 22))))
        power = 120 + util * 5.6 + rng.uniform(-25, 25) * (1 if shape == "barrier" else 3)
        return util, power, int(util * rng.uniform(0.3, 0.6)), rng.choice((1980, 1980, 1965, 1950))
    if what == "checkpoint" and shape == "idle":
        return rng.choice((0, 0, 0, 1, 3)), rng.uniform(65, 95), 0, 1980
    if what == "checkpoint" and gpu == 0:
        return rng.randint(0, 8), rng.uniform(110, 160), rng.randint(0, 3), 1980
    if what in ("checkpoint", "spin"):
        return 100, rng.uniform(118, 135), 0, 1980
    return rng.choice((0, 0, 0, 2, 15)), rng.uniform(70, 110), 0, 1980  # startup: loading, compiling


# The fields a random day may log besides timestamp and the GPU's identity, as nvidia-smi names them.
_FIELDS = ("name", "utilization.gpu", "utilization.memory", "power.draw", "enforced.power.limit", "clocks.current.sm",
           "clocks.max.sm", "memory.used", "memory.total", "temperature.gpu", "pstate", "clocks_event_reasons.active")
_UNITS = {"utilization.gpu": "%", "utilization.memory": "%", "power.draw": "W", "enforced.power.limit": "W",
          "clocks.current.sm": "MHz", "clocks.max.sm": "MHz", "memory.used": "MiB", "memory.total": "MiB"}


@dataclass(frozen=True)
class DayShape:
    """How one random day is logged: what a real log may differ in, drawn by `random_shape`."""

    gpus: int
    interval: int  # seconds between samples (-l)
    stamps: str  # "row": each GPU's row its own millisecond timestamp; "sample": one timestamp for a sample's rows
    identity: str  # "index", "uuid", or "none" (the rows' order in time tells the GPUs apart)
    units: bool  # "71.25 W" or "71.25" (nounits)
    fields: tuple[str, ...]  # the columns, in their order
    absent: frozenset[str]  # fields the GPU does not report: every cell "[N/A]" or "[Not Supported]"
    missing: float  # the share of the other numeric cells that read "[N/A]"
    dropped: float  # the share of GPU rows a sample lacks (a GPU that did not answer in time)
    outage: bool  # one GPU absent for half an hour
    order: str  # "enumeration", or "interleaved": each sample's rows in an order of their own
    checkpoints: str  # as write_messy_day's shape: "barrier" or "idle"

    def described(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} every {self.interval} s",
                 "per-GPU timestamps" if self.stamps == "row" else "one timestamp a sample",
                 {"index": "by index", "uuid": "by uuid", "none": "no index"}[self.identity],
                 "units" if self.units else "nounits", f"{len(self.fields)} columns"]
        if self.absent:
            parts.append("N/A: " + ",".join(sorted(self.absent)))
        if self.missing:
            parts.append(f"{self.missing:.0%} cells N/A")
        if self.dropped:
            parts.append(f"{self.dropped:.1%} rows dropped")
        if self.outage:
            parts.append("a GPU out 30 min")
        if self.order == "interleaved":
            parts.append("rows interleaved")
        return ", ".join(parts) + f", {self.checkpoints} checkpoints"


def random_shape(rng: random.Random, gpus: int | None = None) -> DayShape:
    """Any shape of log the readers are meant to take, drawn at random: the GPU count and sampling, per-row or
    per-sample timestamps, index, uuid or neither, units or not, the fields and their order, fields never
    reported, scattered [N/A] cells, dropped rows, a GPU out for a while, rows of a sample in any order. A log
    without an index or uuid keeps nvidia-smi's order and every row (its GPUs are told apart by that order).
    `gpus` fixes the GPU count (drawn from 1, 2, 4 and 8 otherwise)."""
    identity = rng.choice(("index", "index", "uuid", "none"))
    stamps = "row" if identity == "none" else rng.choice(("row", "sample"))
    named = identity != "none"
    chosen = [f for f in _FIELDS if f in ("utilization.gpu", "power.draw") or rng.random() < 0.6]
    columns = ["timestamp", *({"index": ["index"], "uuid": ["uuid"], "none": []}[identity]), *chosen]
    rng.shuffle(columns)
    optional = [f for f in chosen if f not in ("utilization.gpu", "power.draw", "name")]
    absent = frozenset(rng.sample(optional, k=min(len(optional), rng.choice((0, 0, 1, 2)))))
    count = rng.choice((1, 2, 4, 8, 8, 8))
    return DayShape(gpus=gpus or count, interval=rng.choice((1, 1, 2, 5)), stamps=stamps,
                    identity=identity, units=rng.random() < 0.7, fields=tuple(columns), absent=absent,
                    missing=rng.choice((0.0, 0.0, 0.001, 0.01)),
                    dropped=rng.choice((0.0, 0.001, 0.01)) if named else 0.0,
                    outage=named and rng.random() < 0.3,
                    order=rng.choice(("enumeration", "interleaved")) if named and (gpus or count) > 1 else
                    "enumeration",
                    checkpoints=rng.choice(("barrier", "idle")))


def write_random_day(out: TextIO, shape: DayShape, samples: int, seed: int = 7) -> int:
    """About `samples` GPU-samples of training logged in `shape` (the day as long as that takes: a 1-GPU day
    sampled every 5 s is 40 times as long as an 8-GPU one sampled every second), with write_messy_day's
    checkpoints and a spin in its last tenth. Returns the number of GPU-samples written."""
    rng = random.Random(seed)
    ticks = max(600, samples // shape.gpus)
    seconds = ticks * shape.interval
    hang = seconds - seconds // 10
    phases = _phases(rng, seconds, hang)
    units = shape.units
    out.write(", ".join(f"{f} [{_UNITS[f]}]" if units and f in _UNITS else f for f in shape.fields) + "\n")
    name, base = "NVIDIA H100 80GB HBM3", 1.9e9
    temps = [35.0] * shape.gpus
    outage = rng.randrange(shape.gpus) if shape.outage else -1
    outage_start = rng.randrange(seconds // 10, hang - 1800) if shape.outage and hang > 3600 else -1
    written = phase = 0
    for tick in range(ticks + 1):
        second = tick * shape.interval
        while phase + 1 < len(phases) and phases[phase + 1][0] <= second:
            phase += 1
        what = phases[phase][1]
        stamp = base + second + rng.uniform(0.0, 0.02)
        gpus = list(range(shape.gpus))
        if shape.order == "interleaved":
            rng.shuffle(gpus)
        for gpu in gpus:
            stamp += rng.uniform(0.001, 0.004)
            util, power, mem_util, clock = _reading(rng, what, gpu, shape.checkpoints)
            temps[gpu] += (30 + power / 14 - temps[gpu]) * 0.05
            if (gpu == outage and outage_start <= second < outage_start + 1800) or (
                    shape.dropped and rng.random() < shape.dropped):
                continue
            used = 73_000 + (gpu * 37 + second // 600) % 900 if what != "startup" else 2_000 + second * 1500
            cells = {
                "timestamp": iso_time(stamp if shape.stamps == "row" else base + second, naive=True)
                .replace("-", "/").replace("T", " "),
                "index": str(gpu), "uuid": f"GPU-{gpu:08x}-7e1c-4a1b-9d3e-5f2a8c{gpu:06x}", "name": name,
                "utilization.gpu": str(util), "utilization.memory": str(mem_util), "power.draw": f"{power:.2f}",
                "enforced.power.limit": "700.00", "clocks.current.sm": str(clock), "clocks.max.sm": "1980",
                "memory.used": str(min(used, 81_559)), "memory.total": "81559",
                "temperature.gpu": f"{temps[gpu]:.0f}", "pstate": "P0",
                "clocks_event_reasons.active": "0x0000000000000000" if what == "train" else "0x0000000000000001",
            }
            row = []
            for field in shape.fields:
                if field in shape.absent:
                    row.append("[Not Supported]" if field.startswith("clocks") else "[N/A]")
                elif field in _UNITS and shape.missing and rng.random() < shape.missing:
                    row.append("[N/A]")
                else:
                    row.append(cells[field] + (f" {_UNITS[field]}" if units and field in _UNITS else ""))
            out.write(", ".join(row) + "\n")
            written += 1
    return written
