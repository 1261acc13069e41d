"""Shared by the benchmarks: a day of an 8-GPU node as nvidia-smi logs it."""

from __future__ import annotations

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
    import random

    rng = random.Random(seed)
    out.write(MESSY_HEADER + "\n")
    name = "NVIDIA H100 80GB HBM3"
    hang = seconds - spin_seconds
    phases: list[tuple[int, str]] = [(0, "startup"), (45, "train")]  # (start second, what the job does)
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
            if what == "train":
                util = rng.randint(40, 99) if shape == "barrier" else min(100, max(5, int(rng.gauss(75, 22))))
                power = 120 + util * 5.6 + rng.uniform(-25, 25) * (1 if shape == "barrier" else 3)
                mem_util, clock = int(util * rng.uniform(0.3, 0.6)), rng.choice((1980, 1980, 1965, 1950))
            elif what == "checkpoint" and shape == "idle":
                util, power, mem_util, clock = rng.choice((0, 0, 0, 1, 3)), rng.uniform(65, 95), 0, 1980
            elif what == "checkpoint" and gpu == 0:
                util, power, mem_util, clock = rng.randint(0, 8), rng.uniform(110, 160), rng.randint(0, 3), 1980
            elif what in ("checkpoint", "spin"):
                util, power, mem_util, clock = 100, rng.uniform(118, 135), 0, 1980
            else:  # startup: loading, compiling
                util, power, mem_util, clock = rng.choice((0, 0, 0, 2, 15)), rng.uniform(70, 110), 0, 1980
            temps[gpu] += (30 + power / 14 - temps[gpu]) * 0.05
            used = 73_000 + (gpu * 37 + second // 600) % 900 if what != "startup" else 2_000 + second * 1500
            day = iso_time(stamp, naive=True).replace("-", "/").replace("T", " ")
            out.write(f"{day}, {gpu}, {name}, {util} %, {mem_util} %, {power:.2f} W, 700.00 W, "
                      f"{clock} MHz, 1980 MHz, {min(used, 81_559)} MiB, 81559 MiB, {temps[gpu]:.0f}\n")
            written += 1
    return written
