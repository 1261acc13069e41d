"""CPU time of one detector tick (all GPUs of a node) against GPU count (8, 64, 256), healthy and all
spinning: the daemon's newest tick judged by the same rules a replay runs over a day. Then the cost a tick
when the ticks are judged in batches (the live loop's sample.batch_seconds while nothing is suspected), with
the caches made cold between calls as a node's training leaves them.

    python bench/detector_tick.py
"""

from __future__ import annotations

import time

import numpy as np

from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.sample import sim

_SCRATCH = np.ones(4 << 20)  # 32 MiB read between calls: more than the caches hold


def tick_cost(gpus: int, behaviour: str, ticks: int = 600, batch: int = 1, cold: bool = False) -> float:
    ticks = ticks if gpus <= 64 else ticks // 4
    timeline = ((0, None, "train"),) if behaviour == "train" else ((0, None, "train"), (120, None, behaviour))
    scenario = sim.Scenario("bench", "", "h100", gpus, 120 + ticks, timeline, gpm=True)
    snapshots = list(sim.run(scenario))
    engine = DetectorEngine(Config())
    for snapshot in snapshots[:150]:  # warm up: windows full, baselines learned, spin established
        engine.observe(snapshot)
    measured = snapshots[150:]
    spent = 0.0
    for start in range(0, len(measured), batch):
        if cold:
            _SCRATCH.sum()
        began = time.process_time()
        engine.observe(measured[start:start + batch])
        spent += time.process_time() - began
    return spent / len(measured)


def main() -> None:
    print("detector CPU time per 1 s tick (sampling and export not included)")
    for gpus in (8, 64, 256):
        for behaviour, label in (("train", "healthy"), ("spin", "all spinning")):
            cost = tick_cost(gpus, behaviour)
            print(f"{gpus:>3} GPUs, {label:<13}: {cost * 1e6:8.0f} us/tick = {cost * 100:.3f}% of one core at 1 Hz")
    print("the same a tick, judged in batches of 1 / 5 / 10 ticks, caches cold between calls")
    for gpus in (8, 64):
        for behaviour, label in (("train", "healthy"), ("spin", "all spinning")):
            costs = [tick_cost(gpus, behaviour, batch=batch, cold=True) for batch in (1, 5, 10)]
            print(f"{gpus:>3} GPUs, {label:<13}: " + " / ".join(f"{cost * 1e6:.0f}" for cost in costs) + " us/tick")


if __name__ == "__main__":
    main()
