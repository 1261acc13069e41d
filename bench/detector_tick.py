"""CPU time of one detector tick (all GPUs of a node) against GPU count (8, 64, 256), healthy and all
spinning: the daemon's newest tick judged by the same rules a replay runs over a day.

    python bench/detector_tick.py
"""

from __future__ import annotations

import time

from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.sample import sim


def tick_cost(gpus: int, behaviour: str, ticks: int = 600) -> float:
    ticks = ticks if gpus <= 64 else ticks // 4
    timeline = ((0, None, "train"),) if behaviour == "train" else ((0, None, "train"), (120, None, behaviour))
    scenario = sim.Scenario("bench", "", "h100", gpus, 120 + ticks, timeline, gpm=True)
    snapshots = list(sim.run(scenario))
    engine = DetectorEngine(Config())
    for snapshot in snapshots[:150]:  # warm up: windows full, baselines learned, spin established
        engine.observe(snapshot)
    measured = snapshots[150:]
    started = time.process_time()
    for snapshot in measured:
        engine.observe(snapshot)
    return (time.process_time() - started) / len(measured)


def main() -> None:
    print("detector CPU time per 1 s tick (sampling and export not included)")
    for gpus in (8, 64, 256):
        for behaviour, label in (("train", "healthy"), ("spin", "all spinning")):
            cost = tick_cost(gpus, behaviour)
            print(f"{gpus:>3} GPUs, {label:<13}: {cost * 1e6:8.0f} us/tick = {cost * 100:.3f}% of one core at 1 Hz")


if __name__ == "__main__":
    main()
